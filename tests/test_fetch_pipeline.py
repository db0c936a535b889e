"""The streamed fetch pipeline (the GPU's) run on the CPU through `ThreadedCpuOps`, with delayed copies.

Whatever the delays, every layer must attend to exactly the rows `DirectFetcher` gives it (same values,
the new token first) at every step, through restores and truncations, and `close()` must never hang.
The streamed runs keep CUDA's rules (conftest's `separate_devices`: the pool in emulated host memory, the
model on the emulated compute device); the direct reference runs on the plain CPU.
"""

import random
import threading
import time

import pytest
import torch

import infinigen_core.engine as engine_module
from infinigen_core.devices import SEPARATE_DEVICES_ENV
from infinigen_core.fetch import DirectFetcher, PendingFetch, StreamFetcher, make_fetcher
from infinigen_core.kv_pool import KVPool
from infinigen_core.transfer import ThreadedCpuOps

from conftest import make_tiny_engine, random_tokens

pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")


def jitter(seed: int, most_s: float = 0.002):
    """A per-copy delay of 0 to `most_s` seconds: copies land in varying order relative to the compute side."""
    rng = random.Random(seed)
    return lambda: rng.uniform(0, most_s)


@pytest.fixture
def attended(monkeypatch):
    """Every fetch's rows as the layer receives them, in order: [kv_heads, rows, dim] copies (keys, values)."""
    rows: list[tuple[torch.Tensor, torch.Tensor]] = []
    wait = PendingFetch.wait

    def recording_wait(self, new_keys, new_values, new_slots):
        fetched = wait(self, new_keys, new_values, new_slots)
        shape = (fetched.keys.shape[0], -1, fetched.keys.shape[-1])
        rows.append((fetched.keys.reshape(shape).clone(), fetched.values.reshape(shape).clone()))
        return fetched

    monkeypatch.setattr(PendingFetch, "wait", recording_wait)
    return rows


def streamed(monkeypatch, delay_s, zero_copy=False):
    """Engines built (or reconfigured) from here on fetch through StreamFetcher over ThreadedCpuOps; with
    `zero_copy` the compute side gathers selected rows from the pool in place (zero_copy.py) and the dense layers
    stay on the compute device (whose whole-layer fetches would otherwise queue behind every write), else
    staged and fetched whole."""
    monkeypatch.setattr(engine_module, "make_fetcher", lambda pool, device, max_rows, keep=None, **_: make_fetcher(
        pool, device, max_rows, ops=ThreadedCpuOps(delay_s, device=device), zero_copy=zero_copy,
        keep=keep if zero_copy else None))


def conversation(engine, restore: bool) -> torch.Tensor:
    """Prefill, decode, and (if `restore`) export/reset/import and truncate between decodes; all logits."""
    logits = [engine.prefill(random_tokens(90, seed=3))]
    logits += list(engine.score(random_tokens(6, seed=4)))
    if restore:
        saved = [engine.export_rows(0, 50), engine.export_rows(50, engine.num_tokens)]
        engine.reset()
        assert engine.import_rows(saved) == 96
        logits += list(engine.score(random_tokens(4, seed=5)))
        engine.truncate(93)  # regenerate: drop the last turns, then decode another way
        logits += list(engine.score(random_tokens(4, seed=6)))
        logits.append(engine.prefill(random_tokens(7, seed=7)))  # a new user turn between decodes
        logits += list(engine.score(random_tokens(3, seed=8)))
    return torch.stack(logits)


def run(model, monkeypatch, attended, delay_s=None, restore=False, zero_copy=False, **settings):
    """The conversation's logits and every layer's attended rows, direct (delay_s None) or streamed."""
    with monkeypatch.context() as patch:
        if delay_s is not None:
            streamed(patch, delay_s, zero_copy)
        else:
            patch.delenv(SEPARATE_DEVICES_ENV, raising=False)
        attended.clear()
        settings.setdefault("selects_ahead", True)  # direct and streamed select alike, one layer ahead
        settings.setdefault("budget_by_head", False)  # and every head k rows (a streamed fetch's heads never share)
        with make_tiny_engine(model, prefill_chunk=40, **settings) as engine:
            assert type(engine.fetcher) is (DirectFetcher if delay_s is None else StreamFetcher)
            assert getattr(engine.fetcher, "mapped", None) is not None or not zero_copy
            logits = conversation(engine, restore)
    return logits, list(attended)


def assert_same_rows(direct_rows, streamed_rows):
    assert len(streamed_rows) == len(direct_rows) > 0
    for index, ((keys, values), (expected_keys, expected_values)) in enumerate(zip(streamed_rows, direct_rows)):
        assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values), f"fetch {index} differs"


