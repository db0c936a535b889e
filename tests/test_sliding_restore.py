"""A restore leaves a sliding layer's rows older than its window in their chunk (pool_restore.py): nothing that
decodes reads them, and whatever asks for them gets them.

Each test restores the same chunk twice over a tiny Gemma 3 (window 16, two global layers of six): once as a
restore does (the rows deferred) and once with every row written at once (the reference). In the first the
deferred slots of the pool's storage are then filled with NaN: a path that read them would turn the logits into
NaN, so the logits must equal the reference's to the bit."""

from __future__ import annotations

import pytest
import torch
from test_gemma_decode import VOCAB, WINDOW, tiny_gemma

from infinigen_core.decode_lane import DecodeLane
from infinigen_core.fetch import DirectFetcher
from infinigen_core.kv_pool import KVPool
from infinigen_core.rows import KEYS, POSITIONS, TOKEN_IDS, VALUES, import_rows, tensor_name
from sessions.snapshots import read_chunk, write_chunk

from conftest import make_tiny_engine, random_tokens

SELECTING = dict(policy="infinigen", budget=0.3, alpha=4.0, min_fetch_tokens=0, dense_under_budget=False)
SLIDING = [0, 1, 3, 4]  # layers 2 and 5 are global
HELD = 80  # tokens in the chunk: each sliding layer's first HELD - WINDOW rows are older than its window


@pytest.fixture(scope="module")
def gemma():
    return tiny_gemma()


def _chunk(engine, folder, start: int, end: int) -> dict[str, torch.Tensor]:
    """Rows [start, end) written as an int8 chunk and read back from its file."""
    record = write_chunk(folder, "s", engine.export_rows(start, end), engine.kv_signature(), start, "int8")
    return read_chunk(folder, record, engine.kv_signature())


@pytest.fixture(scope="module")
def saved(gemma, tmp_path_factory):
    """A conversation of HELD tokens as a session holds it: an int8 chunk read back from its file (float16 keys,
    int8 value codes with a scale per row: what a reopened session imports), and the float32 rows it was written
    from."""
    engine = make_tiny_engine(gemma, **SELECTING)
    engine.prefill(random_tokens(HELD, seed=3, vocab=VOCAB))
    return _chunk(engine, tmp_path_factory.mktemp("chunks"), 0, HELD), engine.export_rows(0, HELD)


@pytest.fixture(scope="module")
def saved_in_pieces(gemma, tmp_path_factory):
    """The same conversation in three chunks, [0, 30), [30, 70) and [70, HELD): the window's first slot (64) in the
    second, the third wholly inside it."""
    engine = make_tiny_engine(gemma, **SELECTING)
    engine.prefill(random_tokens(HELD, seed=3, vocab=VOCAB))
    folder = tmp_path_factory.mktemp("pieces")
    return [_chunk(engine, folder, start, end) for start, end in ((0, 30), (30, 70), (70, HELD))]


def _restored(gemma, chunks, defer: bool, kernels=None, **settings):
    """An engine with `chunks` (one or a list) restored: its deferred rows poisoned, or (the reference) written."""
    engine = make_tiny_engine(gemma, kernels, **{**SELECTING, **settings})
    engine.import_rows(chunks if isinstance(chunks, list) else [chunks])
    if defer:
        _poison_deferred(engine.pool)
    else:
        engine.pool.write_deferred()  # the same pool, every row written
    return engine


@torch.inference_mode()
def _poison_deferred(pool) -> None:
    for layer in range(pool.num_layers):
        store, below = pool.storage.layers[layer], pool.deferred_slots(layer)
        store.keys[:, :below] = float("nan")
        store.values[:, :below] = float("nan")


def _continue(engine, question: list[int], steps: int = 6) -> torch.Tensor:
    """A question after the restored tokens, then `steps` greedy tokens: every step's logits."""
    logits = [engine.prefill(question)]
    for _ in range(steps):
        logits.append(engine.decode(int(logits[-1].argmax())))
    return torch.stack(logits)


def _deferred(engine) -> list[int]:
    return [engine.pool.deferred_slots(layer) for layer in range(engine.adapter.num_layers)]


QUESTION = random_tokens(7, seed=4, vocab=VOCAB)


