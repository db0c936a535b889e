"""The host KV pool: growth, exact byte accounting, truncation, and eviction by fetch rate."""

import pytest
import torch

from infinigen_core.config import ConfigError, EngineConfig
from infinigen_core.kv_pool import KVPool, PoolCapacityError

from conftest import make_tiny_engine, random_tokens


def filled_pool(n, limit=None, sink=2, recent=4):
    pool = KVPool(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, limit_tokens=limit,
                  sink_tokens=sink, recent_window=recent, initial_capacity=4)
    for _ in range(n):
        append_token(pool)
    return pool


def append_token(pool):
    return append_token_to(pool, heads=2, dim=4)


def append_token_to(pool, heads, dim):
    position = pool.total_tokens
    for layer, slots in enumerate(pool.reserve(1)):
        rows = torch.full((heads, 1, dim), float(position))
        pool.write(layer, slots, rows, -rows)
    return position


def test_growth_keeps_rows_and_bytes_are_exact():
    pool = filled_pool(37)
    assert pool.size(0) == 37 and pool.total_tokens == 37
    assert pool.keys(1)[0, :, 0].tolist() == [float(p) for p in range(37)]
    capacity = pool._storage.layers[0].keys.shape[1]
    per_layer = 2 * (2 * capacity * 4 * 4) + 2 * capacity * 8  # K and V float32, positions and counts int64
    assert pool.bytes_allocated() == 2 * per_layer
    assert pool.bytes_used() == 37 * 2 * (2 * 2 * 4 * 4)
    assert pool.bytes_per_token() == 2 * 2 * 2 * 4 * 4


def test_gather_returns_rows_and_counts_fetches_when_eviction_needs_them():
    pool = filled_pool(10, limit=64)
    keys, values = pool.gather(0, torch.tensor([[1, 5], [5, 9]]))
    assert keys[0, :, 0].tolist() == [1.0, 5.0] and keys[1, :, 0].tolist() == [5.0, 9.0]
    torch.testing.assert_close(values, -keys)
    assert pool.fetch_counts(0)[[1, 5, 9, 0]].tolist() == [1, 2, 1, 0]
    unlimited = filled_pool(10)
    unlimited.gather(0, torch.tensor([[1, 5], [5, 9]]))
    assert unlimited.fetch_counts(0).sum() == 0  # nothing reads the counts: no work spent on them


def test_gather_fills_a_given_buffer():
    pool = filled_pool(10)
    out = (torch.empty(2, 2, 4), torch.empty(2, 2, 4))
    keys, values = pool.gather(1, torch.tensor([[3, 4], [0, 8]]), out=out)
    assert keys.data_ptr() == out[0].data_ptr() and values.data_ptr() == out[1].data_ptr()
    assert out[0][:, :, 0].tolist() == [[3.0, 4.0], [0.0, 8.0]]


def test_capacity_grows_in_large_steps_ahead_of_the_tokens():
    pool = KVPool(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, initial_capacity=4, growth_tokens=64)
    pool.ensure_capacity(70)
    assert pool.capacity == 128  # rounded up to the growth step
    keys = pool._storage.layers[0].keys
    for _ in range(100):
        append_token_to(pool, heads=1, dim=2)
    assert pool._storage.layers[0].keys is keys  # no reallocation inside the token loop


def test_a_size_asked_for_rounds_up_to_the_growth_step_not_twice_the_pool():
    """engine.prepare after a long prefill asks for a few more tokens: a pool of 4096 slots asked for 4200
    grows to 4224 (the next multiple of 64), not 8192 (on a GPU, twice a 32k pool of a 7B model is 32 GiB more pinned memory)."""
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, initial_capacity=4, growth_tokens=64)
    pool.ensure_capacity(4096)
    assert pool.capacity == 4096
    pool.ensure_capacity(4200)
    assert pool.capacity == 4224  # 66 growth steps
    assert not pool.grows_to_hold(4224) and pool.grows_to_hold(4225)


def test_growth_inside_decoding_stays_geometric():
    """A reserve past the capacity (no prepare) doubles: growing a token at a time would copy the pool
    again every growth step."""
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, initial_capacity=256,
                  growth_tokens=64)
    for _ in range(257):
        append_token_to(pool, heads=1, dim=2)
    assert pool.capacity == 512


def grown_pool(tokens):
    pool = KVPool(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, initial_capacity=4, growth_tokens=64)
    pool.ensure_capacity(tokens)
    for _ in range(tokens):
        append_token_to(pool, heads=1, dim=2)
    return pool


def test_a_pool_left_far_below_its_capacity_gives_memory_back_and_keeps_its_rows():
    pool = grown_pool(1000)
    assert pool.capacity == 1024
    before = pool.bytes_allocated()
    pool.truncate(40)
    assert pool.release_spare() is True
    assert pool.capacity == 128  # twice the 40 rows kept, rounded up to the growth step
    assert pool.bytes_allocated() * 8 == before  # every tensor of the pool shrank with it
    assert pool._storage.layers[1].keys.untyped_storage().nbytes() == 128 * 2 * 4  # new storage, not a view of the old
    assert pool.keys(1)[0, :, 0].tolist() == [float(p) for p in range(40)]
    assert pool.positions(0).tolist() == list(range(40))
    append_token_to(pool, heads=1, dim=2)
    assert pool.positions(1).tolist() == list(range(41))


