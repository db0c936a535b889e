"""CUDA's rules on the CPU (infinigen_core/devices.py), and the engine's paths that broke them.

Every test here runs under conftest's `separate_devices`: engines compute on the emulated device and keep
their pool in emulated host memory, and the mode refuses what a GPU would. Each engine case below failed
under the mode before its fix; its logits are compared with the same conversation on the plain CPU.
"""

import gc
import threading
import weakref

import pytest
import torch
from test_gemma_decode import VOCAB, tiny_gemma

import infinigen_core.compiled as compiled_module
import infinigen_core.engine as engine_module
from infinigen_core import devices
from infinigen_core.config import EngineConfig
from infinigen_core.devices import EMULATED_COMPUTE, EMULATED_HOST, SEPARATE_DEVICES_ENV, SeparateDevicesError
from infinigen_core.fetch import StreamFetcher, make_fetcher, resident_layer_set
from infinigen_core.kv_pool import KVPool
from infinigen_core.transfer import ThreadedCpuOps, Worker

from conftest import make_tiny_engine, random_tokens


# ------------------------------------------------------------------ the mode itself
def test_an_op_mixing_host_and_compute_is_refused_by_name():
    host = torch.zeros(4, device=EMULATED_HOST)
    compute = torch.ones(4, device=EMULATED_COMPUTE)
    with pytest.raises(SeparateDevicesError, match=r"aten\.add\.Tensor mixes host memory"):
        host + compute
    with pytest.raises(SeparateDevicesError, match="index_copy_"):
        compute.index_copy_(0, torch.arange(2, device=EMULATED_HOST), torch.ones(2, device=EMULATED_COMPUTE))


def test_sides_follow_the_tensors_an_op_reads():
    host = torch.zeros(4, device=EMULATED_HOST)
    compute = torch.ones(4, device=EMULATED_COMPUTE)
    assert devices.side_of(host[1:] * 2) == devices.HOST
    assert devices.side_of(compute.sum()) == devices.COMPUTE
    assert devices.side_of(host.to(EMULATED_COMPUTE)) == devices.COMPUTE  # an explicit copy crosses
    untagged = torch.ones(4)  # the plain CPU: mixes with either side
    assert devices.side_of(untagged + compute) == devices.COMPUTE and devices.side_of(untagged + host) == devices.HOST


def test_the_transfer_layer_crosses():
    host = torch.zeros(4, device=EMULATED_HOST)
    with devices.crossing():
        host.copy_(torch.arange(4.0, device=EMULATED_COMPUTE))
    assert devices.side_of(host) == devices.HOST and host.tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("read", [lambda t: t.sum().item(), lambda t: t.tolist(), lambda t: t.nonzero(),
                                  lambda t: t[t > 0], lambda t: t.to(EMULATED_HOST), lambda t: bool(t.any())],
                         ids=["item", "tolist", "nonzero", "mask", "to-host", "bool"])
def test_a_host_read_of_a_compute_tensor_in_the_decode_step_is_refused(read):
    compute = torch.arange(4.0, device=EMULATED_COMPUTE)
    read(compute)  # outside the decode step: allowed (it only costs a wait on a GPU)
    with devices.decode_step(), pytest.raises(SeparateDevicesError, match="inside the decode step"):
        read(compute)
    with devices.decode_step():
        read(torch.arange(4.0, device=EMULATED_HOST))  # host values are the host's to read