@pytest.mark.one_device
def test_a_restore_writes_a_sliding_layers_window_and_every_global_row(gemma, saved):
    engine = _restored(gemma, saved[0], defer=True)
    assert _deferred(engine) == [HELD - WINDOW if layer in SLIDING else 0 for layer in range(6)]
    assert engine.num_tokens == HELD and engine.pool.size() == HELD


@pytest.mark.one_device
@pytest.mark.parametrize("path", ["lane", "python", "no kernels"])
def test_decoding_after_a_restore_never_reads_the_deferred_rows(gemma, saved, kernels, path, monkeypatch, lane_steps):
    """The C++ lane, the Python path with the CPU kernels and the one without them (torch's attention) decode a
    restored conversation as the fully written one does, and leave the deferred rows in their chunk."""
    if path == "python":
        monkeypatch.setattr(DecodeLane, "for_work", staticmethod(lambda work: None))
    kernels = None if path == "no kernels" else kernels
    reference = _continue(_restored(gemma, saved[0], defer=False, kernels=kernels), QUESTION)
    opened_by_reference = len(lane_steps)
    engine = _restored(gemma, saved[0], defer=True, kernels=kernels)
    logits = _continue(engine, QUESTION)
    assert torch.isfinite(logits).all()
    assert torch.equal(logits, reference)
    assert _deferred(engine) == [HELD - WINDOW if layer in SLIDING else 0 for layer in range(6)]
    assert (len(lane_steps) - opened_by_reference > 0) == (path == "lane")  # each path ran where it was meant to


def test_an_export_gives_the_deferred_rows_as_they_were_restored(gemma, saved):
    """Saving again (an export) reads the deferred rows from their chunk: the same rows as a restore that wrote
    them all, and a later export of new rows only leaves them where they are."""
    chunk = saved[0]
    reference = _restored(gemma, chunk, defer=False)
    engine = _restored(gemma, chunk, defer=True)
    deferred = _deferred(engine)
    tail = engine.export_rows(HELD - 10, HELD)  # inside every window: nothing deferred is read
    assert _deferred(engine) == deferred
    assert all(torch.equal(tail[name], rows) for name, rows in reference.export_rows(HELD - 10, HELD).items())
    whole, expected = engine.export_rows(0, HELD), reference.export_rows(0, HELD)
    assert whole.keys() == expected.keys()
    assert all(torch.equal(whole[name], expected[name]) for name in expected)
    assert _deferred(engine) == [0] * 6


@pytest.mark.parametrize("kept", [HELD - 5, HELD - WINDOW - 3, 10])
def test_a_truncate_writes_the_rows_its_window_reaches_again(gemma, saved, kept):
    """An edit cuts the conversation back: the window reaches rows that were older than it, and they are written
    before anything reads them (the decode after it equals the reference's)."""
    reference = _restored(gemma, saved[0], defer=False)
    engine = _restored(gemma, saved[0], defer=True)
    reference.truncate(kept)
    engine.truncate(kept)
    assert all(below <= max(0, kept - WINDOW) for below in _deferred(engine))
    assert torch.equal(_continue(engine, QUESTION), _continue(reference, QUESTION))


def test_a_growing_pool_keeps_the_deferred_rows_in_their_chunk(gemma, saved):
    """A pool that grows copies the rows it holds into new storage, not the deferred ones (they are not there):
    they stay deferred, and still come back right."""
    reference = _restored(gemma, saved[0], defer=False)
    engine = _restored(gemma, saved[0], defer=True)
    deferred = _deferred(engine)
    engine.pool.ensure_capacity(4 * engine.pool.capacity)
    assert _deferred(engine) == deferred
    _poison_deferred(engine.pool)  # the new storage's unwritten slots too
    assert torch.equal(_continue(engine, QUESTION), _continue(reference, QUESTION))
    whole, expected = engine.export_rows(0, HELD), reference.export_rows(0, HELD)
    assert all(torch.equal(whole[name], expected[name]) for name in expected)


@pytest.mark.parametrize("settings", [dict(pool_limit_tokens=60, recent_window=8), dict(policy="h2o", budget=0.5)],
                         ids=["a pool limit (a new pool)", "h2o (reads every slot's weight)"])
