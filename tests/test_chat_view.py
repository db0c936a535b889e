"""The chat display post-processes each message once while a reply streams, and shows what a fresh
post-processing of the whole conversation would (no stale text, the page's styling still dropped)."""

from __future__ import annotations

import gradio as gr

from ui.chat_markup import shown_history
from ui.chat_view import ChatView

EARLIER = [{"role": "user", "content": 'Hi <b style="position:fixed">there</b>'},
           {"role": "assistant", "content": "![x](http://evil.example/a.png) hello"},
           {"role": "user", "content": "Write a story"}]


def _view() -> ChatView:
    with gr.Blocks():
        return ChatView()


def test_the_display_keeps_the_chatbots_settings_for_the_page():
    """The page finds the chat by its elem_id: a subclass must not hide gr.Chatbot's constructor arguments
    from the config Gradio sends the browser."""
    with gr.Blocks():
        view = ChatView(elem_id="ig-chat", height=460)
    config = view.get_config()
    assert config["elem_id"] == "ig-chat" and config["height"] == 460


def _fresh(value: list[dict]) -> list[dict]:
    """What plain gr.Chatbot shows for the display's rewritten history (the reference)."""
    with gr.Blocks():
        plain = gr.Chatbot()
    return plain.postprocess(shown_history(value)).model_dump()


def test_a_streaming_reply_shows_as_a_fresh_postprocess_would_and_reuses_the_earlier_messages():
    view = _view()
    reply = ""
    for piece in ("Once", " upon", ' a <i style="color:red">time</i>'):
        reply += piece
        value = EARLIER + [{"role": "assistant", "content": reply}]
        first = view.postprocess(value)
        assert first.model_dump() == _fresh(value)
    again = view.postprocess(EARLIER + [{"role": "assistant", "content": reply + "."}])
    # the earlier messages are the very objects made before; the grown reply is made anew
    assert [id(m) for m in again.root[:3]] == [id(m) for m in first.root[:3]]
    assert again.root[3] is not first.root[3]
    assert "style" not in again.model_dump()[0]["content"][0]["text"]


def test_a_changed_or_other_conversation_is_not_shown_from_the_kept_messages():
    view = _view()
    view.postprocess(EARLIER)
    edited = [EARLIER[0], {"role": "assistant", "content": "edited"}, {"role": "user", "content": "Write a story"}]
    assert view.postprocess(edited).model_dump() == _fresh(edited)
    assert view.postprocess([]).model_dump() == []
    assert view.postprocess(None).model_dump() == []
    # only the last value's messages are kept: memory holds one conversation, and no other view's
    assert view._shown == {}
    view.postprocess(EARLIER)
    assert len(view._shown) == 3 and _view()._shown == {}  # kept per display, not shared by the class
    metadata = [{"role": "assistant", "content": "thinking", "metadata": {"title": "Tool"}}]
    assert view.postprocess(metadata).model_dump() == _fresh(metadata)