def test_a_mapped_view_of_host_memory_is_only_gathered_from_and_written_rows_into():
    """The emulation of a CUDA view of pinned memory (zero-copy): the compute side may gather rows out of it
    with compute-side indices, write rows of its own into it at indices of its own (the pool's new rows), and
    take views of it; nothing else."""
    host = torch.arange(12.0, device=EMULATED_HOST).view(6, 2)
    mapped = devices.mapped_view(host)
    index = torch.tensor([4, 0, 4], device=EMULATED_COMPUTE)
    rows = mapped.view(-1, 2).index_select(0, index)
    assert devices.side_of(rows) == devices.COMPUTE and rows.tolist() == [[8.0, 9.0], [0.0, 1.0], [8.0, 9.0]]
    out = torch.empty(3, 2, device=EMULATED_COMPUTE)
    torch.index_select(mapped, 0, index, out=out)
    assert torch.equal(out, rows)
    host[0] = -1.0  # the same memory: what the host writes, the next gather reads
    assert mapped.index_select(0, index)[1].tolist() == [-1.0, -1.0]
    compute = torch.ones(6, 2, device=EMULATED_COMPUTE)
    mapped.index_copy_(0, index[1:2], compute[:1] * 7)  # a row of the compute side's, at its index: lands in place
    assert host[0].tolist() == [7.0, 7.0] and devices.side_of(mapped) == devices.MAPPED
    host_index, host_rows = torch.arange(1, device=EMULATED_HOST), torch.zeros(1, 2, device=EMULATED_HOST)
    writes = [lambda: mapped.index_copy_(0, host_index, compute[:1]), lambda: mapped.index_copy_(0, index[:1], host_rows),
              lambda: mapped.index_copy_(0, index[:1], mapped[:1]), lambda: mapped.copy_(compute),
              lambda: mapped.add_(1.0), lambda: torch.index_select(compute, 0, index, out=mapped[:3])]
    for write in writes:
        with pytest.raises(SeparateDevicesError, match="writes through a mapped view"):
            write()
    for other in (lambda: mapped + compute, lambda: mapped.sum(), lambda: mapped.clone(), lambda: compute @ mapped.T):
        with pytest.raises(SeparateDevicesError, match="may only gather"):
            other()
    with pytest.raises(SeparateDevicesError, match="indices must be on the compute device"):
        mapped.index_select(0, torch.arange(1, device=EMULATED_HOST))
    with pytest.raises(SeparateDevicesError, match="mixes host memory"):
        host + compute  # the host tensor under the view keeps its own rules


def mix():
    return torch.zeros(2, device=EMULATED_HOST) + torch.ones(2, device=EMULATED_COMPUTE)


def test_worker_threads_keep_the_rules():
    """The fetch worker and the copy streams enter the mode of the thread that made them."""
    worker = Worker("checked")
    try:
        with pytest.raises(SeparateDevicesError, match="add"):
            worker.submit(mix).result()
    finally:
        worker.stop()
    unchecked = []
    thread = threading.Thread(target=lambda: unchecked.append(mix()))  # a thread of its own: no mode
    thread.start(), thread.join()
    assert len(unchecked) == 1
    ops = ThreadedCpuOps(device=EMULATED_COMPUTE)
    try:
        host, stream = ops.host_empty((2,), torch.float32), ops.stream()
        ops.copy(host, torch.ones(2, device=EMULATED_COMPUTE), stream)  # the transfer layer's crossing
        ops.record(stream).synchronize()
        assert host.tolist() == [1.0, 1.0] and devices.side_of(host) == devices.HOST
        assert ops.to_host(host)[1] is None  # host memory already: as on CUDA, no copy and no event
    finally:
        ops.close()


# ------------------------------------------------------------------ the engine under the mode
def plain(monkeypatch, model, **settings):
    """An engine on the plain CPU (the reference a separated run must match): its layers select one layer
    ahead, as the separated run's do (on the plain CPU they would use their own query), and every KV head reads
    k rows, as they do where the pool is apart (on the plain CPU the heads would share the layer's budget)."""
    settings.setdefault("selects_ahead", True)
    settings.setdefault("budget_by_head", False)
    with monkeypatch.context() as patch:
        patch.delenv(SEPARATE_DEVICES_ENV)
        return make_tiny_engine(model, prefill_chunk=40, **settings)


def separated(model, **settings):
    engine = make_tiny_engine(model, prefill_chunk=40, **settings)
    assert engine.device == EMULATED_COMPUTE and engine.kernels is None
    # a copy to the compute device would carry every head's widest selection: the heads never share the budget
    assert not getattr(engine.policy, "heads_share_budget", False)
    return engine


