"""The chat display: gr.Chatbot that shows remote images as a note and lets no message restyle the page
(ui/chat_markup.py).

A Component subclass of its own module because Gradio writes a type stub (`.pyi`) beside the module that
defines one, at import (ignored by git: /ui/*.pyi).
"""

from __future__ import annotations

import gradio as gr

from .chat_markup import shown_history


class ChatView(gr.Chatbot):
    """gr.Chatbot (`is_template`: the same frontend) that shows "[image from HOST withheld]" for a remote image
    in any message (the page's CSP blocks the fetch anyway, this says so) and drops the CSS a message carries.
    What is stored is untouched."""

    is_template = True

    def postprocess(self, value):
        return super().postprocess(shown_history(value))
