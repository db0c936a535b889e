"""A session that shrinks gives its memory back (issue 34): after a long prefill, a reset or a truncate to a
few tokens leaves the pool and the policy's per-slot state sized for what is left, and decoding goes on as
in a fresh engine; a session imported long and cut to about 100 tokens frees every tensor it grew (weak
references to their storage die), not only the sizes the accounting reads, and the shrink hands the C
heap's free pages back. Run under the separate-devices mode (the pool in emulated host memory, the policy's
state on the emulated compute device), where a mixed or stale storage would be refused."""

import gc
import inspect
import weakref

import pytest
import torch

from infinigen_core.pool_lifecycle import return_freed_heap

from conftest import make_tiny_engine, random_tokens

PROMPT = random_tokens(300, seed=11)
KEPT = 40
GROWTH = 32  # the engine's pool grows in 1024-token steps; a tiny model's window is 1024, so smaller here


def long_session(model, policy):
    engine = make_tiny_engine(model, policy=policy, budget=0.3, prefill_chunk=40)
    engine.pool.growth_tokens = GROWTH
    engine.prefill(PROMPT)
    return engine


def held_bytes(engine) -> int:
    """What the pool's and the policy's tensors really hold (storage sizes, not the accounting's word)."""
    pool = engine.pool
    tensors = [pool._positions, pool._fetch_counts, *(t for store in pool._layers for t in (store.keys, store.values))]
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values()) + engine.policy.device_bytes()


def decode_after(engine, prompt):
    """Logits of the prompt's prefill (if any) and four decode steps after it."""
    steps = random_tokens(4, seed=12)
    first = [engine.prefill(prompt)] if prompt else []
    return torch.stack([*first, *engine.score(steps)])


@pytest.mark.parametrize("policy", ["infinigen", "h2o"])  # the policies with per-slot state
def test_a_truncate_to_a_few_tokens_gives_memory_back_and_decodes_as_a_fresh_engine(tiny_llama, separate_devices,
                                                                                       policy):
    with long_session(tiny_llama, policy) as engine, \
            make_tiny_engine(tiny_llama, policy=policy, budget=0.3, prefill_chunk=40) as fresh:
        capacity, held, device_bytes = engine.pool.capacity, held_bytes(engine), engine.policy.device_bytes()
        assert capacity >= len(PROMPT)
        engine.truncate(KEPT)
        assert engine.pool.capacity == 3 * GROWTH  # twice the 40 tokens kept (80), rounded up to the growth step
        assert held_bytes(engine) * 3 < held
        if policy == "infinigen":  # the partial key cache shrank with the pool
            assert engine.policy.device_bytes() * 3 < device_bytes
        fresh.prefill(PROMPT[:KEPT])
        logits, reference = decode_after(engine, []), decode_after(fresh, [])
        assert engine.history[-1].layers[-1].sparse  # the sparse path ran after the shrink
        torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


def test_a_reset_gives_memory_back_and_the_next_conversation_matches_a_fresh_one(tiny_llama, separate_devices):
    with long_session(tiny_llama, "infinigen") as engine, make_tiny_engine(tiny_llama, budget=0.3, prefill_chunk=40) as fresh:
        held = held_bytes(engine)
        engine.reset()
        assert engine.pool.capacity == GROWTH and engine.num_tokens == 0
        assert held_bytes(engine) * 8 < held
        prompt = random_tokens(KEPT, seed=13)
        torch.testing.assert_close(decode_after(engine, prompt), decode_after(fresh, prompt), rtol=0, atol=1e-5)


def test_an_edit_near_the_end_keeps_the_storage(tiny_llama, separate_devices):
    """Hysteresis: regenerating the last turn of a long session must not reallocate the pool."""
    with long_session(tiny_llama, "infinigen") as engine:
        keys, partial = engine.pool._storage.layers[0].keys, engine.policy._partial_all
        engine.sync_to(PROMPT[:250] + random_tokens(30, seed=14))
        assert engine.pool._storage.layers[0].keys is keys and engine.policy._partial_all is partial