def both(monkeypatch, model, conversation, **settings) -> tuple[torch.Tensor, torch.Tensor]:
    """The conversation's logits on the plain CPU and on the separated devices."""
    with plain(monkeypatch, model, **settings) as on_cpu, separated(model, **settings) as apart:
        return torch.stack(conversation(on_cpu)), torch.stack(conversation(apart))


@pytest.mark.parametrize("policy", ["full", "offload", "infinigen", "h2o"])
def test_the_separated_engine_decodes_as_the_plain_one(tiny_llama, monkeypatch, policy):
    def conversation(engine):
        if policy != "full" and engine.device == EMULATED_COMPUTE:
            assert isinstance(engine.fetcher, StreamFetcher) and engine.pool.device == EMULATED_HOST
        return [engine.prefill(random_tokens(90, seed=3)), *engine.score(random_tokens(4, seed=4))]

    reference, logits = both(monkeypatch, tiny_llama, conversation, policy=policy, budget=0.3)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def gemma():
    return tiny_gemma()


@pytest.mark.parametrize("policy", ["offload", "infinigen"])
def test_sliding_layers_prefill_from_the_host_pool_as_on_the_plain_cpu(gemma, monkeypatch, policy):
    """A sliding layer's prefill copies only the slots its window reaches from the host pool, the new rows put
    at their place in that copy: 90 tokens in chunks of 40 through a window of 16."""
    def conversation(engine):
        assert engine.device != EMULATED_COMPUTE or engine.pool.device == EMULATED_HOST
        return [engine.prefill(random_tokens(90, seed=3, vocab=VOCAB)),
                *engine.score(random_tokens(4, seed=4, vocab=VOCAB))]

    reference, logits = both(monkeypatch, gemma, conversation, policy=policy, budget=0.3)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ the paths that broke the rules (issue 29)
def prefill_then_decode(engine, tokens=90, steps=4):
    return [engine.prefill(random_tokens(tokens, seed=3)), *engine.score(random_tokens(steps, seed=4))]


def test_infinigen_configured_over_a_prefilled_pool(tiny_llama, monkeypatch):
    """bench gpu's flow: prefill under `full`, then switch to InfiniGen with the context in the pool."""
    def conversation(engine):
        logits = [engine.prefill(random_tokens(90, seed=3))]
        engine.configure(engine.config.with_changes(policy="infinigen", budget=0.3))
        return logits + list(engine.score(random_tokens(4, seed=4)))

    reference, logits = both(monkeypatch, tiny_llama, conversation, policy="full")
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 60], ids=["one-token", "sixty-tokens"])
def test_a_restored_session_decodes_as_before(tiny_llama, monkeypatch, tokens):
    """export -> reset -> import_rows -> decode, as every restored session runs (one token: the edge case)."""
    def conversation(engine):
        logits = [engine.prefill(random_tokens(tokens, seed=3))]
        saved = [engine.export_rows(0, tokens)]
        engine.reset()
        assert engine.import_rows(saved) == tokens
        return logits + list(engine.score(random_tokens(4, seed=4)))

    reference, logits = both(monkeypatch, tiny_llama, conversation, policy="infinigen", budget=0.3)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


def test_a_truncate_that_moves_rows(tiny_llama, monkeypatch):
    """Eviction reorders the slots; a truncate (regenerate) compacts them and InfiniGen rebuilds its keys."""
    def conversation(engine):
        logits = prefill_then_decode(engine)
        engine.truncate(60)
        return logits + list(engine.score(random_tokens(3, seed=5)))

    # the cache of selected rows too: slots reused by eviction and rows moved by the truncate must not be served
    reference, logits = both(monkeypatch, tiny_llama, conversation, policy="infinigen", budget=0.3,
                             pool_limit_tokens=80, recent_window=16, selected_rows_cache=32)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize("policy", ["infinigen", "h2o"])