@pytest.mark.parametrize("settings", [
    dict(policy="infinigen", budget=0.2),
    dict(policy="offload"),
    dict(policy="h2o", budget=0.3),
    dict(policy="infinigen", budget=0.3, pool_limit_tokens=80, recent_window=16),  # eviction: slots per layer
], ids=["infinigen", "offload", "h2o", "infinigen-evicting"])
def test_delayed_copies_attend_the_rows_direct_gives(tiny_llama, monkeypatch, attended, settings):
    direct_logits, direct_rows = run(tiny_llama, monkeypatch, attended, **settings)
    logits, rows = run(tiny_llama, monkeypatch, attended, delay_s=jitter(seed=1), **settings)
    assert_same_rows(direct_rows, rows)
    torch.testing.assert_close(logits, direct_logits, rtol=0, atol=0)


@pytest.mark.parametrize("policy", ["infinigen", "offload"])
def test_restores_interleaved_with_decoding(tiny_llama, monkeypatch, attended, policy):
    direct_logits, direct_rows = run(tiny_llama, monkeypatch, attended, restore=True, policy=policy, budget=0.25)
    logits, rows = run(tiny_llama, monkeypatch, attended, delay_s=jitter(seed=2), restore=True,
                       policy=policy, budget=0.25)
    assert_same_rows(direct_rows, rows)
    torch.testing.assert_close(logits, direct_logits, rtol=0, atol=0)


def test_rows_gathered_in_place_never_overtake_a_delayed_write(tiny_llama, monkeypatch, attended):
    """The compute side gathers selected rows from the pool itself (zero_copy.py) while the pool's new rows,
    which it writes into the pool itself, land late (slow writes, instant gathers; every row selected, the
    previous token's too): every fetch still holds the rows `DirectFetcher` gives, because a gather follows the
    compute side's work, its writes included."""
    settings = dict(policy="infinigen", budget=1.0, alpha=1e9, dense_under_budget=False)
    slow_writes = lambda: 0.02 if threading.current_thread().name == "cpu-ops-to-host" else 0.0  # noqa: E731
    direct_logits, direct_rows = run(tiny_llama, monkeypatch, attended, **settings)
    logits, rows = run(tiny_llama, monkeypatch, attended, delay_s=slow_writes, zero_copy=True, **settings)
    assert_same_rows(direct_rows, rows)
    torch.testing.assert_close(logits, direct_logits, rtol=0, atol=0)


@pytest.mark.parametrize("settings", [dict(policy="offload"), dict(policy="infinigen", budget=1.0),
                                      dict(policy="streaming", budget=0.3)],
                         ids=["offload", "infinigen-under-budget", "streaming"])
def test_whole_layers_and_the_host_read_what_was_written_in_place(tiny_llama, monkeypatch, attended, settings):
    """The compute side writes the new rows into the pool in place (zero_copy.py) and its writes land late: a
    whole layer's upload (`offload`, and sparse layers the budget covers) still carries the previous token's rows,
    because it follows the compute side's work, as does the worker's gather of `streaming`'s slots, chosen on the
    host; the export, the truncate, the restore and the prefill between
    decodes read them after a flush, which waits for those writes."""
    slow_writes = lambda: 0.02 if threading.current_thread().name == "cpu-ops-to-host" else 0.0  # noqa: E731
    direct_logits, direct_rows = run(tiny_llama, monkeypatch, attended, restore=True, **settings)
    logits, rows = run(tiny_llama, monkeypatch, attended, delay_s=slow_writes, zero_copy=True, restore=True,
                       **settings)
    assert_same_rows(direct_rows, rows)
    torch.testing.assert_close(logits, direct_logits, rtol=0, atol=0)


@pytest.mark.parametrize("model_fixture, zero_copy", [("tiny_llama", False), ("tiny_opt", False), ("tiny_llama", True)],
                         ids=["llama", "opt", "llama-zero-copy"])
