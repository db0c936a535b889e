"""The Gradio page: chat in the middle, sessions on the left, settings, live panels and the inspector.

    demo = build_app(service)          # ChatPage(service).build()

`ChatPage` builds its components in small methods and binds every event in `_bind`; the handlers are
`PageActions` methods (ui/page_actions.py), thin calls of the service's parts whose `UserError`s are shown as
readable messages. `_then_refresh` refreshes the sidebar after an action.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import gradio as gr

from chat_service import ChatService
from infinigen_core.config import POLICY_NAMES
from sessions import format_size
from sessions.overflow import OVERFLOW_LABEL, OVERFLOW_POLICIES

from . import panels
from .chat_view import ChatView
from .live_reply import START_LIVE_REPLY
from .page_actions import ATTACHABLE, PageActions
from .page_text import status_text
from .page_tick import TICK_OUTPUTS, TICK_SECONDS, PageTick
from .remote_panel import remote_view
from .request_limits import UPLOAD_CACHE_CLEANUP
from .scroll_script import SCROLL_TO_FOUND
from .temp_folders import fresh_export_folder

CSS = """
.ig-hit { border-radius: 3px; }
.ig-found { outline: 3px solid #f5b400; outline-offset: 2px; border-radius: 6px; }  /* a search hit's message */
/* a streaming output's border stays lit but does not pulse: the pulse repaints the chat at every frame, which
   cost a browser without GPU compositing about a tenth of a core, taken from the model (bench/page.py) */
.generating { animation: none !important; }
#ig-status { min-height: 2.2em; }
.ig-heat-map { display: flex; gap: 6px; }
.ig-heat-map img { flex: 1; min-width: 0; height: 240px; image-rendering: pixelated; }
.ig-heat-y { display: flex; flex-direction: column; justify-content: space-between; font-size: 0.8em; }
.ig-heat-x, .ig-heat-legend { display: flex; justify-content: space-between; gap: 8px; font-size: 0.8em; }
.ig-heat-x { margin-left: 4.5em; }
.ig-heat-bar { flex: 1; height: 0.8em; align-self: center; }
.ig-heat-caption { font-size: 0.85em; margin: 4px 0 0; }
.ig-heat-title { font-size: 0.85em; margin-bottom: 6px; opacity: 0.8; }
footer { display: none !important; }
/* a reply the page reads as it grows (ui/live_reply.py) stands in for its message's placeholder */
#ig-chat .ig-live-shown > span.md { display: none; }
"""


def build_app(service: ChatService) -> gr.Blocks:
    return ChatPage(service).build()


def in_parameter_order(handler, inputs: Mapping[str, gr.components.Component]) -> list[gr.components.Component]:
    """`inputs` (by parameter name) as the list Gradio binds to `handler`'s parameters in order; a name that
    is not a parameter, or a parameter without an input, fails here, when the page is built."""
    names = list(inspect.signature(handler).parameters)
    if sorted(names) != sorted(inputs):
        raise TypeError(f"{handler.__name__} takes {names}; the page gives {sorted(inputs)}")
    return [inputs[name] for name in names]


class ChatPage:
    def __init__(self, service: ChatService) -> None:
        self.service = service
        self.export_dir = fresh_export_folder()
        self.actions = PageActions(service, self.export_dir)
        self.ticker = PageTick(service)

    def build(self) -> gr.Blocks:
        with gr.Blocks(title="InfiniGen Chat", analytics_enabled=False, delete_cache=UPLOAD_CACHE_CLEANUP) as demo:
            gr.Markdown("## InfiniGen Chat")
            self.status = gr.Markdown(status_text(self.service), elem_id="ig-status")
            with gr.Row():
                with gr.Column(scale=1, min_width=260):
                    self._model_box()
                    self._session_box()
                with gr.Column(scale=3):
                    self._chat_box()
                    self._settings_box()
                    self._storage_box()
            self._panels()
            self._hidden()
            self._bind(demo)
        return demo

    # ---------------------------------------------------------------- components
    def _model_box(self) -> None:
        host = self.service.host
        with gr.Accordion("Model", open=False):
            self.model_info = gr.Markdown(host.model_summary(), elem_id="ig-model-info")
            self.model_picker = gr.Dropdown(label="Default or from the local Hugging Face cache",
                                            choices=host.model_choices(), allow_custom_value=True,
                                            value=host.model_path or host.DEFAULT_CHOICE,
                                            elem_id="ig-model-picker")
            self.model_path = gr.Textbox(label="or a path or hub id", placeholder="~/models/Qwen3-8B, "
                                         "a .gguf file, or Qwen/Qwen3-8B", elem_id="ig-model-path",
                                         visible=not host.remote)  # the backend serves its own model
            self.model_button = gr.Button("Load model", elem_id="ig-model-load", visible=not host.remote)

    def _session_box(self) -> None:
        gr.Markdown("### Sessions")
        self.search_box = gr.Textbox(label="Search chats", placeholder="Search chats", elem_id="ig-search")
        self.search_hits = gr.Dropdown(label="Matching chats (newest first)", choices=[], visible=False,
                                       interactive=True, elem_id="ig-search-hits")
        self.search_snippets = gr.HTML(elem_id="ig-search-snippets")
        self.search_found = gr.State({})  # each matching chat's matching message (PageActions.open_found)
        self.scroll_target = gr.Textbox(visible=False)  # where the opened hit's message is (ui/scroll_script.py)
        self.session_picker = gr.Dropdown(label="Saved sessions", choices=[], interactive=True, elem_id="ig-sessions")
        self.session_info = gr.Markdown(elem_id="ig-session-info")
        self.new_button = gr.Button("New session", elem_id="ig-new")
        self.title_box = gr.Textbox(label="Title", placeholder="Rename this session")
        self.rename_button = gr.Button("Rename")
        self.delete_button = gr.Button("Delete session", variant="stop")
        with gr.Accordion("Export, import, branch", open=False):
            self.export_button = gr.Button("Export")
            self.export_file = gr.File(label="Exported file", interactive=False)
            self.import_file = gr.File(label="Import a session (.igchat)", file_types=[".igchat"], type="filepath")
            self.branch_number = gr.Number(label="Branch from message #", value=1, precision=0, minimum=1)
            self.branch_button = gr.Button("Branch")

    def _chat_box(self) -> None:
        self.chatbot = ChatView(label="Conversation", height=460, elem_id="ig-chat")
        # Enter sends, Shift+Enter starts a new line; files come through its attach button or drag-and-drop
        self.message = gr.MultimodalTextbox(label="Message", placeholder="Type a message (Shift+Enter for a new "
                                            "line); attach PDF, DOCX, HTML or text files to ask about them",
                                            file_types=list(ATTACHABLE), file_count="multiple", lines=1,
                                            max_lines=12, elem_id="ig-message", submit_btn=False)
        # each attachment's card and the share of the model's window the message would take, before sending
        self.attachment_info = gr.Markdown(elem_id="ig-attachments")
        # the context meter: the session's share of the window and the turns dropped to fit (refresh_sessions)
        self.context_meter = gr.Markdown(elem_id="ig-context")
        with gr.Row():
            self.send_button = gr.Button("Send", variant="primary", elem_id="ig-send")
            self.stop_button = gr.Button("Stop", elem_id="ig-stop")
            self.regenerate_button = gr.Button("Regenerate")
            self.edit_button = gr.Button("Replace last message with this text")
            self.drop_button = gr.Button("Drop oldest turns")
            # shown once the open session holds a file (refresh_sessions)
            self.file_chat_button = gr.Button("New chat about this file", elem_id="ig-file-chat", visible=False)
        with gr.Accordion("System prompt", open=False):
            self.system_box = gr.Textbox(label="System prompt", lines=2)
            self.system_button = gr.Button("Set system prompt")

    def _settings_box(self) -> None:
        shown = self.service.settings.current
        with gr.Accordion("Settings (apply from the next message)", open=False):
            with gr.Row(visible=not self.service.host.remote):  # InfiniGen's: not a remote engine's
                policy = gr.Dropdown(list(POLICY_NAMES), value=shown.policy, label="KV policy")
                alpha = gr.Number(value=shown.alpha, label="alpha")
                budget = gr.Textbox(value=shown.budget, label="budget (fraction or tokens)")
                min_fetch = gr.Number(value=shown.min_fetch_tokens, precision=0,
                                      label="fetch at least (tokens; 0 = no floor)")
                partial_ratio = gr.Slider(0.05, 1.0, value=shown.partial_ratio, step=0.05, label="partial ratio")
                pool_limit = gr.Textbox(value="", label="pool limit (tokens or e.g. 64MiB)")
                record = gr.Checkbox(value=False, label="Record true attention for the inspector (slower)")
            with gr.Row():
                temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature (0 = greedy)")
                top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="top-p")
                top_k = gr.Number(value=0, precision=0, label="top-k (0 = off)")
                repetition = gr.Slider(0.8, 2.0, value=1.0, step=0.05, label="repetition penalty")
                max_new = gr.Number(value=256, precision=0, label="max new tokens")
            with gr.Row(visible=not self.service.host.remote):  # a remote server counts its own window
                overflow = gr.Radio([(label, key) for key, label in OVERFLOW_POLICIES.items()], value=shown.overflow,
                                    label=OVERFLOW_LABEL, elem_id="ig-overflow")
            self.apply_button = gr.Button("Apply settings")
            self.settings_status = gr.Markdown()
        # the tick shows a newly loaded model's settings in them (TickUpdate's setting_* fields)
        self.setting_alpha, self.setting_budget, self.setting_min_fetch = alpha, budget, min_fetch
        self.setting_partial_ratio = partial_ratio
        # by the name of PageActions.apply_settings's parameter each one fills
        self.settings_inputs = {"policy": policy, "alpha": alpha, "budget": budget, "partial_ratio": partial_ratio,
                                "pool_limit": pool_limit, "inspect": record, "temperature": temperature,
                                "top_p": top_p, "top_k": top_k, "repetition_penalty": repetition,
                                "max_new_tokens": max_new, "min_fetch_tokens": min_fetch, "overflow": overflow}

    def _storage_box(self) -> None:
        storage = self.service.store.storage
        with gr.Accordion("KV cache on disk (all sessions)", open=False, visible=not self.service.host.remote):
            with gr.Row():
                self.kv_format = gr.Radio(["int8", "exact"], value=storage.kv_format,
                                          label="format of new chunks (int8: 4x smaller; exact: bit for bit)")
                self.kv_limit = gr.Textbox(value=format_size(storage.kv_disk_limit)
                                           if storage.kv_disk_limit is not None else "",
                                           label="disk limit (e.g. 20GiB; empty = a quarter of the free space)")
            self.storage_button = gr.Button("Apply")
            self.storage_status = gr.Markdown()

    def _panels(self) -> None:
        remote = self.service.host.remote  # a remote server's KV and its statistics are its own: its panel instead
        self.remote_panel = gr.Markdown(remote_view(self.service.host) if remote else "", visible=remote,
                                        elem_id="ig-remote")
        with gr.Tabs(visible=not remote):
            with gr.Tab("Live panels"):
                # drawn in the browser from small tables and one tiny PNG (ui/panels.py)
                with gr.Row():
                    self.memory_plot = gr.BarPlot(x="memory", y="MiB", label="Memory (MiB)", elem_id="ig-memory",
                                                  sort="-y")
                    self.fetch_plot = gr.LinePlot(x="layer", y="fetched / context", color="series",
                                                  y_lim=[0, 1.05], tooltip="all", label="Fetched-token ratio per layer",
                                                  elem_id="ig-fetch")
                with gr.Row():
                    self.sparsity_plot = gr.HTML(panels.sparsity_view(panels.PanelData())[0], elem_id="ig-sparsity")
                    self.timing_plot = gr.BarPlot(x="part", y="ms per decode step", color="part",
                                                  label="ms per decode step", elem_id="ig-timing")
            with gr.Tab("Prefetch inspector"):
                with gr.Row():
                    self.step_picker = gr.Dropdown(label="Generated token (recent decode steps)", choices=[])
                    self.layer_picker = gr.Slider(0, 1, value=2, step=1, label="Layer")
                    self.inspect_button = gr.Button("Show")
                self.inspector_html = gr.HTML("<p>Generate a reply, then pick a token and a layer.</p>")

    def _hidden(self) -> None:
        """Components that only scripts and tests use (named API endpoints), and the page's own state."""
        self.sessions_json = gr.JSON(visible=False)
        self.timer = gr.Timer(TICK_SECONDS)
        self.last_seen = gr.State(None)  # what the page was last sent (PageTick.tick)
        self.open_api = gr.Textbox(visible=False)
        # scripts send and edit plain text (the page's box takes files too): /send and /edit_last
        self.text_api = gr.Textbox(visible=False)
        self.send_api_button, self.edit_api_button = gr.Button(visible=False), gr.Button(visible=False)
        self.regenerate_api_button = gr.Button(visible=False)
        # the id of the reply the page reads from its own route, set by the event's `js` step (ui/live_reply.py)
        self.reply_id = gr.Textbox(visible=False)
        # the inspector for scripts and tests: step by index (0 = oldest recent decode step), layer by number
        self.step_index_api, self.layer_api = gr.Number(visible=False, precision=0), gr.Number(visible=False,
                                                                                              precision=0)
        self.inspect_api_button = gr.Button(visible=False)
        self.status_button = gr.Button(visible=False)
        self.list_button = gr.Button(visible=False)
        self.search_api, self.search_api_button = gr.Textbox(visible=False), gr.Button(visible=False)

    # ---------------------------------------------------------------- events
    def _then_refresh(self, event, **options):
        """After `event`, the sidebar shows the sessions as they are now, and the status line the app's state.
        Without progress animations: the refresh takes milliseconds, and Gradio's loader over each of its seven
        outputs springs on for seconds after it has gone (ui/head_script.py)."""
        return event.then(self.actions.refresh_sessions, None, [self.session_picker, self.title_box,
                                                                self.system_box, self.session_info, self.status,
                                                                self.file_chat_button, self.context_meter],
                          show_progress="hidden", **options)

    def _bind(self, demo: gr.Blocks) -> None:
        # scripts and tests (gradio_client, logged in with the key when the app has one) may call the events
        # that have an api_name; the page's other events (and the destructive ones: delete, rename, model
        # switch, system prompt, disk storage, dropping turns) are the page's own and not an API
        act = self.actions
        hidden: dict[str, Any] = {"api_name": False}
        private: dict[str, Any] = {"api_visibility": "private"}
        chat_and_box = [self.chatbot, self.message, self.attachment_info, self.status, self.session_picker]
        # every event that streams a reply: no progress animation over the chat, which would redraw the page at
        # every frame on the cores the model decodes on (the chat shows the turn, the status line the model)
        replying: dict[str, Any] = {"show_progress": "hidden"}
        quiet = {**hidden, **replying}
        # the page's own turns: the reply's text comes by the page's route, not in Gradio's updates
        live = {**quiet, "js": START_LIVE_REPLY}
        sent = [self.message, self.reply_id]
        self._then_refresh(self.send_button.click(act.send, sent, chat_and_box, **live), **hidden)
        self._then_refresh(self.message.submit(act.send, sent, chat_and_box, **live), **hidden)
        script_chat = [self.chatbot, self.text_api]
        self._then_refresh(self.send_api_button.click(act.send_text, self.text_api, script_chat, api_name="send",
                                                      **replying), **hidden)
        self._then_refresh(self.edit_api_button.click(act.edit_text, self.text_api, script_chat,
                                                      api_name="edit_last", **replying), **hidden)
        self.message.change(act.preview, self.message, self.attachment_info, **quiet, trigger_mode="always_last")
        self._then_refresh(self.file_chat_button.click(act.file_chat, None, [self.chatbot, self.message,
                                                                             self.attachment_info],
                                                       api_name="new_chat_about_file"), **hidden)
        self.stop_button.click(act.stop, None, self.status, api_name="stop", queue=False)
        self._then_refresh(self.regenerate_button.click(act.regenerate, self.reply_id, self.chatbot, **live),
                           **hidden)
        self._then_refresh(self.regenerate_api_button.click(act.regenerate, None, self.chatbot,
                                                            api_name="regenerate", **replying), **hidden)
        self._then_refresh(self.edit_button.click(act.edit, sent, [self.chatbot, self.message], **live), **hidden)
        self._then_refresh(self.drop_button.click(act.drop, self.message, self.chatbot, **private), **hidden)
        opened = [self.chatbot, self.status]
        self._then_refresh(self.session_picker.input(act.open, self.session_picker, opened, **hidden), **hidden)
        self.open_api.change(act.open, self.open_api, opened, api_name="open_session")
        self.search_box.change(act.search_page, self.search_box, [self.search_hits, self.search_snippets,
                                                                  self.search_found], **quiet,
                               trigger_mode="always_last")
        found = self.search_hits.input(act.open_found, [self.search_hits, self.search_found],
                                       [*opened, self.scroll_target], **hidden)
        # two steps after the hit, each on its own: the scroll does not wait for the sidebar's refresh
        self._then_refresh(found, **hidden)
        found.then(None, self.scroll_target, None, js=SCROLL_TO_FOUND, **hidden)
        self._then_refresh(self.new_button.click(act.new, None, self.chatbot, api_name="new_session"), **hidden)
        self._then_refresh(self.rename_button.click(act.rename, self.title_box, None, **private), **hidden)
        self._then_refresh(self.delete_button.click(act.delete, None, self.chatbot, **private), **hidden)
        self.export_button.click(act.export, None, self.export_file, api_name="export")
        self._then_refresh(self.import_file.upload(act.import_, self.import_file, self.chatbot, api_name="import"),
                           **hidden)
        self._then_refresh(self.branch_button.click(act.branch, self.branch_number, self.chatbot, api_name="branch"),
                           **hidden)
        self._then_refresh(self.model_button.click(act.switch_model, [self.model_picker, self.model_path],
                                                   [self.chatbot, self.model_info, self.model_picker],
                                                   **private), **hidden)
        self.system_button.click(act.system_prompt, self.system_box, self.settings_status, **private)
        self._then_refresh(self.storage_button.click(act.storage, [self.kv_format, self.kv_limit],
                                                     self.storage_status, **private), **hidden)
        self._then_refresh(self.apply_button.click(act.apply_settings,
                                                   in_parameter_order(act.apply_settings, self.settings_inputs),
                                                   self.settings_status, api_name="apply_settings"), **hidden)
        self.inspect_button.click(act.inspect, [self.step_picker, self.layer_picker], self.inspector_html, **hidden)
        self.inspect_api_button.click(act.inspect_index, [self.step_index_api, self.layer_api], self.inspector_html,
                                      api_name="inspect")
        # the tick's outputs are the components named by TickUpdate's fields, in their order
        self.timer.tick(self.ticker.tick, self.last_seen, [getattr(self, name) for name in TICK_OUTPUTS], **quiet,
                        queue=False)  # a plain request: none of the queue's status messages
        self.status_button.click(act.app_status, None, self.sessions_json, api_name="status")
        self.list_button.click(act.list_sessions, None, self.sessions_json, api_name="list_sessions")
        self.search_api_button.click(act.search, self.search_api, self.sessions_json, api_name="search")
        self._then_refresh(demo.load(act.history, None, self.chatbot, **quiet), **hidden)
