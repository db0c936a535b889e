"""The live panels: the small tables and the heat map the browser draws, built from a known stats history, and
the tick that sends only what changed."""

import base64
import html
import io
import re
from types import SimpleNamespace

import gradio as gr
import numpy as np
import pytest
from PIL import Image

from chat_service.settings import SettingsKeeper
from infinigen_core.stats import LayerStats, StepStats
from ui import page_tick, panels
from ui.page_tick import TICK_OUTPUTS, TICK_SECONDS, TICK_SECONDS_WHILE_GENERATING, PageTick, TickState, TickUpdate

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
        self.adapter = SimpleNamespace(num_layers=3, layer_kind=lambda i: "sliding 512" if i == 1 else "global",
                                       sliding_window=lambda i: 512 if i == 1 else None)
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
    sliding = frame[frame["series"] == panels.SLIDING_SERIES]  # its window, apart from the global layers' series
    assert latest["layer"].tolist() == [0, 2] and mean["layer"].tolist() == [0, 2] and sliding["layer"].tolist() == [1]
    assert latest["fetched / context"].tolist() == pytest.approx([1.0, 20 / 41], abs=1e-4)
    assert mean["fetched / context"].tolist() == pytest.approx([1.0, (10 / 40 + 20 / 41) / 2], abs=1e-4)
    assert sliding["fetched / context"].tolist() == [1.0] and sliding["kind"].tolist() == ["sliding 512"]
    assert latest["kind"].tolist() == ["global", "global"]
    assert caption.startswith("policy infinigen; global layers 2: a selection, 48.8% of the context fetched; global "
                              "layers 0: read the whole context; sliding-window layers 1: read their last 512 tokens, "
                              "100.0% of the context (a window, not a selection)")


def heat_map_pixels(view_html: str) -> np.ndarray:
    """The heat map's PNG, decoded: [layers, steps, 3]."""
    encoded = re.search(r'src="data:image/png;base64,([^"]+)"', view_html).group(1)
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(encoded))).convert("RGB"))


def test_the_heat_map_has_a_pixel_per_layer_and_decode_step_coloured_by_its_fetched_ratio(data):
    view, caption = panels.sparsity_view(data)
    pixels = heat_map_pixels(view)
    assert pixels.shape == (3, 2, 3)  # 3 layers (rows), 2 decode steps (columns): the prefill is not one
    dense, sparse = panels.HEAT_COLOURS[-1], panels.HEAT_COLOURS[0]
    assert pixels[0, 0].tolist() == pixels[0, 1].tolist() == dense.tolist()  # fetched everything
    assert pixels[2, 0].tolist() == panels.HEAT_COLOURS[1].tolist()  # 10 of 40 = 0.25: the second anchor
    assert pixels[2, 1].tolist() == panels.heat_colours(np.array(20 / 41)).tolist()
    assert pixels[2, 1].tolist() not in (dense.tolist(), sparse.tolist())
    assert "layer 0" in view and "layer 2" in view and "step 1" in view
    assert pixels[1, 0].tolist() == panels.SLIDING_GREYS[-1].tolist()  # the sliding layer: its window, in grey
    assert "sliding-window layers, in grey (their window over the context, not a selection): 1" in caption
    assert html.escape(caption) in view


def test_heat_colours_run_from_the_first_anchor_to_the_last_and_clip():
    values = np.array([-1.0, 0.0, 0.125, 1.0, 3.0])
    colours = panels.heat_colours(values)
    assert colours[0].tolist() == colours[1].tolist() == panels.HEAT_COLOURS[0].tolist()
    assert colours[3].tolist() == colours[4].tolist() == panels.HEAT_COLOURS[-1].tolist()
    halfway = (panels.HEAT_COLOURS[0] + panels.HEAT_COLOURS[1]) / 2  # 0.125 is half way to the 0.25 anchor
    assert colours[2].tolist() == np.rint(halfway).astype(int).tolist()



