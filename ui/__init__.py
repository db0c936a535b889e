"""The two faces of the app over chat_service/: the Gradio page and the OpenAI-compatible API (no logic of the
app here: what it does is the service's).

layout, page_actions, page_text: the Gradio page (its components, its event handlers, its words); panels,
inspector: its plots and HTML; chat_view, remote_images, guard, head_script: what the page shows and how it is
guarded; api/: the OpenAI API (protocol, serving, routes); cli: app.py's flags.
"""
