"""bench/page.py's reading of the chat value that the page's /send streams to gradio_client."""

from bench.page import reply_text


def test_reply_text_joins_the_text_parts_of_the_last_assistant_message():
    history = [{"role": "user", "content": [{"type": "text", "text": "Hello"}]},
               {"role": "assistant", "content": [{"type": "text", "text": "Once upon"},
                                                 {"type": "file", "file": {"path": "x.png"}},
                                                 {"type": "text", "text": " a time"}]}]
    assert reply_text(history) == "Once upon a time"


def test_reply_text_takes_a_plain_string_content():
    assert reply_text([{"role": "assistant", "content": "Hi there"}]) == "Hi there"


def test_no_reply_text_while_the_user_message_is_last():
    # the page's first update shows the message before the model reads it: that is not the reply's first text
    assert reply_text([{"role": "assistant", "content": "old reply"}, {"role": "user", "content": "Next?"}]) == ""
    assert reply_text([]) == ""