def test_eviction_decodes_without_a_host_wait_per_layer(tiny_llama, monkeypatch, policy):
    """With eviction the slots are not positions: the selected slots' positions are looked up once the step
    has run (not in each layer), and H2O selects from its own copy of the positions on the compute device.
    The mode grants no exemption in the decode step, so a lookup per layer would be refused here."""
    recorded = {}

    def conversation(engine):
        logits = prefill_then_decode(engine, steps=6)
        assert engine.pool.evicted_tokens > 0
        last = engine.history[-1]
        recorded[engine.device] = [layer.selected_positions for layer in last.layers if layer.sparse]
        for layer in last.layers:
            if layer.sparse:  # selected past tokens the pool still holds in that layer
                held = set(engine.pool.positions(layer.layer).tolist())
                assert set(layer.selected_positions.flatten().tolist()) <= held
                assert layer.selected_positions.max() < last.position
        if policy == "h2o":
            mirror = engine.policy.positions[:, : engine.pool.size()]
            for layer in range(engine.pool.num_layers):
                assert mirror[layer].tolist() == engine.pool.positions(layer).tolist()
        return logits

    reference, logits = both(monkeypatch, tiny_llama, conversation, policy=policy, budget=0.3,
                             pool_limit_tokens=80, recent_window=16, selected_rows_cache=48)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)
    plain_positions, separated_positions = recorded.values()
    assert len(plain_positions) > 0
    for expected, got in zip(plain_positions, separated_positions):
        assert got.tolist() == expected.tolist()


def test_streaming_selects_in_host_memory(tiny_llama, monkeypatch):
    """StreamingLLM's slots are chosen on the host: their fetch has nothing to copy down and no event."""
    reference, logits = both(monkeypatch, tiny_llama, prefill_then_decode, policy="streaming", budget=0.3)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize("zero_copy", [False, True], ids=["worker-writes", "compute-side-writes"])
def test_the_pool_never_grows_under_a_write_in_flight(tiny_llama, monkeypatch, zero_copy):
    """Decoding past the pool's capacity (no `prepare`), and a prompt that `prepare` makes room for right after a
    decode step, while the last token's rows are still on their way to the pool (the worker's write, or the
    compute side's own write through the mapped view, zero_copy.py): a growth copies the pool, so a write landing
    in the old storage would be lost. Those writes land late here, so they are always behind when the pool grows."""
    late_writes = lambda: 0.05 if threading.current_thread().name == "cpu-ops-to-host" else 0.0  # noqa: E731
    monkeypatch.setattr(engine_module, "make_fetcher", lambda pool, device, max_rows, **_: make_fetcher(
        pool, device, max_rows, ops=ThreadedCpuOps(late_writes, device=device), zero_copy=zero_copy))
    in_flight = []
    allocate = engine_module.KVPool._allocate

    def recording_allocate(pool, capacity):  # a growth of the pool of the conversation's engine
        if engines and pool is engines[-1].pool and isinstance(engines[-1].fetcher, StreamFetcher):
            in_flight.append(engines[-1].fetcher.pending_host_work() or engines[-1].fetcher._written_on_device)
        allocate(pool, capacity)

    engines = []
    monkeypatch.setattr(engine_module.KVPool, "_allocate", recording_allocate)

    def past_capacity(engine):  # decode steps cross the capacity: the growth comes from `reserve`
        engines.append(engine)
        assert engine.pool.capacity == 256
        logits = prefill_then_decode(engine, tokens=250, steps=10)
        assert engine.pool.capacity > 256
        return logits

    def prompt_after_a_decode_step(engine):  # `prepare` makes room for the prompt right after a decode step
        engines.append(engine)
        logits = prefill_then_decode(engine, tokens=250, steps=3)
        assert engine.pool.capacity == 256
        logits.append(engine.prefill(random_tokens(10, seed=5)))
        assert engine.pool.capacity > 256
        return logits + list(engine.score(random_tokens(3, seed=6)))

    results = [both(monkeypatch, tiny_llama, past_capacity, policy="offload"),
               both(monkeypatch, tiny_llama, prompt_after_a_decode_step, policy="infinigen", budget=0.2,
                    dense_under_budget=False)]
    assert len(in_flight) == 4 and not any(in_flight), "the pool grew while the last token's writes were in flight"
    apart = [engine.fetcher for engine in engines if engine.device == EMULATED_COMPUTE]
    assert len(apart) == 2 and all((fetcher.mapped is not None) == zero_copy for fetcher in apart)
    for reference, logits in results:
        torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ the fetch redesigned for the GPU (issue 29, item 3)
