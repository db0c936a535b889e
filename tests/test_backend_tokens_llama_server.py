"""Counting a prompt through llama.cpp's `llama-server` shape of tokenizer (`POST /apply-template`, then
`POST /tokenize` with `content`), which no binary here can serve: a small HTTP server answers those routes
the way llama-server documents them (its /tokenize ignores a vLLM-style body and answers `{"tokens": []}`).
The chat template and tokenizer of the stand-in are deliberately simple (one token per word), so the count the
client reports can be checked against what the server was asked."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from chat_service.backend_client import BackendClient, BackendConfig
from chat_service.backend_tokens import BackendTokens


def templated(messages: list[dict]) -> str:
    return "".join(f"<|{m['role']}|> {m['content']} <|end|> " for m in messages) + "<|assistant|>"


class LlamaServerShape(BaseHTTPRequestHandler):
    requests: list[tuple[str, dict]] = []
    has_template_route = True

    def log_message(self, *args) -> None:  # quiet
        pass

    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            self._answer(200, {"object": "list", "data": [{"id": "model.gguf", "object": "model"}]})
        else:
            self._answer(404, {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        type(self).requests.append((self.path, body))
        if self.path == "/apply-template" and type(self).has_template_route:
            self._answer(200, {"prompt": templated(body["messages"])})
        elif self.path == "/tokenize":
            content = body.get("content", "")
            special = ["<bos>"] if body.get("add_special") and content else []
            self._answer(200, {"tokens": list(range(len(special + content.split())))})
        else:
            self._answer(404, {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}})


@pytest.fixture
def llama_server():
    LlamaServerShape.requests = []
    LlamaServerShape.has_template_route = True
    server = ThreadingHTTPServer(("127.0.0.1", 0), LlamaServerShape)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()


def test_llama_server_counts_the_templated_prompt_with_its_special_token(llama_server):
    tokens = BackendTokens(BackendClient(BackendConfig(llama_server)))
    try:
        said = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, model"}]
        assert tokens.count(said) == 1 + len(templated(said).split())
        assert tokens.shape == "llama-server"
        paths = [path for path, _ in LlamaServerShape.requests]
        assert paths == ["/tokenize", "/apply-template", "/tokenize"]  # vLLM's shape tried first, once
        assert LlamaServerShape.requests[-1][1] == {"content": templated(said), "add_special": True}
        # a second count asks llama-server's routes only; the same conversation again is not asked at all
        longer = said + [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "More words here"}]
        assert tokens.count(longer) == 1 + len(templated(longer).split())
        assert tokens.count(longer) == 1 + len(templated(longer).split())
        assert [path for path, _ in LlamaServerShape.requests[3:]] == ["/apply-template", "/tokenize"]
        # its template always opens the reply: a count without the reply's opening is left to usage
        assert tokens.count(said, for_reply=False) is None and tokens.shape == "llama-server"
    finally:
        tokens.client.close()


def test_a_llama_server_without_the_template_route_has_no_tokenizer(llama_server):
    LlamaServerShape.has_template_route = False
    tokens = BackendTokens(BackendClient(BackendConfig(llama_server)))
    try:
        assert tokens.count([{"role": "user", "content": "Hi"}]) is None
        assert tokens.shape == "none"  # 404 on /apply-template: no count of a known shape, none asked again
        asked = len(LlamaServerShape.requests)
        assert tokens.count([{"role": "user", "content": "Hello again"}]) is None
        assert len(LlamaServerShape.requests) == asked
    finally:
        tokens.client.close()