def test_the_inspector_shows_the_rows_each_head_read_not_every_slot_named():
    """Where the KV heads share a budget a selection names 2k slots per head and each head reads its own count
    (and the alpha rank cuts them): the inspector's fetched set is the slots read, in any head."""
    import torch

    from ui.inspector import read_positions

    stats = LayerStats(layer=2, context_len=100, fetched=3, sparse=True)
    stats.selected_positions = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    stats.selected_scores = torch.tensor([[0.9, 0.5, 0.1, 0.0], [0.8, 0.7, 0.6, 0.2]])
    stats.selected_read = torch.tensor([[True, False, False, False], [True, True, True, True]])
    assert read_positions(stats) == pytest.approx({10: 0.9, 20: 0.8, 21: 0.7, 22: 0.6, 23: 0.2})
    stats.selected_read = torch.tensor([[True, True, False, False]])  # one mask for every head (the alpha rank)
    assert set(read_positions(stats)) == {10, 11, 20, 21}
    stats.selected_read = None  # nothing masked
    assert len(read_positions(stats)) == 8

def test_timing_table_splits_the_mean_step(data):
    frame, caption = panels.timing_table(data)
    parts = dict(zip(frame["part"], frame["ms per decode step"]))
    # step 1: speculate 2, wait 1, attention 3, total 20; step 2: 4, 3, 7, 30
    assert parts == pytest.approx({"speculate": 3.0, "fetch wait": 2.0, "attention": 5.0,
                                   "rest of the model": 25.0 - 10.0})
    assert caption == "12.5 tokens/s; context 42 / 8,192 tokens"


def test_views_before_any_decode_step_say_so_and_hold_no_missing_number():
    engine = FakeEngine()
    engine.history = engine.history[:1]
    views = panels.panel_views(panels.collect(engine))
    fetch, timing = views["fetch"][0], views["timing"][0]
    # every layer and every part at 0: an empty table would make Vega label its axis and legend NaN, -Infinity
    assert sorted(fetch["layer"].tolist()) == [0, 0, 1, 2, 2] and set(fetch["fetched / context"]) == {0.0}
    assert timing["part"].tolist() == ["speculate", "fetch wait", "attention", "rest of the model"]
    assert set(timing["ms per decode step"]) == {0.0}
    assert not fetch.isna().any().any() and not timing.isna().any().any()
    assert "<img" not in views["sparsity"][0] and "no decode step yet" in views["sparsity"][0]
    assert views["fetch"][1] == views["sparsity"][1] == "no decode step yet"
    assert views["timing"][1].startswith("no decode step yet; context")


# ------------------------------------------------------------------------------------ the tick
class FakeService:
    """The parts of the service the tick reads, over a fake engine."""

    def __init__(self, engine):
        self.busy = False  # no turn is running
        self.host = SimpleNamespace(engine=engine, model_summary=lambda: "model", remote=False)  # a local engine
        self.open_sessions = SimpleNamespace(page=SimpleNamespace(id="s1"))
        self.api = SimpleNamespace(turns_run=0)
        self.turns = SimpleNamespace(progress=SimpleNamespace(tokens_per_second=lambda: 9.0), busy=lambda: self.busy)
        self.store = SimpleNamespace(list=lambda: [])
        self.pages = SimpleNamespace(chat_history=lambda: [])
        self.settings = SettingsKeeper()


@pytest.fixture
def ticking(monkeypatch):
    monkeypatch.setattr(page_tick, "status_text", lambda service: "**Ready.**")
    monkeypatch.setattr(page_tick.inspector, "step_labels", lambda engine: ["1: a", "2: b"])
    memory = {"KV pool": 3.0, "process RSS": 500.0, "system available": 9000.0}
    monkeypatch.setattr(panels, "memory_figures", lambda engine: dict(memory))
    engine = FakeEngine()
    return PageTick(FakeService(engine)), engine