def _tensors_in(value, depth: int = 2):
    """Tensors in a value: itself, its items (lists, tuples, dicts), or, `depth` levels down, its attributes."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple, dict)):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _tensors_in(item, depth)
    elif depth and hasattr(value, "__dict__") and not isinstance(value, (type, torch.nn.Module)):
        for attribute in vars(value).values():
            yield from _tensors_in(attribute, depth - 1)


def capacity_sized_storages(engine) -> list[tuple[str, weakref.ref]]:
    """Weak references to the storage of every tensor of the pool, the policy and the fetcher that has a
    dimension of the pool's capacity (or one more): what a pool grown for a long session holds because of
    its length."""
    capacity, found = engine.pool.capacity, []
    for owner_name, owner in (("pool", engine.pool), ("policy", engine.policy), ("fetcher", engine.fetcher)):
        for name, value in vars(owner).items():
            for tensor in _tensors_in(value):
                if {capacity, capacity + 1} & set(tensor.shape):
                    found.append((f"{owner_name}.{name}", weakref.ref(tensor.untyped_storage())))
    return found


@pytest.mark.parametrize("policy", ["infinigen", "h2o"])
def test_an_imported_session_cut_to_about_100_tokens_frees_the_storage_it_grew(tiny_llama, separate_devices, policy):
    """Issue 34's row, scaled: a session imported long (its rows restored, no model run) and then cut to about
    100 tokens, as an edit or a regeneration cuts it (`truncate`), lets go of every tensor sized for the long
    pool: the pool's K/V, positions and counts, the policy's per-slot state (InfiniGen's partial key cache:
    a slice of it would keep the whole old cache alive while the accounting shrinks) and the fetcher's
    resident layers. Nothing keeps the old storage alive, not only the sizes in use shrink."""
    long_ids = random_tokens(900, seed=15)
    with make_tiny_engine(tiny_llama, policy=policy, budget=0.3, prefill_chunk=300) as source:
        source.prefill(long_ids)
        rows = source.export_rows(0, len(long_ids))
    with make_tiny_engine(tiny_llama, policy=policy, budget=0.3, prefill_chunk=40) as engine:
        engine.pool.growth_tokens = GROWTH
        assert engine.import_rows([rows]) == len(long_ids)
        del rows
        engine.score(random_tokens(2, seed=16))  # decode steps: the fetcher and the policy's state in use
        grown = capacity_sized_storages(engine)
        names = {name for name, _ in grown}
        assert engine.pool.capacity >= 900 and {"pool._layers", "pool._positions", "pool._fetch_counts"} <= names
        assert "fetcher.resident" in names  # the dense layers kept whole on the emulated device
        if policy == "infinigen":
            assert "policy._partial_all" in names
        engine.truncate(107)
        gc.collect()
        assert engine.pool.capacity == 7 * GROWTH  # twice the 107 tokens kept (214), rounded up to the step
        assert [name for name, storage in grown if storage() is not None] == []
        assert engine.score(random_tokens(2, seed=17)).isfinite().all() and engine.num_tokens == 109


def resident_mib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) // 1024


def test_a_shrink_hands_the_freed_c_heap_back_to_the_system(tiny_llama):
    """Blocks under malloc's mmap threshold (a long import's temporaries, a grown pool's smaller storages) live
    in the C heap, and glibc keeps freed heap memory resident unless its top is free: freed, they stayed in
    the process until it exited (a 30k-token import cut to 107 tokens kept ~250 MiB). The shrink trims it."""
    if not return_freed_heap():  # also the baseline: nothing freed earlier in this process is left to trim
        pytest.skip("no malloc_trim in this C library")
    with long_session(tiny_llama, "infinigen") as engine:
        freed = [torch.ones(24_000, dtype=torch.uint8) for _ in range(4_000)]  # ~92 MiB of 24 KB blocks
        top = torch.ones(24_000, dtype=torch.uint8)  # allocated after them: the heap's top is not free
        del freed
        resident = resident_mib()
        engine.truncate(KEPT)
        assert engine.pool.capacity == 3 * GROWTH
        assert resident_mib() < resident - 60, (resident, resident_mib())
        del top


def test_a_many_chunk_import_sizes_the_pool_once(tiny_llama, separate_devices, monkeypatch):
    """Issue 34: a restore of many chunks allocates the pool's storage once, for all of them, before the first
    chunk is copied in; grown chunk by chunk it copied the whole pool at every growth step and held two pools
    during each copy. Counted where storage is made (PoolStorage.allocate), with the bytes alive at that moment:
    the pool it replaces plus the new one never exceed the restored pool and the small one it started with."""
    from infinigen_core.pool_lifecycle import PoolStorage

    long_ids = random_tokens(900, seed=18)
    with make_tiny_engine(tiny_llama, budget=0.3, prefill_chunk=300) as source:
        source.prefill(long_ids)
        chunks = [source.export_rows(start, start + 150) for start in range(0, len(long_ids), 150)]
        reference = source.score(random_tokens(3, seed=19))
    with make_tiny_engine(tiny_llama, budget=0.3, prefill_chunk=40) as engine:
        engine.pool.growth_tokens = GROWTH
        started_with = engine.pool.bytes_allocated()
        made: list[tuple[int, int]] = []  # (capacity of the new storage, bytes alive once it exists)
        allocate = PoolStorage.allocate

        def counted(*args, **kwargs):
            storage = allocate(*args, **kwargs)
            replaced = inspect.signature(allocate).bind(*args, **kwargs).arguments.get("keep_from")
            made.append((storage.capacity, storage.bytes_allocated() + (replaced.bytes_allocated() if replaced else 0)))
            return storage

        monkeypatch.setattr(PoolStorage, "allocate", staticmethod(counted))
        assert engine.import_rows(chunks) == len(long_ids)
        assert [capacity for capacity, _ in made] == [29 * GROWTH]  # 900 tokens in 32-token steps: 928, once
        assert max(alive for _, alive in made) <= engine.pool.bytes_allocated() + started_with
        monkeypatch.undo()
        torch.testing.assert_close(engine.score(random_tokens(3, seed=19)), reference, rtol=0, atol=1e-5)
