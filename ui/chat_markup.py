"""Chat text as the chatbot shows it: it may not restyle the page, and remote images are shown as a note.

    shown_text('<div style="position:fixed;inset:0">Paste your key</div>')
    # '<div>Paste your key</div>'

Gradio's chatbot renders a message's Markdown with its HTML, and its sanitiser removes scripts and event
handlers but keeps CSS, so a message (the model's reply, or a pasted page) could cover the whole page with
a fake form that comes back on every reload. Every `style`, `class` and `id` attribute and every `<style>`
element is dropped from what is displayed, outside code (a fenced block or an inline code span shows its
text as written). The stored message keeps its text.
"""

from __future__ import annotations

import dataclasses
import re

from .remote_images import withhold_remote_images

# code is shown as text, so it is left as written
_CODE = re.compile(r"(```.*?(?:```|\Z)|~~~.*?(?:~~~|\Z)|`[^`\n]+`)", re.DOTALL)
# browsers take '/' between attributes as a space; quoted values may hold '>'
_ATTRIBUTE = r"""[\s/]+[^\s"'>/=]+(?:\s*=\s*(?:"[^"]*"|'[^']*'|[^\s"'>]*))?"""
_TAG = re.compile(r"<[a-zA-Z][^\s/>]*(?:" + _ATTRIBUTE + r")*[\s/]*>")
_STYLING_ATTRIBUTE = re.compile(r"""[\s/]+(?:style|class|id)(?:\s*=\s*(?:"[^"]*"|'[^']*'|[^\s"'>]*))?(?=[\s/>])""",
                                re.IGNORECASE)
_STYLE_ELEMENT = re.compile(r"<style\b.*?(?:</style\s*>|\Z)", re.IGNORECASE | re.DOTALL)


def without_page_styling(text: str) -> str:
    if "<" not in text:
        return text
    pieces = _CODE.split(text)
    for index in range(0, len(pieces), 2):  # even pieces are outside code
        prose = _STYLE_ELEMENT.sub("", pieces[index])
        pieces[index] = _TAG.sub(lambda tag: _STYLING_ATTRIBUTE.sub("", tag.group(0)), prose)
    return "".join(pieces)


def shown_text(text: str) -> str:
    return without_page_styling(withhold_remote_images(text))


def shown_history(history):
    """The chatbot's value (message dicts or gr.ChatMessage objects) as displayed; the stored one is untouched."""
    if not isinstance(history, list):
        return history
    shown = []
    for message in history:
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            message = {**message, "content": shown_text(message["content"])}
        elif isinstance(getattr(message, "content", None), str):
            try:
                message = dataclasses.replace(message, content=shown_text(message.content))
            except TypeError:  # not a dataclass: shown as it is (the page's CSP still keeps images from loading)
                pass
        shown.append(message)
    return shown
