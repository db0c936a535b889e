"""The launched app, driven through its API with gradio_client (a real server process)."""

import time

import pytest
from gradio_client import Client

from app_server import running_app


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    with running_app(tmp_path_factory.mktemp("app-data")) as running:
        yield running


@pytest.fixture
def client(app):
    return Client(app.url, verbose=False, auth=app.auth)


def text_of(message):
    content = message["content"]
    return content if isinstance(content, str) else "".join(part.get("text", "") for part in content)


def assistant_text(history):
    return text_of(history[-1])


def sessions(client):
    return client.predict(api_name="/list_sessions")


def test_send_streams_the_reply(client):
    client.predict(api_name="/new_session")
    job = client.submit("What is the capital of France?", api_name="/send")
    updates = [history for history, _ in job]
    assert len(updates) >= 3  # streamed token by token, not in one piece
    assert "Paris" in assistant_text(updates[-1])
    partial = [assistant_text(h) for h in updates[:-1]]
    assert any(0 < len(p) < len(assistant_text(updates[-1])) for p in partial)
    newest = sessions(client)[0]
    assert newest["message_count"] == 2 and newest["token_count"] > 20
    assert newest["title"] == "What is the capital of France?"


def test_stop_keeps_what_was_generated(client):
    client.predict("infinigen", 5, "0.2", 0.25, "", False, 0.0, 1.0, 0, 1.0, 200, api_name="/apply_settings")
    client.predict(api_name="/new_session")
    job = client.submit("Write a long story about a dragon and a lighthouse keeper.", api_name="/send")
    while len(job.outputs()) < 6 and not job.done():
        time.sleep(0.1)
    client.predict(api_name="/stop")
    started = time.time()
    final = job.result()[0]
    assert time.time() - started < 30
    kept = assistant_text(final)
    assert kept and len(kept.split()) < 150  # stopped long before max_new_tokens
    newest = sessions(client)[0]
    assert newest["message_count"] == 2  # the partial reply is stored
    assert newest["token_count"] < 60 + 200


def test_reopening_a_session_restores_it_from_disk(client):
    client.predict(api_name="/new_session")
    first = client.submit("Name a colour.", api_name="/send").result()[0]
    session_id = client.predict(api_name="/status")["session"]
    client.predict(api_name="/new_session")
    history, status = client.predict(session_id, api_name="/open_session")
    assert [m["role"] for m in history] == ["user", "assistant"]
    assert assistant_text(history) == assistant_text(first)
    assert "Restored" in status and "tokens from disk" in status


def test_bad_input_gets_a_readable_message(client):
    with pytest.raises(Exception, match="empty"):
        client.predict("   ", api_name="/send")
    with pytest.raises(Exception, match="alpha"):
        client.predict("infinigen", -1, "0.2", 0.25, "", False, 0.0, 1.0, 0, 1.0, 64, api_name="/apply_settings")
    with pytest.raises(Exception, match="pool limit"):
        client.predict("infinigen", 5, "0.2", 0.25, "lots", False, 0.0, 1.0, 0, 1.0, 64,
                       api_name="/apply_settings")
    before = sessions(client)[0]["message_count"]
    with pytest.raises(Exception, match="window"):
        client.predict("word " * 9000, api_name="/send")
    assert sessions(client)[0]["message_count"] == before  # nothing stored, nothing lost


def test_inspector_shows_fetched_tokens_beside_true_attention(client):
    client.predict("infinigen", 5, "0.2", 0.25, "", True, 0.0, 1.0, 0, 1.0, 8, 0, api_name="/apply_settings")  # no floor: a short chat selects
    client.predict(api_name="/new_session")
    client.predict("Tell me about the moon.", api_name="/send")
    page = client.predict(4, 10, api_name="/inspect")
    assert "Fetched by InfiniGen" in page and "True attention of layer 10" in page
    assert "ig-hit" in page and "recall of the fetched set" in page
    assert "attended densely" in client.predict(4, 0, api_name="/inspect")  # the first layers are dense
    client.predict("infinigen", 5, "0.2", 0.25, "", False, 0.0, 1.0, 0, 1.0, 16, api_name="/apply_settings")


def test_regenerate_edit_export_import_and_branch(client, tmp_path):
    from gradio_client import handle_file

    client.predict(api_name="/new_session")
    client.predict("Say hello.", api_name="/send")
    regenerated = client.predict(api_name="/regenerate")
    assert [m["role"] for m in regenerated] == ["user", "assistant"]  # replaced, not appended
    edited, _ = client.predict("Say goodbye.", api_name="/edit_last")
    assert [m["role"] for m in edited] == ["user", "assistant"] and "goodbye" in text_of(edited[0])

    exported = client.predict(api_name="/export")
    count = len(sessions(client))
    imported = client.predict(handle_file(exported), api_name="/import")
    assert [text_of(m) for m in imported] == [text_of(m) for m in edited]
    assert len(sessions(client)) == count + 1

    broken = tmp_path / "broken.igchat"
    broken.write_bytes(b"not an archive")
    with pytest.raises(Exception, match="not a session export"):
        client.predict(handle_file(str(broken)), api_name="/import")
    assert len(sessions(client)) == count + 1  # the failed import added nothing and lost nothing

    branched = client.predict(1, api_name="/branch")
    assert [m["role"] for m in branched] == ["user"]
    assert len(sessions(client)) == count + 2
