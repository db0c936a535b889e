"""The page's timer tick: the status line, the live panels, the inspector's pickers and the sidebar, each sent
only when it changed since this page's last tick.

    ticker = PageTick(service)
    timer.tick(ticker.tick, last_seen, [page.<name> for name in TICK_OUTPUTS])
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import gradio as gr

from chat_service import ChatService

from . import inspector, panels
from .page_text import find, session_choices, session_details, status_text
from .remote_panel import remote_view

TICK_SECONDS = 2.0  # the live panels' pace between replies
# ... and while a reply is generated: each tick costs the browser ~30 ms of the cores the model decodes on (Gradio's
# frontend copies the value of every component that ever had a status, at every event). `python -m bench page`:
# the page decoded at a median 0.85-0.91x the API's rate with a tick every 2 s, 0.95x with none
TICK_SECONDS_WHILE_GENERATING = 10.0
# Gradio 6.31's native plots (gr.BarPlot, gr.LinePlot) draw, at each update, the data of the update before it
# (their caption is the new one): in a real Chromium the fetched-ratio panel still showed the empty table after a
# Gemma 3 turn, its caption already the turn's. So a plot's update goes out twice, the second at the next tick,
# which draws the first's data. The heat map, plain HTML, is drawn as sent
PLOTS_DRAW_ONE_BEHIND = True


@dataclass(frozen=True)
class Seen:
    """What a page's sidebar, chat and panels were last drawn from."""

    steps_run: int  # the engine's decode steps
    session_id: str | None  # the page's session
    engine_id: int  # the model loaded (a switch makes a new engine)
    api_turns: int  # API turns run (each may add or grow a session in the sidebar)


@dataclass(frozen=True)
class TickState:
    """What one page was last sent by the tick: what it was drawn from, the status text, each panel's view
    digest, the panel to try first next, and whether panels still wait."""

    seen: Seen | None = None
    status: str = ""
    interval: float = TICK_SECONDS  # the timer's, as this page was last told
    sent: dict[str, str] = field(default_factory=dict)
    next_panel: int = 0
    panels_pending: bool = False
    resend: str | None = None  # a plot sent at the last tick, to send once more (see PLOTS_DRAW_ONE_BEHIND)


@dataclass
class TickUpdate:
    """One tick's outputs, each named after the page's component it goes to (ChatPage binds them by these names,
    in this order); an output left as gr.skip() sends nothing."""

    status: object = field(default_factory=gr.skip)
    memory_plot: object = field(default_factory=gr.skip)
    fetch_plot: object = field(default_factory=gr.skip)
    sparsity_plot: object = field(default_factory=gr.skip)
    timing_plot: object = field(default_factory=gr.skip)
    step_picker: object = field(default_factory=gr.skip)
    layer_picker: object = field(default_factory=gr.skip)
    chatbot: object = field(default_factory=gr.skip)
    session_picker: object = field(default_factory=gr.skip)
    session_info: object = field(default_factory=gr.skip)
    model_info: object = field(default_factory=gr.skip)
    # the tunable settings' inputs: after a load they show what the model runs with (its family's defaults)
    setting_alpha: object = field(default_factory=gr.skip)
    setting_budget: object = field(default_factory=gr.skip)
    setting_min_fetch: object = field(default_factory=gr.skip)
    setting_partial_ratio: object = field(default_factory=gr.skip)
    remote_panel: object = field(default_factory=gr.skip)
    timer: object = field(default_factory=gr.skip)
    last_seen: TickState = field(default_factory=TickState)


TICK_OUTPUTS = tuple(f.name for f in fields(TickUpdate))


def astuple_shallow(update: TickUpdate) -> tuple:
    """The update's values in field order (dataclasses.astuple would copy the state and the updates deeply)."""
    return tuple(getattr(update, name) for name in TICK_OUTPUTS)


