"""The OpenAI-compatible API of a real `python app.py`, driven by the official `openai` client.

One app process serves the module (its API needs a key, given through the environment); the restart test
starts a second process on the same data directory, as a reopened app would.
"""

from __future__ import annotations

import time

import openai
import pytest
from openai import OpenAI

from sessions import SessionStore

from app_server import running_app

KEY = "test-key-7f3a"
SYSTEM = "You are a concise assistant. Answer in one sentence."


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with running_app(tmp_path_factory.mktemp("api-data"), env={"INFINIGEN_API_KEY": KEY}) as running:
        yield running


def client_for(app, key: str = KEY) -> OpenAI:
    return OpenAI(base_url=f"{app.url}v1", api_key=key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def client(app):
    return client_for(app)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def stored(app, session_id: str):
    """The session as the app stored it, read from its database by a second reader (as another process would)."""
    store = SessionStore(app.data_dir)
    try:
        return store.get(session_id), store.messages(session_id)
    finally:
        store.db.conn.close()


def stored_chunks(app, session_id: str):
    store = SessionStore(app.data_dir)
    try:
        return store.chunks(session_id)
    finally:
        store.db.conn.close()


def ask(client, model_id, messages, **options):
    """A non-streamed completion and the session it was stored in."""
    raw = client.chat.completions.with_raw_response.create(model=model_id, messages=messages, **options)
    return raw.parse(), raw.headers["x-infinigen-session"], raw.headers["x-infinigen-continued"] == "true"


def test_models_lists_the_loaded_model(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]


def test_a_reply_without_streaming_is_stored_as_an_api_session(app, client, model_id):
    reply, session_id, continued = ask(client, model_id, [{"role": "user", "content": "What is the capital of France?"}],
                                       max_tokens=24, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop" and reply.model == model_id
    usage = reply.usage
    assert usage.prompt_tokens > 10 and 0 < usage.completion_tokens <= 24
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    summary, messages = stored(app, session_id)
    assert not continued and summary.origin == "api"
    assert [(m.role, m.content) for m in messages] == [("user", "What is the capital of France?"),
                                                      ("assistant", reply.choices[0].message.content)]
    assert summary.title == "What is the capital of France?"


def test_a_streamed_reply_comes_in_chunks_with_usage_at_the_end(client, model_id):
    stream = client.chat.completions.create(
        model=model_id, messages=[{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": "Describe the sea."}],
        max_tokens=12, temperature=0.7, top_p=0.9, seed=3, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) >= 5  # token by token, not in one piece
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]  # 12 tokens is shorter than any description of the sea
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    # the same seed gives the same sampled reply, not streamed this time
    again, _, _ = ask(client, model_id, [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": "Describe the sea."}],
                      max_tokens=12, temperature=0.7, top_p=0.9, seed=3)
    assert again.choices[0].message.content == "".join(deltas)


def test_stop_strings_end_the_reply(client, model_id):
    reply, _, _ = ask(client, model_id, [{"role": "user", "content": "Count from one to ten in words."}],
                      max_tokens=60, temperature=0, stop=["4."])  # this model counts "1. 1", "2. 2", ...
    text = reply.choices[0].message.content
    assert "3" in text and "4" not in text and reply.choices[0].finish_reason == "stop"


def long_conversation() -> list[dict]:
    from infinigen_core.calibration import calibration_text

    document = calibration_text()[:3000]
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Here is a story:\n\n{document}\n\nWho is it about?"}]


def test_a_conversation_that_comes_back_longer_reads_only_its_new_tokens(app, client, model_id):
    messages = long_conversation()
    first, session_id, continued = ask(client, model_id, messages, max_tokens=20, temperature=0)
    assert not continued and first.usage.prompt_tokens > 500

    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And where does it happen?"}]
    second, same_session, continued = ask(client, model_id, messages, max_tokens=20, temperature=0)
    assert same_session == session_id and continued
    cached = second.usage.prompt_tokens_details.cached_tokens
    # the whole first prompt is reused; read are the new question and at most the previous reply's tokens
    # (a reply's text can tokenize differently from the way it was generated)
    new_question_tokens = second.usage.prompt_tokens - first.usage.prompt_tokens - first.usage.completion_tokens
    assert cached >= first.usage.prompt_tokens
    assert second.usage.prompt_tokens - cached <= new_question_tokens + first.usage.completion_tokens + 2
    _, stored_messages = stored(app, session_id)
    assert [m.role for m in stored_messages] == ["user", "assistant", "user", "assistant"]


def test_a_diverging_conversation_shares_the_common_prefix(app, client, model_id):
    messages = long_conversation()
    first, first_session, _ = ask(client, model_id, messages, max_tokens=8, temperature=0)
    fork = messages + [{"role": "assistant", "content": "A different answer than the one given."},
                       {"role": "user", "content": "Summarise it in five words."}]
    second, second_session, continued = ask(client, model_id, fork, max_tokens=8, temperature=0)
    assert second_session != first_session and not continued  # the stored one had another reply: a new session
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    first_chunks = SessionStore(app.data_dir).chunks(first_session)
    second_chunks = SessionStore(app.data_dir).chunks(second_session)
    assert second_chunks and second_chunks[0].file == first_chunks[0].file  # the same file on disk, as branch does


def test_the_api_needs_the_key(app, model_id):
    import json
    import urllib.error
    import urllib.request

    with pytest.raises(openai.AuthenticationError) as caught:
        client_for(app, "not-the-key").chat.completions.create(model=model_id,
                                                               messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client_for(app, "not-the-key").models.list()
    with pytest.raises(urllib.error.HTTPError) as no_key:  # no Authorization header at all
        urllib.request.urlopen(f"{app.url}v1/models", timeout=30)
    assert no_key.value.code == 401 and "Bearer" in json.load(no_key.value)["error"]["message"]


@pytest.mark.parametrize("change, status, param, words", [
    ({"messages": []}, 400, "messages", "non-empty"),
    ({"messages": [{"role": "wizard", "content": "Hi"}]}, 400, "messages[0].role", "unknown role"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Late"}]}, 400,
     "messages[1].role", "only at the start"),
    ({"messages": [{"role": "user", "content": "word " * 9000}]}, 400, "messages", "window"),
    ({"temperature": 3}, 400, "temperature", "[0, 2]"),
    ({"top_p": 0}, 400, "top_p", "(0, 1]"),
    ({"max_tokens": 0}, 400, "max_tokens", "at least 1"),
    ({"max_completion_tokens": "many"}, 400, "max_completion_tokens", "integer"),
    ({"n": 2}, 400, "n", "n must be 1"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "up to 4"),
    ({"model": "gpt-4o"}, 404, "model", "not served here"),
])
def test_bad_requests_get_an_openai_error_and_store_nothing(app, client, model_id, change, status, param, words):
    before = len(SessionStore(app.data_dir).list())
    request = {"model": model_id, "messages": [{"role": "user", "content": "Hi"}], **change}
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(**request)
    error = caught.value
    assert error.status_code == status
    assert error.body["param"] == param and words in error.body["message"]
    assert error.body["type"] == "invalid_request_error"
    assert len(SessionStore(app.data_dir).list()) == before


def test_a_client_that_goes_away_stops_the_generation_and_keeps_what_came(app, client, model_id):
    stream = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": "Count from 1 to 1000, separated by commas."}],
        max_tokens=1000, temperature=0, stream=True)
    raw = stream.response
    session_id = raw.headers["x-infinigen-session"]
    received = ""
    for chunk in stream:
        received += chunk.choices[0].delta.content or ""
        if len(received) > 12:
            break
    stream.close()
    deadline = time.time() + 120
    while time.time() < deadline:
        summary, messages = stored(app, session_id)
        # the reply is stored (and updated) while it streams; the turn has ended once the reply's KV chunk is
        # written beside the prompt's
        if len(messages) == 2 and len(stored_chunks(app, session_id)) == 2:
            break
        time.sleep(0.5)
    assert [m.role for m in messages] == ["user", "assistant"]
    kept = messages[1].content
    assert kept.startswith(received.strip()[:10])
    assert messages[1].token_end - messages[1].token_start < 500  # stopped long before 1000 tokens


def test_a_continued_conversation_after_a_restart_reads_only_its_new_tokens(app, client, model_id):
    messages = long_conversation()[1:]
    first, session_id, _ = ask(client, model_id, messages, max_tokens=16, temperature=0)
    # another conversation: the first app lets go of this one, as if it had been closed
    ask(client, model_id, [{"role": "user", "content": "Hello"}], max_tokens=4)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Give it a title."}]
    with running_app(app.data_dir, env={"INFINIGEN_API_KEY": KEY}) as restarted:
        second, same_session, continued = ask(client_for(restarted), model_id, messages, max_tokens=8,
                                              temperature=0)
    assert same_session == session_id and continued
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens  # read from disk, not recomputed
    assert second.usage.prompt_tokens - cached <= 40 + first.usage.completion_tokens