def test_releasing_has_hysteresis():
    """A truncate that keeps a quarter or more of the capacity (a regenerated reply) keeps the storage, and
    after a shrink the pool must double before it grows again."""
    pool = grown_pool(1000)
    keys = pool._storage.layers[0].keys
    pool.truncate(300)
    assert pool.release_spare() is False and pool._storage.layers[0].keys is keys
    pool.truncate(200)
    assert pool.release_spare(upcoming=100) is False  # 300 tokens are about to come back
    assert pool.release_spare() is True and pool.capacity == 448  # 2 x 200 rounded up to 64
    keys = pool._storage.layers[0].keys
    for _ in range(200):
        append_token_to(pool, heads=1, dim=2)
    pool.truncate(120)
    assert pool.release_spare() is False and pool._storage.layers[0].keys is keys  # 120 x 4 > 448: kept
    pool.truncate(0)
    assert pool.release_spare() is True and pool.capacity == 64  # never below one growth step
    assert pool.release_spare() is False


def test_truncate_without_eviction_moves_nothing():
    pool = filled_pool(12)
    assert pool.truncate(5) is False and pool.slots_are_positions
    evicting = filled_pool(30, limit=12, sink=2, recent=4)
    assert evicting.truncate(20) is True


def test_truncate_forgets_later_tokens():
    pool = filled_pool(12)
    pool.truncate(5)
    assert pool.total_tokens == 5 and pool.size(0) == 5
    assert sorted(pool.positions(1).tolist()) == [0, 1, 2, 3, 4]
    assert append_token(pool) == 5


def test_eviction_honours_the_limit_and_spares_sinks_and_recent():
    pool = filled_pool(30, limit=12, sink=2, recent=4)
    for layer in range(2):
        positions = sorted(pool.positions(layer).tolist())
        assert len(positions) == 12
        assert {0, 1} <= set(positions)  # sinks
        assert set(range(26, 30)) <= set(positions)  # recent window
    assert pool.evicted_tokens == 18


def test_eviction_takes_the_lowest_fetch_rate_then_the_oldest():
    pool = filled_pool(12, limit=12, sink=2, recent=4)
    slot_of = {int(p): i for i, p in enumerate(pool.positions(0).tolist())}
    # positions 2..7 are evictable; fetch 2, 3 and 5 often, 6 once
    for position, times in ((2, 5), (3, 5), (5, 5), (6, 1)):
        for _ in range(times):
            pool.gather(0, torch.tensor([[slot_of[position]], [slot_of[position]]]))
    evicted = []
    for _ in range(3):
        before = set(pool.positions(0).tolist())
        append_token(pool)
        evicted.append((before - set(pool.positions(0).tolist())).pop())
    assert evicted == [4, 7, 8]  # never fetched, oldest first: 4, 7; then 8 left the recent window
    assert 6 in pool.positions(0).tolist() and 2 in pool.positions(0).tolist()


def test_a_new_occupant_does_not_inherit_the_count_and_victims_vary():
    pool = filled_pool(12, limit=12, sink=2, recent=4)
    victims_slots = []
    for _ in range(6):
        slots = pool.reserve(1)
        for layer, s in enumerate(slots):
            pool.write(layer, s, torch.zeros(2, 1, 4), torch.zeros(2, 1, 4))
        victims_slots.append(int(slots[0]))
        assert pool.fetch_counts(0)[slots[0]].item() == 0
    assert len(set(victims_slots)) >= 4  # the freshly written slot is protected, so the victim moves on


def test_pool_limit_errors_are_clear():
    with pytest.raises(ConfigError, match="protected window"):
        EngineConfig(pool_limit_tokens=50, sink_tokens=4, recent_window=64)
    pool = filled_pool(12, limit=12, sink=2, recent=4)
    with pytest.raises(PoolCapacityError):
        pool.reserve(8)  # more new tokens than evictable slots


def test_engine_eviction_removes_rows_from_the_pool_and_the_partial_keys(tiny_llama):
    with make_tiny_engine(tiny_llama, policy="infinigen", budget=0.3, pool_limit_tokens=64, sink_tokens=4,
                          recent_window=16, prefill_chunk=16) as engine:
        engine.prefill(random_tokens(48, seed=2))
        engine.score(random_tokens(60, seed=3))
        engine.fetcher.flush()  # the last step's rows are written by the fetch worker (separate devices): let them land
        pool = engine.pool
        assert pool.total_tokens == 108 and pool.evicted_tokens == 44
        for layer in range(pool.num_layers):
            positions = pool.positions(layer)
            assert pool.size(layer) == 64 and positions.unique().numel() == 64
            assert set(range(4)) <= set(positions.tolist()) and set(range(92, 108)) <= set(positions.tolist())
            if engine.policy.is_sparse(layer):
                expected = pool.keys(layer).to(engine.device).float() @ engine.policy.projections[layer]
                torch.testing.assert_close(engine.policy.partial_keys(layer), expected)
        assert all(layer.fetched <= 64 for step in engine.history for layer in step.layers)
