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