def tick(actions, state) -> TickUpdate:
    """The tick's outputs by name, as ChatPage binds them."""
    outputs = actions.tick(state)
    assert len(outputs) == len(TICK_OUTPUTS)
    return TickUpdate(*outputs)


def sent(update: TickUpdate) -> list[str]:
    return [panel for panel in panels.PANELS if getattr(update, f"{panel}_plot") != gr.skip()]


SIDEBAR_AND_INSPECTOR = ("step_picker", "layer_picker", "chatbot", "session_picker", "session_info", "model_info")


def skipped(update: TickUpdate, names) -> bool:
    return all(getattr(update, name) == gr.skip() for name in names)


def test_tick_sends_one_changed_panel_at_a_time_then_nothing(ticking):
    actions, engine = ticking
    update = tick(actions, None)
    assert update.timer == gr.skip()  # the timer keeps its pace while no reply is generated
    assert update.status == "**Ready.**" and sent(update) == ["memory"]
    assert update.memory_plot["value"]["MiB"].tolist() == [3, 500]
    assert update.memory_plot["caption"].startswith("system available")
    state, order = update.last_seen, ["memory"]
    while state.panels_pending:  # the other panels follow, one per tick, with no new step
        update = tick(actions, state)
        state = update.last_seen
        order += sent(update)
        assert update.status == gr.skip()  # the status line did not change: not sent again
        assert skipped(update, SIDEBAR_AND_INSPECTOR)  # nor the sidebar or the inspector
    # each plot twice (Gradio's plots draw the update before the latest), the heat map, plain HTML, once
    assert order == ["memory", "memory", "fetch", "fetch", "sparsity", "timing", "timing"]
    update = tick(actions, state)  # nothing changed: everything skipped, nothing recomputed
    assert skipped(update, TICK_OUTPUTS[:-1])


def test_a_newly_loaded_models_settings_are_shown_once(ticking):
    """After a load the settings form shows what the model runs with (a family's own defaults, config.py)."""
    actions, engine = ticking
    actions.service.settings.current.partial_ratio, actions.service.settings.current.budget = 1.0, "0.1"
    update = tick(actions, None)
    assert (update.setting_partial_ratio, update.setting_budget, update.setting_alpha) == (1.0, "0.1", 12.0)
    update = tick(actions, update.last_seen)
    assert skipped(update, ("setting_alpha", "setting_budget", "setting_min_fetch", "setting_partial_ratio"))
    actions.service.host.engine = FakeEngine()  # another model loaded: shown again
    assert tick(actions, update.last_seen).setting_partial_ratio == 1.0


def test_tick_sends_only_the_panels_whose_tables_changed(ticking):
    actions, engine = ticking
    state = TickState()
    while True:
        state = tick(actions, state).last_seen
        if not state.panels_pending:
            break
    # a new step that changes only the time split and the memory: the ratios are the same as before
    engine.history.append(StepStats(3, 42, 1, [layer(0, 42, 42), layer(1, 42, 42), layer(2, 42, 21, compute=99.0)],
                                    total_ms=200.0))
    engine.history.pop(1)  # the recent window slides: the fetched ratios change too
    engine.steps_run += 1
    order = []
    while True:
        update = tick(actions, state)
        state = update.last_seen
        order += sent(update)
        if not state.panels_pending:
            break
    assert order == ["fetch", "fetch", "sparsity", "timing", "timing"]  # memory's table did not change: skipped


