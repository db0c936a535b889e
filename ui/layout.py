"""The Gradio Blocks: chat in the middle, sessions on the left, settings, live panels and the inspector.

Handlers stay thin: they call the controller and turn its `UserError`s into readable messages.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import gradio as gr

from infinigen_core.config import POLICY_NAMES
from sessions import format_size

from . import inspector, panels
from .controller import ChatController, UserError

CSS = """
.ig-hit { border-radius: 3px; }
#ig-status { min-height: 2.2em; }
footer { display: none !important; }
"""


def _session_choices(summaries) -> list[tuple[str, str]]:
    """Short labels that fit the sidebar: title, tokens, KV size on disk or "re-read" when its KV is not on
    disk (opening it re-reads the text), last used (the open session's details sit below)."""
    choices = []
    for s in summaries:
        title = s.title if len(s.title) <= 20 else s.title[:19] + "…"
        used = time.strftime("%d %b", time.localtime(s.last_used))
        source = "API · " if s.origin == "api" else ""  # a conversation an OpenAI-API client had
        disk = format_size(s.bytes_on_disk) if s.reopens_instantly else "re-read"
        choices.append((f"{source}{title} · {s.token_count:,} tok · {disk} · {used}", s.id))
    return choices


def _find(summaries, session_id: str | None):
    return next((s for s in summaries if s.id == session_id), None)


def _session_details(summary) -> str:
    if summary is None:
        return ""
    used = time.strftime("%d %b %Y %H:%M", time.localtime(summary.last_used))
    source = "from the API · " if summary.origin == "api" else ""
    if summary.reopens_instantly:
        reopening = "reopens instantly (its KV cache is on disk)"
    elif summary.kv_dropped:
        reopening = "its KV cache was dropped to stay within the disk limit: opening it re-reads the text"
    else:
        reopening = "opening it re-reads the text (its KV cache is not on disk)"
    return (f"{source}{summary.token_count:,} tokens · {summary.message_count} messages · "
            f"{format_size(summary.bytes_on_disk)} on disk · last used {used} · {reopening}")


def _status_text(controller: ChatController) -> str:
    if controller.engine is None:
        return f"**Starting:** {controller.status}"
    progress = controller.progress
    if progress.phase == "restore":
        return f"**Opening the session:** {progress.done:,} / {progress.total:,} tokens of KV cache..."
    if progress.phase == "prefill" and progress.total:
        return f"**Reading your message:** {progress.done:,} / {progress.total:,} tokens..."
    if progress.phase == "prefill":
        return "**Reading your message...**"
    if progress.phase == "generating":
        return f"**Generating:** {progress.tokens} tokens, {progress.tokens_per_second():.1f} tokens/s"
    return f"**{controller.status}.** {controller.restore_message}"


def build_app(controller: ChatController) -> gr.Blocks:
    export_dir = Path(tempfile.mkdtemp(prefix="infinigen-export-"))
    with gr.Blocks(title="InfiniGen Chat", analytics_enabled=False) as demo:
        demo.export_dir = export_dir
        gr.Markdown("## InfiniGen Chat")
        status = gr.Markdown(_status_text(controller), elem_id="ig-status")
        with gr.Row():
            with gr.Column(scale=1, min_width=260):
                with gr.Accordion("Model", open=False):
                    model_info = gr.Markdown(controller.model_summary(), elem_id="ig-model-info")
                    model_picker = gr.Dropdown(label="Default or from the local Hugging Face cache",
                                               choices=controller.model_choices(), allow_custom_value=True,
                                               value=controller.model_path or controller.DEFAULT_CHOICE,
                                               elem_id="ig-model-picker")
                    model_path = gr.Textbox(label="or a path or hub id", placeholder="~/models/Qwen3-8B, "
                                            "a .gguf file, or Qwen/Qwen3-8B", elem_id="ig-model-path")
                    model_button = gr.Button("Load model", elem_id="ig-model-load")
                gr.Markdown("### Sessions")
                session_picker = gr.Dropdown(label="Saved sessions", choices=[], interactive=True,
                                             elem_id="ig-sessions")
                session_info = gr.Markdown(elem_id="ig-session-info")
                new_button = gr.Button("New session", elem_id="ig-new")
                title_box = gr.Textbox(label="Title", placeholder="Rename this session")
                rename_button = gr.Button("Rename")
                delete_button = gr.Button("Delete session", variant="stop")
                with gr.Accordion("Export, import, branch", open=False):
                    export_button = gr.Button("Export")
                    export_file = gr.File(label="Exported file", interactive=False)
                    import_file = gr.File(label="Import a session (.igchat)", file_types=[".igchat"], type="filepath")
                    branch_number = gr.Number(label="Branch from message #", value=1, precision=0, minimum=1)
                    branch_button = gr.Button("Branch")
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(label="Conversation", height=460, elem_id="ig-chat")
                # Gradio submits on Enter only with lines=1; max_lines lets the box grow (Shift+Enter: new line)
                message = gr.Textbox(label="Message", placeholder="Type a message (Shift+Enter for a new line)",
                                     lines=1, max_lines=12, elem_id="ig-message")
                with gr.Row():
                    send_button = gr.Button("Send", variant="primary", elem_id="ig-send")
                    stop_button = gr.Button("Stop", elem_id="ig-stop")
                    regenerate_button = gr.Button("Regenerate")
                    edit_button = gr.Button("Replace last message with this text")
                    drop_button = gr.Button("Drop oldest turns")
                with gr.Accordion("System prompt", open=False):
                    system_box = gr.Textbox(label="System prompt", lines=2)
                    system_button = gr.Button("Set system prompt")
                with gr.Accordion("Settings (apply from the next message)", open=False):
                    with gr.Row():
                        shown = controller.settings
                        policy = gr.Dropdown(list(POLICY_NAMES), value=shown.policy, label="KV policy")
                        alpha = gr.Number(value=shown.alpha, label="alpha")
                        budget = gr.Textbox(value=shown.budget, label="budget (fraction or tokens)")
                        min_fetch = gr.Number(value=shown.min_fetch_tokens, precision=0,
                                              label="fetch at least (tokens; 0 = no floor)")
                        partial_ratio = gr.Slider(0.05, 1.0, value=shown.partial_ratio, step=0.05,
                                                  label="partial ratio")
                        pool_limit = gr.Textbox(value="", label="pool limit (tokens or e.g. 64MiB)")
                        record = gr.Checkbox(value=False, label="Record true attention for the inspector (slower)")
                    with gr.Row():
                        temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature (0 = greedy)")
                        top_p = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="top-p")
                        top_k = gr.Number(value=0, precision=0, label="top-k (0 = off)")
                        repetition = gr.Slider(0.8, 2.0, value=1.0, step=0.05, label="repetition penalty")
                        max_new = gr.Number(value=256, precision=0, label="max new tokens")
                    apply_button = gr.Button("Apply settings")
                    settings_status = gr.Markdown()
                with gr.Accordion("KV cache on disk (all sessions)", open=False):
                    storage = controller.store.storage
                    with gr.Row():
                        kv_format = gr.Radio(["int8", "exact"], value=storage.kv_format,
                                             label="format of new chunks (int8: 4x smaller; exact: bit for bit)")
                        kv_limit = gr.Textbox(value=format_size(storage.kv_disk_limit)
                                              if storage.kv_disk_limit is not None else "",
                                              label="disk limit (e.g. 20GiB; empty = a quarter of the free space)")
                    storage_button = gr.Button("Apply")
                    storage_status = gr.Markdown()
        with gr.Tabs():
            with gr.Tab("Live panels"):
                with gr.Row():
                    memory_plot = gr.Plot(label="Memory", elem_id="ig-memory")
                    fetch_plot = gr.Plot(label="Fetched ratio", elem_id="ig-fetch")
                with gr.Row():
                    sparsity_plot = gr.Plot(label="Sparsity", elem_id="ig-sparsity")
                    timing_plot = gr.Plot(label="Time", elem_id="ig-timing")
            with gr.Tab("Prefetch inspector"):
                with gr.Row():
                    step_picker = gr.Dropdown(label="Generated token (recent decode steps)", choices=[])
                    layer_picker = gr.Slider(0, 1, value=2, step=1, label="Layer")
                    inspect_button = gr.Button("Show")
                inspector_html = gr.HTML("<p>Generate a reply, then pick a token and a layer.</p>")
        sessions_json = gr.JSON(visible=False)
        timer = gr.Timer(1.0)

        # ---------------------------------------------------------------- handlers
        def fail(error: Exception):
            raise gr.Error(str(error), duration=12)

        def refresh_sessions():
            current = controller.chat.id if controller.chat is not None else None
            summaries = controller.store.list()
            summary = _find(summaries, current)
            return gr.update(choices=_session_choices(summaries), value=current), \
                (summary.title if summary else ""), (summary.system_prompt if summary else ""), \
                _session_details(summary)

        def on_send(text):
            try:
                for history in controller.send(text):
                    yield history, ""
            except UserError as error:
                fail(error)

        def on_regenerate():
            try:
                yield from controller.regenerate()
            except UserError as error:
                fail(error)

        def on_edit(text):
            try:
                for history in controller.edit_last(text):
                    yield history, ""
            except UserError as error:
                fail(error)

        def on_stop():
            controller.stop()
            return "Stopping after the current token; what was generated is kept."

        def on_drop(text):
            try:
                gr.Info(controller.drop_oldest_turns(text))
            except UserError as error:
                fail(error)
            return controller.chat_history()

        def on_open(session_id):
            if not session_id:
                return controller.chat_history(), _status_text(controller)
            try:
                controller.open_session(session_id)
            except UserError as error:
                fail(error)
            return controller.chat_history(), _status_text(controller)

        def on_new():
            try:
                controller.new_session()
            except UserError as error:
                fail(error)
            return controller.chat_history()

        def on_rename(title):
            try:
                controller.rename_session(title)
            except UserError as error:
                fail(error)

        def on_delete():
            try:
                controller.delete_session()
            except UserError as error:
                fail(error)
            return controller.chat_history()

        def on_export():
            try:
                return str(controller.export_session(export_dir))
            except UserError as error:
                fail(error)

        def on_import(path):
            if not path:
                return controller.chat_history()
            try:
                controller.import_session(path)
            except UserError as error:
                fail(error)
            return controller.chat_history()

        def on_branch(number):
            try:
                controller.branch_from(int(number or 1) - 1)
            except UserError as error:
                fail(error)
            return controller.chat_history()

        def on_system(text):
            try:
                controller.set_system_prompt(text or "")
            except UserError as error:
                fail(error)
            return "System prompt saved; it applies from the next message."

        def on_switch_model(choice, path):
            try:
                message = controller.switch_model((path or "").strip() or choice)
            except UserError as error:
                fail(error)
            gr.Info(message)
            return controller.chat_history(), controller.model_summary(), gr.update(
                choices=controller.model_choices(), value=controller.model_path or controller.DEFAULT_CHOICE)

        def on_apply(*values):
            try:
                return controller.apply_settings(*values)
            except UserError as error:
                fail(error)

        def on_storage(kv_format_value, limit):
            try:
                return controller.apply_storage(kv_format_value, limit)
            except UserError as error:
                fail(error)

        def on_tick(last_seen):
            """Refresh the status always, the plots only when the engine ran a new step."""
            text = _status_text(controller)
            engine = controller.engine
            seen = (engine.steps_run, controller.chat.id if controller.chat else None, id(engine),
                    controller.api_turns) if engine else None
            if engine is None or seen == last_seen:
                return (text, *[gr.skip()] * 10, last_seen)
            # the page may have opened before the model and the last session were loaded: show them now
            session_changed = last_seen is None or last_seen[1:3] != seen[1:3]  # another session or model
            history = controller.chat_history() if session_changed else gr.skip()
            picker = details = model = gr.skip()
            if session_changed:
                model = controller.model_summary()
            if session_changed or last_seen[3] != seen[3]:  # an API turn may have added or grown a session
                summaries = controller.store.list()
                picker = gr.update(choices=_session_choices(summaries), value=seen[1])
                details = _session_details(_find(summaries, seen[1]))
            data = panels.collect(engine, controller.progress.tokens_per_second())
            figures = (panels.memory_plot(data), panels.fetch_ratio_plot(data), panels.sparsity_heatmap(data),
                       panels.timing_plot(data))
            panels.close_all(*figures)
            labels = inspector.step_labels(engine)
            steps = gr.update(choices=labels, value=labels[-1] if labels else None)
            layers = gr.update(maximum=engine.adapter.num_layers - 1)
            return (text, *figures, steps, layers, history, picker, details, model, seen)

        def on_inspect(step_label, layer):
            if controller.engine is None or not step_label:
                return "<p>Generate a reply first.</p>"
            return inspector.render(controller.engine, int(str(step_label).split(":")[0]), int(layer))

        def on_inspect_index(step_index, layer):
            if controller.engine is None:
                return "<p>Still starting.</p>"
            return inspector.render(controller.engine, int(step_index or 0), int(layer or 0))

        def list_sessions():
            return [{**s.__dict__, "reopens_instantly": s.reopens_instantly} for s in controller.store.list()]

        def app_status():
            return {"ready": controller.engine is not None and controller.ready.is_set(),
                    "status": controller.status, "error": controller.load_error,
                    "restore": controller.restore_message, "session": controller.chat.id if controller.chat else None}

        last_seen = gr.State(None)
        session_outputs = [session_picker, title_box, system_box, session_info]
        send_event = send_button.click(on_send, message, [chatbot, message], api_name="send")
        message.submit(on_send, message, [chatbot, message], api_name=False).then(refresh_sessions, None,
                                                                                 session_outputs)
        send_event.then(refresh_sessions, None, session_outputs, api_name=False)
        stop_button.click(on_stop, None, status, api_name="stop", queue=False)
        regenerate_button.click(on_regenerate, None, chatbot, api_name="regenerate").then(
            refresh_sessions, None, session_outputs, api_name=False)
        edit_button.click(on_edit, message, [chatbot, message], api_name="edit_last").then(
            refresh_sessions, None, session_outputs, api_name=False)
        drop_button.click(on_drop, message, chatbot, api_name="drop_oldest_turns")
        session_picker.input(on_open, session_picker, [chatbot, status], api_name=False).then(
            refresh_sessions, None, session_outputs, api_name=False)
        open_api = gr.Textbox(visible=False)
        open_api.change(on_open, open_api, [chatbot, status], api_name="open_session")
        new_button.click(on_new, None, chatbot, api_name="new_session").then(refresh_sessions, None,
                                                                             session_outputs, api_name=False)
        rename_button.click(on_rename, title_box, None, api_name="rename").then(refresh_sessions, None,
                                                                                session_outputs, api_name=False)
        delete_button.click(on_delete, None, chatbot, api_name="delete").then(refresh_sessions, None,
                                                                              session_outputs, api_name=False)
        export_button.click(on_export, None, export_file, api_name="export")
        import_file.upload(on_import, import_file, chatbot, api_name="import").then(
            refresh_sessions, None, session_outputs, api_name=False)
        branch_button.click(on_branch, branch_number, chatbot, api_name="branch").then(
            refresh_sessions, None, session_outputs, api_name=False)
        model_button.click(on_switch_model, [model_picker, model_path], [chatbot, model_info, model_picker],
                           api_name="switch_model").then(refresh_sessions, None, session_outputs, api_name=False)
        system_button.click(on_system, system_box, settings_status, api_name="system_prompt")
        storage_button.click(on_storage, [kv_format, kv_limit], storage_status, api_name="kv_storage").then(
            refresh_sessions, None, session_outputs, api_name=False)
        apply_button.click(on_apply, [policy, alpha, budget, partial_ratio, pool_limit, record, temperature, top_p,
                                      top_k, repetition, max_new, min_fetch], settings_status,
                           api_name="apply_settings")
        inspect_button.click(on_inspect, [step_picker, layer_picker], inspector_html, api_name=False)
        # the same view for scripts and tests: step by index (0 = oldest recent decode step), layer by number
        step_index_api, layer_api = gr.Number(visible=False, precision=0), gr.Number(visible=False, precision=0)
        inspect_api_button = gr.Button(visible=False)
        inspect_api_button.click(on_inspect_index, [step_index_api, layer_api], inspector_html, api_name="inspect")
        timer.tick(on_tick, last_seen, [status, memory_plot, fetch_plot, sparsity_plot, timing_plot, step_picker,
                                        layer_picker, chatbot, session_picker, session_info, model_info, last_seen],
                   api_name=False, show_progress="hidden")
        status_button = gr.Button(visible=False)
        status_button.click(app_status, None, sessions_json, api_name="status")
        list_button = gr.Button(visible=False)
        list_button.click(list_sessions, None, sessions_json, api_name="list_sessions")
        demo.load(lambda: controller.chat_history(), None, chatbot, api_name=False).then(
            refresh_sessions, None, session_outputs, api_name=False)
    return demo
