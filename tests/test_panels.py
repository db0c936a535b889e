"""The live panels: the small tables the browser draws, built from a known stats history, and the tick that
sends only what changed."""

from types import SimpleNamespace

import gradio as gr
import pytest

from infinigen_core.stats import LayerStats, StepStats
from ui import page_actions, panels
from ui.page_actions import PANEL_OUTPUTS, PageActions, TickState

MiB = 2**20


def layer(index, context, fetched, speculate=0.0, wait=0.0, compute=0.0):
    return LayerStats(index, context, fetched, sparse=index > 0, speculate_ms=speculate, fetch_wait_ms=wait,
                      compute_ms=compute)


class FakeEngine:
    """Three layers (layer 1 slides), two decode steps after a prefill: the numbers below are worked by hand."""

    def __init__(self):
        self.history = [
            StepStats(0, 0, 40, [layer(0, 0, 0), layer(1, 0, 0), layer(2, 0, 0)], total_ms=500.0),  # prefill
            StepStats(1, 40, 1, [layer(0, 40, 40, compute=1.0), layer(1, 40, 40, compute=1.0),
                                 layer(2, 40, 10, speculate=2.0, wait=1.0, compute=1.0)], total_ms=20.0),
            StepStats(2, 41, 1, [layer(0, 41, 41, compute=3.0), layer(1, 41, 41, compute=3.0),
                                 layer(2, 41, 41 // 2, speculate=4.0, wait=3.0, compute=1.0)], total_ms=30.0),
        ]
        self.steps_run = 3
        self.num_tokens, self.max_context = 42, 8192
        self.config = SimpleNamespace(policy="infinigen")
        self.adapter = SimpleNamespace(num_layers=3, layer_kind=lambda i: "sliding 512" if i == 1 else "global")
        self.pool = SimpleNamespace(bytes_allocated=lambda: 3 * MiB, pin_memory=False)

    def recent_decode_steps(self):
        return [step for step in self.history if step.is_decode and step.layers]


@pytest.fixture
def data():
    return panels.collect(FakeEngine(), tokens_per_second=12.5)


def test_memory_table_has_one_bar_per_figure_in_whole_mib(data):
    frame, caption = panels.memory_table(data)
    rows = dict(zip(frame["memory"], frame["MiB"]))
    assert rows["KV pool"] == 3 and rows["pinned host"] == 0 and rows["process RSS"] > 0
    assert "system available" not in rows and caption.startswith("system available: ")


def test_fetch_table_has_the_latest_and_the_mean_ratio_of_each_layer(data):
    frame, caption = panels.fetch_table(data)
    latest = frame[frame["series"] == "latest step"]
    mean = frame[frame["series"] == "running mean"]
    assert latest["layer"].tolist() == [0, 1, 2] and mean["layer"].tolist() == [0, 1, 2]
    assert latest["fetched / context"].tolist() == pytest.approx([1.0, 1.0, 20 / 41], abs=1e-4)
    assert mean["fetched / context"].tolist() == pytest.approx([1.0, 1.0, (10 / 40 + 20 / 41) / 2], abs=1e-4)
    assert latest["kind"].tolist() == ["global", "sliding 512", "global"]
    assert "infinigen" in caption and "sliding-window layers (whole window read): 1" in caption


def test_sparsity_table_has_every_layer_at_every_decode_step(data):
    frame, caption = panels.sparsity_table(data)
    assert len(frame) == 3 * 2  # the prefill step is not a decode step
    cell = {(row.step, row.layer): row._3 for row in frame.itertuples()}
    assert cell[(0, 2)] == pytest.approx(0.25) and cell[(1, 2)] == pytest.approx(round(20 / 41, 3))
    assert cell[(0, 0)] == cell[(1, 1)] == 1.0
    assert "sliding-window layers: 1" in caption


def test_timing_table_splits_the_mean_step(data):
    frame, caption = panels.timing_table(data)
    parts = dict(zip(frame["part"], frame["ms per decode step"]))
    # step 1: speculate 2, wait 1, attention 3, total 20; step 2: 4, 3, 7, 30
    assert parts == pytest.approx({"speculate": 3.0, "fetch wait": 2.0, "attention": 5.0,
                                   "rest of the model": 25.0 - 10.0})
    assert caption == "12.5 tokens/s; context 42 / 8,192 tokens"


def test_tables_before_any_decode_step_are_empty_and_say_so():
    engine = FakeEngine()
    engine.history = engine.history[:1]
    tables = panels.panel_tables(panels.collect(engine))
    assert all(frame.empty for name, (frame, _) in tables.items() if name != "memory")
    assert tables["fetch"][1] == tables["sparsity"][1] == "no decode step yet"


# ------------------------------------------------------------------------------------ the tick
class FakeController:
    def __init__(self, engine):
        self.engine, self.chat, self.api_turns = engine, SimpleNamespace(id="s1"), 0
        self.progress = SimpleNamespace(tokens_per_second=lambda: 9.0)
        self.store = SimpleNamespace(list=lambda: [])

    def chat_history(self):
        return []

    def model_summary(self):
        return "model"


@pytest.fixture
def ticking(monkeypatch):
    monkeypatch.setattr(page_actions, "status_text", lambda controller: "**Ready.**")
    monkeypatch.setattr(page_actions.inspector, "step_labels", lambda engine: ["1: a", "2: b"])
    memory = {"KV pool": 3.0, "process RSS": 500.0, "system available": 9000.0}
    monkeypatch.setattr(panels, "memory_figures", lambda engine: dict(memory))
    engine = FakeEngine()
    return PageActions(FakeController(engine), export_dir=None), engine


def plots(outputs):
    return list(outputs[1:5])


def sent(outputs):
    return [panel for panel, output in zip(panels.PANELS, plots(outputs)) if output != gr.skip()]


def test_tick_sends_one_changed_panel_at_a_time_then_nothing(ticking):
    actions, engine = ticking
    outputs = actions.tick(None)
    assert len(outputs) == 2 + PANEL_OUTPUTS
    assert outputs[0] == "**Ready.**" and sent(outputs) == ["memory"]
    update = plots(outputs)[0]
    assert update["value"]["MiB"].tolist() == [3, 500] and update["caption"].startswith("system available")
    state, order = outputs[-1], ["memory"]
    while state.panels_pending:  # the other panels follow, one per tick, with no new step
        outputs = actions.tick(state)
        state = outputs[-1]
        order += sent(outputs)
        assert outputs[0] == gr.skip()  # the status line did not change: not sent again
        assert all(output == gr.skip() for output in outputs[5:-1])  # nor the sidebar or the inspector
    assert order == list(panels.PANELS)
    outputs = actions.tick(state)  # nothing changed: everything skipped, nothing recomputed
    assert all(output == gr.skip() for output in outputs[:-1])


def test_tick_sends_only_the_panels_whose_tables_changed(ticking):
    actions, engine = ticking
    state = TickState()
    for _ in panels.PANELS:
        state = actions.tick(state)[-1]
    assert not state.panels_pending
    # a new step that changes only the time split and the memory: the ratios are the same as before
    engine.history.append(StepStats(3, 42, 1, [layer(0, 42, 42), layer(1, 42, 42), layer(2, 42, 21, compute=99.0)],
                                    total_ms=200.0))
    engine.history.pop(1)  # the recent window slides: the fetched ratios change too
    engine.steps_run += 1
    order = []
    while True:
        outputs = actions.tick(state)
        state = outputs[-1]
        order += sent(outputs)
        if not state.panels_pending:
            break
    assert order == ["fetch", "sparsity", "timing"]  # memory's table did not change: skipped
