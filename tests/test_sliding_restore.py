"""A restore leaves a sliding layer's rows older than its window in their chunk (pool_restore.py): nothing that
decodes reads them, and whatever asks for them gets them.

Each test restores the same chunk twice over a tiny Gemma 3 (window 16, two global layers of six): once as a
restore does (the rows deferred) and once with deferral off, every row written (the reference). In the first
the deferred slots of the pool's storage are then filled with NaN: a path that read them would turn the logits
into NaN, so the logits must equal the reference's to the bit."""

from __future__ import annotations

import pytest
import torch
from test_gemma_decode import VOCAB, WINDOW, tiny_gemma

from infinigen_core.decode_lane import DecodeLane
from infinigen_core.rows import KEYS, VALUES, tensor_name
from sessions.snapshots import read_chunk, write_chunk

from conftest import make_tiny_engine, random_tokens

SELECTING = dict(policy="infinigen", budget=0.3, alpha=4.0, min_fetch_tokens=0, dense_under_budget=False)
SLIDING, GLOBAL = [0, 1, 3, 4], [2, 5]
HELD = 80  # tokens in the chunk: each sliding layer's first HELD - WINDOW rows are older than its window


@pytest.fixture(scope="module")
def gemma():
    return tiny_gemma()


@pytest.fixture(scope="module")
def saved(gemma, tmp_path_factory):
    """A conversation of HELD tokens as a session holds it: an int8 chunk read back from its file (codes, per-row
    and per-channel scales: what a reopened session imports), and the float32 rows it was written from."""
    engine = make_tiny_engine(gemma, **SELECTING)
    engine.prefill(random_tokens(HELD, seed=3, vocab=VOCAB))
    rows = engine.export_rows(0, HELD)
    folder = tmp_path_factory.mktemp("chunks")
    record = write_chunk(folder, "s", rows, engine.kv_signature(), 0, "int8")
    return read_chunk(folder, record, engine.kv_signature()), rows


def _restored(gemma, chunk, defer: bool, kernels=None, **settings):
    engine = make_tiny_engine(gemma, kernels, **{**SELECTING, **settings})
    if not defer:
        engine.pool.sliding_windows = None  # no layer is known to slide: every row is written
    engine.import_rows([chunk])
    if defer:
        _poison_deferred(engine.pool)
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


@pytest.fixture
def lane_steps(monkeypatch):
    """How many steps opened the C++ lane (a list that grows by one per such step)."""
    opened: list[int] = []
    begin = DecodeLane.begin

    def counted(self, step):
        if begin(self, step):
            opened.append(step.first_position)
            return True
        return False

    monkeypatch.setattr(DecodeLane, "begin", counted)
    return opened


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
