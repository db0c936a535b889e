"""The KV pool's host layers are asked onto transparent huge pages (huge_pages.py), before their first write."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from infinigen_core.huge_pages import HUGE_PAGE_BYTES, advise_huge_pages
from infinigen_core.kv_pool import KVPool

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and smaps are Linux's")


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _first_whole_huge_page(tensor: torch.Tensor) -> int:
    return -(-tensor.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES


@linux_only
def test_a_large_tensor_is_advised_over_its_whole_huge_pages():
    tensor = torch.empty(3 * HUGE_PAGE_BYTES // 4 + 12345, dtype=torch.float32)  # 6 MB and a bit
    advised = advise_huge_pages(tensor)
    start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.numel() * 4
    assert advised % HUGE_PAGE_BYTES == 0
    assert end - start - 2 * HUGE_PAGE_BYTES < advised <= end - start  # all but the partial pages at its ends
    assert "hg" in _vm_flags(_first_whole_huge_page(tensor))


def test_a_tensor_without_a_whole_huge_page_is_left_alone():
    assert advise_huge_pages(torch.empty(1000)) == 0


@linux_only
def test_the_pool_layers_are_advised_and_keep_their_rows_when_they_grow():
    pool = KVPool(num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float32, initial_capacity=8192)
    slots = pool.reserve(3)
    rows = torch.arange(2 * 3 * 64, dtype=torch.float32).view(2, 3, 64)
    for layer in range(2):
        pool.write(layer, slots[layer], rows, -rows)
    pool.ensure_capacity(3 * 8192)  # a new storage: the rows are copied into freshly advised layers
    for layer in range(2):
        keys, values = pool.keys(layer), pool.values(layer)
        assert "hg" in _vm_flags(_first_whole_huge_page(keys))
        assert "hg" in _vm_flags(_first_whole_huge_page(values))
        assert torch.equal(keys[:, :3], rows) and torch.equal(values[:, :3], -rows)



@linux_only
def test_infinigens_partial_keys_are_advised_and_kept_when_they_grow(tiny_llama):
    from conftest import make_tiny_engine, random_tokens

    engine = make_tiny_engine(tiny_llama, policy="infinigen", budget=0.5)
    engine.prefill(random_tokens(40, seed=3))
    policy = engine.policy
    layer = policy.sparse_layers[0]
    before = policy.partial_keys_t[layer][..., :40].clone()
    policy.ensure_capacity(1 << 17)  # a cache of several MB: advised before its first write, the slots copied
    assert "hg" in _vm_flags(_first_whole_huge_page(policy._partial_all))
    assert torch.equal(policy.partial_keys_t[layer][..., :40], before) and before.abs().sum() > 0
    assert not policy.partial_keys_t[layer][..., 40:].any()


def _advised_during(monkeypatch) -> list[int]:
    """The addresses of the tensors the pool asks onto huge pages from now on (the advice itself still runs)."""
    from infinigen_core import pool_lifecycle

    advised: list[int] = []

    def advise(tensor: torch.Tensor) -> int:
        advised.append(tensor.data_ptr())
        return advise_huge_pages(tensor)

    monkeypatch.setattr(pool_lifecycle, "advise_huge_pages", advise)
    return advised


def _advised_layers(pool: KVPool, advised: list[int]) -> list[int]:
    stores = pool.storage.layers
    return [layer for layer, store in enumerate(stores)
            if store.keys.data_ptr() in advised and store.values.data_ptr() in advised]


@linux_only
def test_only_the_layers_read_by_slot_are_advised_and_stay_so_when_the_pool_grows(monkeypatch):
    """`huge_page_layers` (all but the `sliding_windows`): a sliding layer reads its last window, rows side by side, so it stays on small pages,
    whose first write does not wait for the kernel to assemble 2 MB pages (a fresh pool's restore). (Memory that
    the allocator hands out again may still carry an earlier tensor's advice: only what the pool asks is checked.)"""
    advised = _advised_during(monkeypatch)
    pool = KVPool(num_layers=3, num_kv_heads=2, head_dim=64, dtype=torch.float32, initial_capacity=8192,
                  sliding_windows={0: 512, 2: 512})
    for capacity in (8192, 3 * 8192):
        pool.ensure_capacity(capacity)
        assert _advised_layers(pool, advised) == [1] and len(advised) == 2 * (1 + (capacity > 8192))
        assert "hg" in _vm_flags(_first_whole_huge_page(pool.storage.layers[1].keys))
    assert _advised_layers(KVPool(num_layers=3, num_kv_heads=2, head_dim=64, dtype=torch.float32,
                                  initial_capacity=8192), advised) == [0, 1, 2]  # no sliding layer: every layer, as before


@linux_only
def test_a_sliding_window_models_pool_puts_only_its_global_layers_on_huge_pages(monkeypatch):
    from test_gemma_decode import tiny_gemma

    from infinigen_core.config import EngineConfig
    from infinigen_core.engine import InfiniGenEngine

    model, skew = tiny_gemma()  # layers 2 and 5 global, the others sliding
    engine = InfiniGenEngine(model, None, EngineConfig(policy="infinigen"), skew_set=skew)
    assert engine.pool.huge_page_layers == (2, 5)
    advised = _advised_during(monkeypatch)
    engine.pool.ensure_capacity(1 << 15)  # layers of 4 MB: whole huge pages inside each
    assert _advised_layers(engine.pool, advised) == [2, 5] and len(advised) == 4
    assert "hg" in _vm_flags(_first_whole_huge_page(engine.pool.storage.layers[5].values))