class PageTick:
    def __init__(self, service: ChatService) -> None:
        self.service = service

    def tick(self, last: TickState | None) -> tuple:
        """Refresh what changed since this page's last tick (`last`, kept per page in a gr.State): the status
        line when its text changed, the sidebar when another session or model is open or the API ran a turn,
        and at most one live panel, the next one in turn whose view changed; each output left alone is a
        gr.skip(), which sends nothing. While a reply is being generated only the status line and the heat
        map go out, and the timer ticks less often (every update costs the browser, which shares the model's
        cores); the rest follows the turn. Returns TickUpdate's values, in the order of its fields."""
        update = self.refreshed(last or TickState())
        interval = TICK_SECONDS_WHILE_GENERATING if self.service.turns.busy() else TICK_SECONDS
        if interval != update.last_seen.interval:
            update.timer = gr.update(value=interval)
        update.last_seen = replace(update.last_seen, interval=interval)
        return astuple_shallow(update)

    def _seen(self) -> Seen | None:
        engine, chat = self.service.host.engine, self.service.open_sessions.page
        if engine is None:
            return None
        return Seen(engine.steps_run, chat.id if chat is not None else None, id(engine), self.service.api.turns_run)

    def refreshed(self, last: TickState) -> TickUpdate:
        """The tick's outputs but the timer's pace."""
        service = self.service
        text = status_text(service)
        update = TickUpdate(last_seen=replace(last, status=text))
        if text != last.status:
            update.status = text
        if service.host.remote:
            return self._remote(update, last)
        engine, seen = service.host.engine, self._seen()
        if engine is None or seen is None or (seen == last.seen and not last.panels_pending):
            return update
        if service.turns.busy():  # `seen` stays as it was: the first tick after the turn refreshes the rest
            self._next_panel(engine, update, panels.LIVE_WHILE_GENERATING)
            return update
        update.last_seen = replace(update.last_seen, seen=seen)
        self._next_panel(engine, update)
        if seen == last.seen:  # only a panel left over from the last steps
            return update
        # the page may have opened before the model and the last session were loaded: show them now
        session_changed = last.seen is None or (last.seen.session_id, last.seen.engine_id) != (seen.session_id,
                                                                                            seen.engine_id)
        if session_changed:
            update.chatbot = service.pages.chat_history()
            update.model_info = service.host.model_summary()
        if last.seen is None or last.seen.engine_id != seen.engine_id:  # another model: its settings
            shown = service.settings.current
            update.setting_alpha, update.setting_budget = shown.alpha, shown.budget
            update.setting_min_fetch, update.setting_partial_ratio = shown.min_fetch_tokens, shown.partial_ratio
        if session_changed or last.seen is None or last.seen.api_turns != seen.api_turns:  # an API turn may have added or grown one
            summaries = service.store.list()
            update.session_picker = gr.update(choices=session_choices(summaries), value=seen.session_id)
            update.session_info = session_details(find(summaries, seen.session_id))
        labels = inspector.step_labels(engine)
        update.step_picker = gr.update(choices=labels, value=labels[-1] if labels else None)
        update.layer_picker = gr.update(maximum=engine.adapter.num_layers - 1)
        return update

    def _remote(self, update: TickUpdate, last: TickState) -> TickUpdate:
        """A remote server generates: its panel when its figures changed, and the chat and sidebar when another
        session is open or the API ran a turn (there is no engine to draw the other panels from)."""
        service = self.service
        view = remote_view(service.host)
        digest = panels.digest((view, ""))
        if digest != last.sent.get("remote"):
            update.remote_panel = view
            update.last_seen = replace(update.last_seen, sent={**last.sent, "remote": digest})
        chat = service.open_sessions.page
        seen = Seen(0, chat.id if chat is not None else None, 0, service.api.turns_run)
        if service.turns.busy() or seen == last.seen:
            return update
        update.last_seen = replace(update.last_seen, seen=seen)
        if last.seen is None or last.seen.session_id != seen.session_id:
            update.chatbot = service.pages.chat_history()
            update.model_info = service.host.model_summary()
        summaries = service.store.list()
        update.session_picker = gr.update(choices=session_choices(summaries, remote=True), value=seen.session_id)
        update.session_info = session_details(find(summaries, seen.session_id), remote=True)
        return update

    def _next_panel(self, engine, update: TickUpdate, candidates: tuple[str, ...] = panels.PANELS) -> None:
        """Into `update`: the next panel in turn among `candidates` whose view differs from what this page was
        sent, the others skipped (at most one Vega redraw per tick, in the browser that shares the model's
        cores)."""
        last = update.last_seen
        views = panels.panel_views(panels.collect(engine, self.service.turns.progress.tokens_per_second()))
        digests = {name: panels.digest(view) for name, view in views.items()}
        count = len(panels.PANELS)
        order = [panels.PANELS[(last.next_panel + i) % count] for i in range(count)]
        changed = [name for name in order if digests[name] != last.sent.get(name)]
        again = last.resend if last.resend in candidates and last.resend not in changed else None
        sendable = [again] if again else [name for name in changed if name in candidates]
        if not sendable:
            update.last_seen = replace(last, panels_pending=bool(changed) or last.resend is not None)
            return
        name = sendable[0]
        value, caption = views[name]
        # a plot takes its table and caption; an HTML panel (the heat map) carries its caption inside
        setattr(update, f"{name}_plot", gr.update(value=value) if isinstance(value, str)
                else gr.update(value=value, caption=caption))
        if again or not PLOTS_DRAW_ONE_BEHIND:
            resend = None
        else:  # a plot: once more at the next tick; the heat map leaves a plot's pending second update waiting
            resend = last.resend if isinstance(value, str) else name
        update.last_seen = replace(last, sent={**last.sent, name: digests[name]}, resend=resend,
                                   next_panel=(panels.PANELS.index(name) + 1) % count if not again else last.next_panel,
                                   panels_pending=any(n != name for n in changed) or resend is not None)
