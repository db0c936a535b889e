"""Token counts from the remote server's own tokenizer, where it serves one (`python app.py --backend URL`).

    tokens = BackendTokens(client)
    tokens.count(conversation("Be brief.", [("user", "Hi")]))   # 17, or None when the server has no tokenizer

Two shapes are known, both served at the server's root (beside /v1):
- vLLM's (and this app's) `POST /tokenize` with `{"model", "messages", "add_generation_prompt"}`, answering
  `{"count", "tokens", "max_model_len"}`: the chat template is applied by the server, so the count is exact;
- llama.cpp's `llama-server`: `POST /apply-template` with `{"messages"}` gives the templated prompt, then
  `POST /tokenize` with `{"content", "add_special"}` its tokens (always with the reply's opening).
llama-cpp-python's `/extras/tokenize` takes bare text without the chat template, so it is not used: a count
there would be short by the template's tokens. Where neither answers, counts come from each reply's usage.
"""

from __future__ import annotations

import json

import httpx

from sessions import WindowCheck

from .backend_client import BackendClient, BackendError

NO_ENDPOINT = "backend_not_found"  # a 404 that names no model: the server has no such endpoint
REFUSED = "backend_refused"  # another 4xx: this request refused (a count for it is then unknown), not the shape
RECENT = 4  # conversations whose counts are kept (a turn asks for the same one more than once)


class BackendTokens:
    def __init__(self, client: BackendClient) -> None:
        self.client = client
        self.shape: str | None = None  # "vllm", "llama-server" or "none" once the server has answered
        self._recent: dict[str, int] = {}

    def count(self, messages: list[dict], for_reply: bool = True) -> int | None:
        """The tokens of `messages` as the server's chat template makes them (`for_reply`: with the opening of
        the reply), or None when the server has no tokenizer of a known shape. BackendError when the server
        cannot be reached or refuses the key or the model, as a reply would."""
        if self.shape == "none":
            return None
        key = json.dumps([messages, for_reply])
        if key not in self._recent:
            if self.client.model is None:
                self.client.probe()  # the model's name is part of the request
            counted = self._llama_server(messages, for_reply) if self.shape == "llama-server" else \
                self._vllm(messages, for_reply)
            if counted is None:
                return None
            self._recent = {key: counted, **dict(list(self._recent.items())[: RECENT - 1])}
        return self._recent[key]

    def window_check(self, turns: list[dict], earlier_user_turns: int) -> WindowCheck:
        """Whether `turns` and a short reply fit the server model's window: the local engine's rule and wording
        (sessions.chat.WindowCheck), counted by the server. It fits when the server tells no count or no window
        (a prompt too long for it is then refused by the server, before anything is stored)."""
        prompt = self.count(turns)
        window = self.client.model.window if self.client.model is not None else None
        if prompt is None or window is None:
            return WindowCheck(True, prompt or 0, window or 0, 0)
        return WindowCheck.of(prompt, window, earlier_user_turns)

    def _vllm(self, messages: list[dict], for_reply: bool) -> int | None:
        response = self.client.server_post("/tokenize", {"model": self.client.model_name(), "messages": messages,
                                                         "add_generation_prompt": for_reply})
        body = self._answer(response)
        if body is None:
            return None
        if isinstance(body.get("count"), int):
            self.shape = "vllm"
            self.client.learn_window(body.get("max_model_len"))
            return body["count"]
        if self.shape is None and isinstance(body.get("tokens"), list):  # llama-server: it ignores `messages`
            self.shape = "llama-server"
            return self._llama_server(messages, for_reply)
        self.shape = "none"
        return None

    def _llama_server(self, messages: list[dict], for_reply: bool) -> int | None:
        if not for_reply:  # its template always opens the reply: leave this count to the replies' usage
            return None
        template = self._answer(self.client.server_post("/apply-template", {"messages": messages}))
        if template is None:  # no such endpoint (then no tokenizer: _answer), or this request refused
            return None
        if not isinstance(template.get("prompt"), str):
            self.shape = "none"
            return None
        body = self._answer(self.client.server_post("/tokenize", {"content": template["prompt"],
                                                                  "add_special": True}))
        if body is None:
            return None
        if not isinstance(body.get("tokens"), list):
            self.shape = "none"
            return None
        return len(body["tokens"])

    def _answer(self, response: httpx.Response) -> dict | None:
        """The JSON object of a 200 answer. None (and no tokenizer from now on) where the server has no such
        endpoint (404, 405, 501); None for this request alone where it refuses this one (a message its chat
        template rejects: 400) or answers it with no JSON object, so one odd request does not switch the window
        check off for every session. A refused key or model, or a busy server, is a BackendError."""
        if response.status_code == 200:
            try:
                body = response.json()
            except ValueError:
                body = None
            return body if isinstance(body, dict) else None
        error: BackendError = self.client.refusal(response)
        if error.code == NO_ENDPOINT or response.status_code in (405, 501):
            self.shape = "none"
            return None
        if error.code == REFUSED:
            return None
        raise error