def test_while_a_reply_is_generated_the_tick_sends_the_status_and_the_heat_map_and_the_rest_after(ticking):
    actions, engine = ticking
    state = TickState()
    for _ in range(3):  # memory, memory again, fetch
        state = tick(actions, state).last_seen
    assert state.resend == "fetch"  # the fetch plot's second update is still to go when the turn starts
    actions.service.busy = True
    timers = []
    for step in range(2):  # the fetch table, the heat map and the time split all change at every step
        engine.history.append(StepStats(3 + step, 42, 1, [layer(0, 42, 42), layer(1, 42, 42), layer(2, 42, 4 + step)],
                                        total_ms=25.0 + step))
        engine.steps_run += 1
        update = tick(actions, state)
        assert sent(update) == ["sparsity"]  # the heat map alone: no Vega redraw while the model decodes
        assert skipped(update, SIDEBAR_AND_INSPECTOR)  # inspector steps, chat, sidebar: not now
        timers.append(update.timer)
        state = update.last_seen
        assert state.panels_pending  # the plots wait for the turn's end
    # the timer slows down once, at the first tick of the turn
    assert timers[0]["value"] == TICK_SECONDS_WHILE_GENERATING > TICK_SECONDS and timers[1] == gr.skip()
    actions.service.busy = False  # the turn ended: the inspector's step list and the plots follow
    update = tick(actions, state)
    assert update.timer["value"] == TICK_SECONDS  # and back to its pace
    assert update.step_picker != gr.skip() and update.step_picker["choices"] == ["1: a", "2: b"]
    after = sent(update)
    state = update.last_seen
    while state.panels_pending:
        update = tick(actions, state)
        after += sent(update)
        state = update.last_seen
    assert {"fetch", "timing"} <= set(after) and "sparsity" not in after
    assert after.count("fetch") == after.count("timing") == 2  # each plot twice


def test_a_plots_second_update_carries_the_same_table_and_caption(ticking):
    """Gradio 6.31's plots draw the data of the update before the latest (seen in a real Chromium): the tick
    sends a plot's view again at the next tick, unless it changed meanwhile (then the new view, twice)."""
    actions, engine = ticking
    first = tick(actions, None)
    assert sent(first) == ["memory"] and first.last_seen.resend == "memory" and first.last_seen.panels_pending
    second = tick(actions, first.last_seen)
    assert sent(second) == ["memory"] and second.last_seen.resend is None
    assert second.memory_plot["value"].equals(first.memory_plot["value"])
    assert second.memory_plot["caption"] == first.memory_plot["caption"]
    third = tick(actions, second.last_seen)
    assert sent(third) == ["fetch"] and third.last_seen.resend == "fetch"
    engine.history.append(StepStats(3, 42, 1, [layer(0, 42, 42), layer(1, 42, 42), layer(2, 42, 7)], total_ms=9.0))
    engine.steps_run += 1  # the fetch table changed before its second update: the new one goes, twice
    state, fetched = third.last_seen, []
    while state.panels_pending:
        update = tick(actions, state)
        state = update.last_seen
        fetched += [update.fetch_plot["value"]] if "fetch" in sent(update) else []
    assert len(fetched) == 2 and fetched[0].equals(fetched[1])
    assert not fetched[0].equals(third.fetch_plot["value"])


def test_a_replys_rate_stays_what_it_was_after_the_turn(monkeypatch):
    """The timing panel's tokens/s after a reply: measured from its first token to its last, not to the present
    (which made it decay after the turn, and the panel change at every tick)."""
    from chat_service import turns

    clock = iter([10.0, 10.0, 10.5, 11.0])  # the first token (its time read twice), the second, the third
    monkeypatch.setattr(turns.time, "perf_counter", lambda: next(clock))
    runner = SimpleNamespace(progress=turns.TurnProgress(phase="prefill"))
    events = [SimpleNamespace(finish_reason=None)] * 3 + [SimpleNamespace(finish_reason="eos")]
    list(turns.TurnRunner.track(runner, events))
    assert runner.progress.tokens == 3 and runner.progress.tokens_per_second() == pytest.approx(2 / 1.0)
    monkeypatch.setattr(turns.time, "perf_counter", lambda: 100.0)  # a minute later: the same figure
    assert runner.progress.tokens_per_second() == pytest.approx(2.0)