def test_selected_rows_gathered_in_place_give_the_staged_logits(tiny_llama, monkeypatch):
    """The compute side gathers the selected rows from the pool in place and writes the new rows into it
    (zero_copy.py): the logits of the staged path (indices to the host, host gather, copy up; new rows copied
    down and written by the worker) and of the plain CPU, bit for bit, through a pool that grows
    mid-conversation, a truncate and a restore; the same bytes counted; and neither a selected slot nor a new
    row crosses to the host."""
    def conversation(engine):
        logits = [engine.prefill(random_tokens(250, seed=3))]
        copies = engine.fetcher.host.copies
        logits += engine.score(random_tokens(8, seed=4))  # past the pool's first 256 slots: it grows
        counted.append((engine.fetcher.bytes_fetched, engine.fetcher.host.copies - copies))
        engine.truncate(252)
        saved = [engine.export_rows(0, 252)]
        engine.reset()
        engine.import_rows(saved)
        return torch.stack(logits + list(engine.score(random_tokens(2, seed=5))))

    settings = dict(policy="infinigen", budget=0.2, dense_under_budget=False)
    counted: list[tuple[int, int]] = []
    engines = [plain(monkeypatch, tiny_llama, **settings), separated(tiny_llama, zero_copy_fetch=False, **settings),
               separated(tiny_llama, **settings)]
    try:
        assert engines[1].fetcher.mapped is None and engines[2].fetcher.mapped is not None
        reference, staged, mapped = [conversation(engine) for engine in engines]
    finally:
        for engine in engines:
            engine.close()
    torch.testing.assert_close(staged, reference, rtol=0, atol=1e-5)
    torch.testing.assert_close(mapped, staged, rtol=0, atol=0)
    (_, _), (staged_bytes, staged_copies), (mapped_bytes, mapped_copies) = counted
    assert mapped_bytes == staged_bytes > 0
    # 8 steps: the 2 sparse layers' slots and every layer's new K and V (4 layers x 2) stay on the device, written
    # into the pool in place; what is left is one copy a step, of its statistics (the alpha counts)
    assert staged_copies - mapped_copies == 8 * (2 + 4 * 2) and mapped_copies == 8


@pytest.mark.parametrize("policy", ["full", "offload", "infinigen"])
def test_a_decode_steps_inputs_keep_their_storage_from_step_to_step(tiny_llama, monkeypatch, policy):
    """docs/CAPTURE.md, piece 1: where the compute device is apart from the host, a one-token step's token, position
    and slot reach the model and the layers as views of one buffer, refilled at every step (what a captured step
    replays reads), with the values of that step; the logits stay the plain CPU's."""
    seen = []

    def conversation(engine):
        original = engine.decode_step

        def recording_step(**inputs):
            step = compiled_module._running.step
            if engine.device == EMULATED_COMPUTE:
                tensors = (inputs["input_ids"], inputs["position_ids"], step.device_slots[0])
                with devices.crossing():  # the test reads them (a host wait the step itself never makes)
                    values = [t.reshape(-1).tolist() for t in tensors]
                seen.append(([t.untyped_storage().data_ptr() for t in tensors], values, step.first_position,
                             engine.pool.size() - 1))
            return original(**inputs)

        engine.decode_step = recording_step
        logits = [engine.prefill(random_tokens(90, seed=3))]
        return logits + [engine.decode(token) for token in random_tokens(4, seed=4)]

    reference, logits = both(monkeypatch, tiny_llama, conversation, policy=policy, budget=0.3)
    torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)
    assert len(seen) == 4 and len({tuple(pointers) for pointers, *_ in seen}) == 1
    tokens = random_tokens(4, seed=4)
    for (_, (token, position, slot), first, last_slot), expected in zip(seen, tokens):
        assert token == [expected] and position == [first] and slot == [last_slot]