def test_what_reads_every_row_gets_them_written(gemma, saved, settings):
    """A settings change that copies the pool into a new one, and a policy that reads every slot's attention
    weight, read the deferred rows too: they are written first."""
    reference = _restored(gemma, saved[0], defer=False)
    engine = _restored(gemma, saved[0], defer=True)
    for each in (reference, engine):
        each.configure(each.config.__class__(**{**SELECTING, **settings}))
    logits = _continue(engine, QUESTION)
    assert torch.isfinite(logits).all() and torch.equal(logits, _continue(reference, QUESTION))


def test_the_restored_rows_are_the_chunks(gemma, saved):
    """Deferred or not, a restored row is the chunk's: the default format's rows (float16 keys, int8 value codes
    with a scale per row) against the float32 ones they were made from, within the codes' rounding (a check that
    the chunk under test is the coded one, whose scales a deferred row must take along)."""
    chunk, rows = saved
    engine = _restored(gemma, chunk, defer=True)
    whole = engine.export_rows(0, HELD)
    for layer in range(6):
        assert chunk[tensor_name(KEYS, layer)].dtype == torch.float16
        assert chunk[tensor_name(VALUES, layer)].dtype == torch.int8
        for kind in (KEYS, VALUES):
            name = tensor_name(kind, layer)
            assert (whole[name] - rows[name]).abs().max() <= rows[name].abs().amax() / 100


def test_a_restore_in_several_chunks_defers_across_them(gemma, saved_in_pieces):
    """The window's first slot inside the second chunk: the first chunk wholly deferred, the second in part, the
    third written; decoding after truncates into each of them, and an export, as the reference's."""
    engine = _restored(gemma, saved_in_pieces, defer=True)
    deferring = isinstance(engine.fetcher, DirectFetcher)  # not where a fetcher copies whole layers (a GPU)
    assert _deferred(engine) == [HELD - WINDOW if layer in SLIDING and deferring else 0 for layer in range(6)]
    reference = _restored(gemma, saved_in_pieces, defer=False)
    assert torch.equal(_continue(engine, QUESTION, steps=2), _continue(reference, QUESTION, steps=2))
    for kept in (60, 40, 20):  # the window reaches back into the second chunk, across the pieces, into the first
        engine.truncate(kept)
        reference.truncate(kept)
        assert torch.equal(_continue(engine, QUESTION, steps=2), _continue(reference, QUESTION, steps=2))
    whole, expected = engine.export_rows(0, 20), reference.export_rows(0, 20)
    assert all(torch.equal(whole[name], expected[name]) for name in expected)


def _numbered_chunk(start: int, end: int) -> dict[str, torch.Tensor]:
    """One layer's rows whose keys and values are their positions."""
    rows = torch.arange(start, end, dtype=torch.float32).view(1, -1, 1).expand(1, -1, 2).contiguous()
    return {TOKEN_IDS: torch.arange(start, end), tensor_name(KEYS, 0): rows, tensor_name(VALUES, 0): rows.clone(),
            tensor_name(POSITIONS, 0): torch.arange(start, end)}


def test_rows_written_before_an_import_are_never_taken_for_deferred_ones():
    """A reload whose last chunk lies inside the window, then another session's chunk imported after it (a
    prefix taken over): the rows between the deferred ones and the new chunk were written, and a growth, a
    shrink and an edit that reaches back to them keep them."""
    window = 4
    pool = KVPool(1, 1, 2, torch.float32, initial_capacity=16, growth_tokens=16, sliding_windows={0: window})
    token_ids: list[int] = []
    import_rows(pool, token_ids, [_numbered_chunk(0, 10), _numbered_chunk(10, 12)])
    assert pool.deferred_slots(0) == 12 - window
    import_rows(pool, token_ids, [_numbered_chunk(12, 30)])
    assert pool.deferred_slots(0) == 12 - window  # slots 8-11 were written: nothing after them is deferred
    pool.truncate(26)
    pool.ensure_capacity(200)
    pool.truncate(13)
    assert pool.release_spare()  # a shrink copies what is written too
    start = pool.window_start(0)
    window_rows = pool.storage.layers[0].keys[0, start : pool.size(), 0]  # as the lane reads them, by slot
    assert window_rows.tolist() == [float(slot) for slot in range(start, 13)]
    assert pool.keys(0)[0, :, 0].tolist() == [float(slot) for slot in range(13)]
