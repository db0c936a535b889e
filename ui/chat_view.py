"""The chat display: gr.Chatbot that shows remote images as a note and lets no message restyle the page
(ui/chat_markup.py), and that post-processes each message once, not at every update of a streaming reply.

A Component subclass of its own module because Gradio writes a type stub (`.pyi`) beside the module that
defines one, at import (ignored by git: /ui/*.pyi).
"""

from __future__ import annotations

import gradio as gr
from gradio.components.chatbot import ChatbotDataMessages

from .chat_markup import shown_history


class ChatView(gr.Chatbot):
    """gr.Chatbot (`is_template`: the same frontend) that shows "[image from HOST withheld]" for a remote image
    in any message (the page's CSP blocks the fetch anyway, this says so) and drops the CSS a message carries.
    What is stored is untouched.

    While a reply streams, every update carries the whole conversation and only its last message changed:
    the messages of the previous value are kept as post-processed, so an update costs the new text, not a
    pass of the sanitiser and of Gradio's message models over every earlier message (bench/page.py)."""

    is_template = True

    # the last value's messages by (role, text): replaced whole by each call, so two pages streaming different
    # chats only miss (each call reads the dict it found, a swap is atomic). A class default, set per instance
    # on first use: Gradio builds a component's config from its __init__'s parameters, so no __init__ here
    _shown: dict[tuple[str, str], list] = {}

    @staticmethod
    def _plain_key(message) -> tuple[str, str] | None:
        """(role, text) for a message that is only a role and a text (all the app's own), else None."""
        if isinstance(message, dict) and len(message) == 2 and isinstance(message.get("content"), str) \
                and isinstance(message.get("role"), str):
            return message["role"], message["content"]
        return None

    def postprocess(self, value):
        if not isinstance(value, list):
            return super().postprocess(shown_history(value))
        self._check_format(value)
        earlier, kept = self._shown, {}
        messages: list = []
        for message in value:
            key = self._plain_key(message)
            processed = earlier.get(key) if key is not None else None
            if processed is None:
                processed = self._postprocess(shown_history([message])[0]) or []
            if key is not None:
                kept[key] = processed
            messages.extend(processed)
        self._shown = kept
        return ChatbotDataMessages(root=messages)