def test_full_budget_streamed_equals_full(request, monkeypatch, attended, model_fixture, zero_copy):
    """Every row fetched gives `full`'s logits; with `zero_copy` every row is selected and gathered in place
    (dense_under_budget off: the selecting path runs although the budget covers every token)."""
    model = request.getfixturevalue(model_fixture)
    full_logits, _ = run(model, monkeypatch, attended, policy="full")
    logits, _ = run(model, monkeypatch, attended, delay_s=jitter(seed=3), zero_copy=zero_copy, policy="infinigen",
                    budget=1.0, alpha=1e9, dense_under_budget=not zero_copy)
    torch.testing.assert_close(logits, full_logits, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ the fetcher alone
def filled_pool(tokens=40) -> KVPool:
    pool = KVPool(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    for layer, slots in enumerate(pool.reserve(tokens)):
        pool.write(layer, slots, torch.randn(2, tokens, 4, generator=generator), torch.randn(2, tokens, 4, generator=generator))
    return pool


def expected_rows(pool, layer, slots, new_keys, new_values):
    keys, values = pool.gather(layer, slots)
    return torch.cat([new_keys, keys], dim=1), torch.cat([new_values, values], dim=1)


def test_fetches_in_flight_at_once_keep_their_staging(monkeypatch):
    """Three fetches without a wait in between: the third reuses the first's staging buffer only once
    that buffer's upload is done."""
    pool = filled_pool()
    # indices reach the host at once, uploads take long: the third gather comes while the first uploads
    slow_uploads = lambda: 0.0 if threading.current_thread().name == "cpu-ops-to-host" else 0.05  # noqa: E731
    fetcher = make_fetcher(pool, torch.device("cpu"), max_rows=16, ops=ThreadedCpuOps(slow_uploads))
    new_keys, new_values, new_slots = torch.zeros(2, 1, 4), torch.ones(2, 1, 4), torch.tensor([40])
    try:
        requests = [(layer, torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(seed)))
                    for seed, layer in enumerate((0, 1, 0))]
        pending = [fetcher.start_rows(layer, slots) for layer, slots in requests]
        for (layer, slots), fetch in zip(requests, pending):
            fetched = fetch.wait(new_keys, new_values, new_slots)
            keys, values = expected_rows(pool, layer, slots, new_keys, new_values)
            assert torch.equal(fetched.keys, keys) and torch.equal(fetched.values, values)
    finally:
        fetcher.close()


def test_flush_waits_for_the_copies_in_flight():
    """After flush the pool may be overwritten (truncate, restore): no upload may still be reading it."""
    pool = filled_pool()
    ops = ThreadedCpuOps(delay_s=0.05)
    fetcher = make_fetcher(pool, torch.device("cpu"), max_rows=16, ops=ops)
    try:
        fetcher.start_layer(0), fetcher.start_layer(1)  # two heads each, keys and values: 8 copies
        fetcher.flush()
        assert ops.copies == 8
    finally:
        fetcher.close()


def test_close_in_the_middle_of_a_fetch_does_not_hang():
    earlier = set(threading.enumerate())  # an engine of an earlier test may still be closing its own
    pool = filled_pool()
    ops = ThreadedCpuOps(delay_s=30.0)  # every copy would take half a minute: close must cut it short
    fetcher = make_fetcher(pool, torch.device("cpu"), max_rows=16, ops=ops)
    slots = torch.arange(10).repeat(2, 1)
    new_keys, new_values = torch.zeros(2, 1, 4), torch.ones(2, 1, 4)
    fetcher.write(0, torch.tensor([39]), new_keys, new_values)  # still landing when close comes
    rows, layer = fetcher.start_rows(1, slots), fetcher.start_layer(1)
    time.sleep(0.05)
    started = time.perf_counter()
    fetcher.close()
    assert time.perf_counter() - started < 2.0
    assert not any(thread.name.startswith(("kv-fetch", "cpu-ops")) for thread in set(threading.enumerate()) - earlier)
    for pending in (rows, layer):  # each in flight either completed or failed cleanly: never hangs
        try:
            pending.wait(new_keys, new_values, torch.tensor([39]))
        except RuntimeError as error:
            assert "closed" in str(error)
    assert torch.equal(pool.keys(0)[:, 39:40], new_keys), "a write started before close still lands"
    with pytest.raises(RuntimeError, match="closed"):
        fetcher.start_rows(1, slots)
    fetcher.close()  # twice is harmless


def test_closing_an_engine_in_the_middle_of_a_decode(tiny_llama, monkeypatch):
    """The decode thread ends (done, or a RuntimeError from the closed fetcher) and nothing leaks."""
    streamed(monkeypatch, 0.2)
    engine = make_tiny_engine(tiny_llama, policy="infinigen", budget=0.2)
    engine.prefill(random_tokens(60, seed=1))
    outcome = []

    def decode():
        try:
            outcome.append(engine.decode(5))
        except RuntimeError as error:
            outcome.append(error)

    decoding = threading.Thread(target=decode)
    decoding.start()
    time.sleep(0.3)  # inside the step, waiting on a copy
    engine.close()
    decoding.join(5.0)
    assert not decoding.is_alive() and len(outcome) == 1
    assert isinstance(outcome[0], (torch.Tensor, RuntimeError))
