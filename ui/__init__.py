"""The Gradio chat app and the OpenAI-compatible API, gluing the engine and the sessions (no algorithm here).

controller: ChatController, the composition of the parts below, for the page, the API and tests;
model_host: the model (load, switch, device, memory); settings: engine, sampling and KV storage settings;
turns: one generation at a time (lock, API queue, Stop, progress); open_sessions: whose KV the engine holds;
page_sessions and page_turns: the page's session actions and turns; api/: the OpenAI API (protocol,
conversations, serving, routes); layout, page_actions, page_text: the Gradio page; panels, inspector: its
plots and HTML; cli: app.py's flags.
"""