def test_the_load_check_of_the_mapped_view_asks_for_a_gather_and_a_write_that_land():
    """zero_copy.validate (run once per fetcher on a card): passes where gathers through the view and writes into it
    work; names the write where a row written through the view never reaches host memory."""
    from infinigen_core.zero_copy import validate

    class WritesGoNowhere(ThreadedCpuOps):
        def scatter(self, target, index, rows) -> None:
            pass

    with devices.SeparateDevicesMode():
        for ops_class, expected in ((ThreadedCpuOps, None), (WritesGoNowhere, "written through the mapped view")):
            ops = ops_class(delay_s=0.001, device=EMULATED_COMPUTE)
            try:
                reason = validate(ops, torch.float32, 8)
            finally:
                ops.close()
            assert reason == expected if expected is None else expected in reason


def test_zero_copy_is_refused_where_the_pool_counts_fetches(tiny_llama):
    engine = make_tiny_engine(tiny_llama, policy="infinigen", pool_limit_tokens=80, recent_window=16)
    limited_reason, limited_mapped = engine.fetcher.zero_copy_reason, engine.fetcher.mapped
    engine.configure(engine.config.with_changes(pool_limit_tokens=None))
    try:
        assert limited_mapped is None and "counts every fetch" in limited_reason
        assert engine.fetcher.mapped is not None and engine.fetcher.zero_copy_reason is None
    finally:
        engine.close()


def test_zero_copy_is_refused_where_the_compute_side_shares_the_pool_memory():
    """ThreadedCpuOps on the plain CPU: the slots are host tensors, every fetch would stay staged, so the fetcher
    says so (and keeps no unused gather buffers) rather than report a zero-copy fetch."""
    pool = KVPool(2, 2, 16, torch.float32, device="cpu")
    fetcher = make_fetcher(pool, torch.device("cpu"), 8, ops=ThreadedCpuOps(device="cpu"), zero_copy=True)
    try:
        assert fetcher.mapped is None and "shares the pool's memory" in fetcher.zero_copy_reason
        assert fetcher.device_bytes() == 0
    finally:
        fetcher.close()
    emulated = make_fetcher(KVPool(2, 2, 16, torch.float32, device=EMULATED_HOST), EMULATED_COMPUTE, 8, zero_copy=True)
    try:
        assert emulated.mapped is not None and emulated.zero_copy_reason is None
    finally:
        emulated.close()


def test_the_in_place_gathers_keep_no_old_pool_storage_alive(tiny_llama):
    """A pool's old storage goes as soon as the pool lets it go, though the compute side gathered from it: after
    a truncate gives memory back (release_spare), and when the pool drops its storage with the fetcher still
    alive (release_pinned_memory's way in configure and close, on a GPU: pinned memory back to the system)."""
    engine = separated(tiny_llama, policy="infinigen", budget=0.2, dense_under_budget=False)
    try:
        assert engine.fetcher.mapped is not None
        engine.prefill(random_tokens(90, seed=3))
        engine.pool.ensure_capacity(5000)  # past the tiny model's context, as a long reply prepares for
        engine.policy.ensure_capacity(engine.pool.capacity)
        engine.score(random_tokens(4, seed=4))  # gathered in place from the grown storage
        grown = weakref.ref(engine.pool.storage)
        engine.truncate(40)  # under a quarter of the capacity: the pool reallocates smaller
        assert engine.pool.capacity < 5000
        gc.collect()
        assert grown() is None, "the old storage is still held after the pool released it"
        logits = engine.score(random_tokens(2, seed=5))  # the gathers follow the new storage
        assert all(torch.isfinite(step).all() for step in logits)
        current = weakref.ref(engine.pool.storage)
        engine.pool.drop_storage()
        gc.collect()
        assert current() is None, "the fetcher keeps the dropped storage (and its pinned memory) alive"
    finally:
        engine.close()


# ------------------------------------------------------------------ what stays on the compute device (issue 29, item 3)
def test_dense_layers_and_recently_selected_rows_stay_on_the_device(tiny_llama, monkeypatch):
    """Fewer bytes cross per step with the dense layers resident, fewer again with the selected-row cache, and
    the logits stay the plain CPU's, through a truncate and a restore (the resident rows are uploaded again)."""
    def conversation(engine):
        logits = [engine.prefill(random_tokens(120, seed=3))]
        before = engine.fetcher.bytes_fetched
        logits += engine.score(random_tokens(6, seed=4))
        crossed.append((engine.fetcher.bytes_fetched - before) / 6)
        engine.truncate(100)
        saved = [engine.export_rows(0, 100)]
        engine.reset()
        engine.import_rows(saved)
        return logits + list(engine.score(random_tokens(3, seed=5)))

    per_step = []
    for keep in ({"dense_layers_on_device": False}, {}, {"selected_rows_cache": 64}):
        crossed: list[float] = []
        reference, logits = both(monkeypatch, tiny_llama, conversation, policy="infinigen", budget=0.3,
                                 dense_under_budget=False, **keep)
        torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)
        per_step.append(crossed[-1])  # the separated run's (the plain CPU moves nothing)
    whole, resident, cached = per_step
    row = 2 * 2 * 16 * 4  # K and V rows, 2 KV heads, head_dim 16, float32
    assert whole - resident == 2 * 123.5 * row  # the two dense layers, 121 to 126 rows a step, no longer move
    assert 0 < cached < resident


def test_offload_keeps_the_layers_that_fit_in_infinigens_device_memory(tiny_llama):
    """The fair baseline (fetch.resident_layer_set): offload keeps whole the layers that fit in the device memory
    InfiniGen's KV-side state takes under the same settings, over the model's window: its read-whole layers,
    partial keys, gather buffers and selected-row cache."""
    config = EngineConfig(budget=0.1, partial_ratio=0.5, min_fetch_tokens=0)
    sliding = [True, True, False, True, True, True]  # layer 2 reads its window only: InfiniGen keeps it whole
    assert resident_layer_set("infinigen", sliding, config, 128, 16384) == {0, 1, 2}
    # 3 whole + 3 x 0.25 (a half of the keys) + 2 x 1640 rows / 16384 = 3.95 layers: 3, the same ones
    assert resident_layer_set("offload", sliding, config, 128, 16384) == {0, 1, 2}
    # a cache of 4096 rows in each of the 3 selecting layers: 0.75 layer more, 4.7: the first selecting layer too
    assert resident_layer_set("offload", sliding, config.with_changes(selected_rows_cache=4096), 128, 16384) == {0, 1, 2, 3}
    # InfiniGen's budget spread over its layers, the widest reading twice the uniform 1,638 rows: its gather
    # buffers hold 2 x 3,277 rows, 0.4 layer, so 4.15 layers fit: offload keeps the first selecting layer too
    assert resident_layer_set("offload", sliding, config, 128, 16384, widest_share=2.0) == {0, 1, 2, 3}
    assert resident_layer_set("offload", sliding, config.with_changes(zero_copy_fetch=False, partial_ratio=0.1),
                              128, 16384) == {0, 1, 2}
    for policy in ("full", "offload", "infinigen"):
        assert not resident_layer_set(policy, sliding, config.with_changes(dense_layers_on_device=False), 128, 16384)
    assert not resident_layer_set("full", sliding, config, 128, 16384)

    # the engine's: the tiny model's window is 1024 tokens; with every channel in the partial keys InfiniGen's
    # 2 dense layers + 2 x 0.5 + 2 x 155 rows / 1024 = 3.3 layers: offload keeps 3 and copies one per step
    with separated(tiny_llama, policy="offload", partial_ratio=1.0, budget=0.15) as engine:
        assert engine.fetcher.resident.layers == {0, 1, 2}
        engine.prefill(random_tokens(90, seed=3))
        before = engine.fetcher.bytes_fetched
        engine.score(random_tokens(1, seed=4))
        assert engine.fetcher.bytes_fetched - before == 91 * engine.pool.num_kv_heads * engine.pool.bytes_per_row()
