"""Other sites cannot use the local app through the user's browser; messages cannot restyle the page.

The guard (ui/guard.py with ui/site_checks.py) is exercised as the app runs it, as ASGI middleware, here in
front of a small Starlette app whose routes echo the Origin in Access-Control-Allow-Origin, as Gradio's CORS
middleware did for a rebinding page; the requests are the ones issue 34 sent with curl.
"""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from ui.chat_markup import shown_history, shown_text, without_page_styling
from ui.failure_throttle import FailureThrottle
from ui.guard import PageGuard, filter_cors_of
from ui.site_checks import HostPolicy, LoginThrottle

calls: list[str] = []


async def _record(request):
    calls.append(f"{request.method} {request.url.path}")
    if request.url.path == "/login" and (await request.form()).get("password") != "right":
        return JSONResponse({"detail": "Incorrect credentials."}, status_code=401)
    return JSONResponse({"ok": True}, headers={"access-control-allow-origin": request.headers.get("origin", "*")})


def _app(**guard) -> Starlette:
    routes = [Route(path, _record, methods=["GET", "POST"]) for path in
              ("/v1/models", "/v1/chat/completions", "/tokenize", "/config", "/gradio_api/queue/join", "/login")]
    return Starlette(routes=routes, middleware=[Middleware(PageGuard, **guard)])


def _client(**guard) -> TestClient:
    return TestClient(_app(**guard), base_url="http://127.0.0.1:7860")


@pytest.fixture(autouse=True)
def _no_calls():
    calls.clear()


def test_a_cross_site_text_plain_post_to_the_api_is_refused_and_reaches_nothing():
    client = _client()
    answer = client.post("/v1/chat/completions", content=b'{"messages": []}',
                         headers={"content-type": "text/plain", "origin": "http://evil.example"})
    assert answer.status_code == 403 and "another site (http://evil.example)" in answer.json()["error"]["message"]
    answer = client.post("/v1/chat/completions", content=b'{"messages": []}', headers={"content-type": "text/plain"})
    assert answer.status_code == 415 and answer.json()["error"]["message"].startswith("The request body must be JSON")
    answer = client.post("/tokenize", content=b'{"prompt": "x"}', headers={"content-type": "text/plain"})
    assert answer.status_code == 415  # the tokenizer beside /v1 (vLLM's place) costs CPU: the same rule
    assert calls == []
    assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 200  # curl, the OpenAI client
    assert calls == ["POST /v1/chat/completions"]
    with_key = _client(key="k")  # the key guards it: a cross-site page lacks it, whatever the content type
    assert with_key.post("/v1/chat/completions", content=b"{}", headers={"content-type": "text/plain"}).status_code == 401
    assert with_key.post("/v1/chat/completions", content=b"{}", headers={"content-type": "text/plain",
                                                                       "authorization": "Bearer k"}).status_code == 200


def test_state_changing_page_routes_refuse_another_origin_but_not_the_apps_own():
    client = _client()
    assert client.post("/gradio_api/queue/join", json={}, headers={"origin": "http://evil.example"}).status_code == 403
    assert client.post("/gradio_api/queue/join", json={}, headers={"origin": "null"}).status_code == 403
    assert client.post("/gradio_api/queue/join", json={}, headers={"origin": "http://127.0.0.1:7861"}).status_code == 403
    assert client.post("/gradio_api/queue/join", json={}, headers={"origin": "http://127.0.0.1:7860"}).status_code == 200
    assert calls == ["POST /gradio_api/queue/join"]


def test_a_rebinding_host_is_refused_and_cors_never_names_another_site():
    client = _client()
    answer = client.get("/config", headers={"host": "evil.example:7860", "origin": "http://evil.example:7860"})
    assert answer.status_code == 403 and "access-control-allow-origin" not in answer.headers
    assert "does not answer to the host name 'evil.example'" in answer.json()["error"]["message"]
    answer = client.get("/v1/models", headers={"origin": "http://evil.example"})  # a cross-site read
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers
    answer = client.get("/v1/models", headers={"origin": "http://127.0.0.1:7860"})
    assert answer.headers["access-control-allow-origin"] == "http://127.0.0.1:7860"
    for host in ("localhost:7860", "[::1]:7860", "192.168.1.20:7860", "app.localhost"):
        assert client.get("/config", headers={"host": host}).status_code == 200, host
    assert calls == ["GET /v1/models"] * 2 + ["GET /config"] * 4


def test_gradios_own_cors_middleware_outside_the_guard_is_filtered_too():
    from gradio.route_utils import CustomCORSMiddleware

    def app_with_gradios_cors() -> Starlette:
        app = Starlette(routes=[Route("/v1/models", _record)], middleware=[Middleware(PageGuard)])
        app.add_middleware(CustomCORSMiddleware, strict_cors=True)  # as gradio's create_app does
        return app

    lan = {"host": "192.168.1.20:7860", "origin": "http://evil.example"}
    local = {"host": "127.0.0.1:7860", "origin": "http://localhost:3000"}  # another program's page
    unfiltered = TestClient(app_with_gradios_cors())
    assert unfiltered.get("/v1/models", headers=lan).headers["access-control-allow-origin"] == "http://evil.example"
    filtered_app = app_with_gradios_cors()
    filter_cors_of(filtered_app)
    filtered = TestClient(filtered_app)
    for headers in (lan, local):
        answer = filtered.get("/v1/models", headers=headers)
        assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers
    own = filtered.get("/v1/models", headers={"host": "127.0.0.1:7860", "origin": "http://127.0.0.1:7860"})
    assert own.headers["access-control-allow-origin"] == "http://127.0.0.1:7860"
    # a rebinding page's Host and Origin agree (the page is evil.example now): its origin is the request's
    # own, but not the app's, and Gradio's layer named it on the guard's 403 (scripts/hostile_files_rerun.py)
    rebinding = {"host": "evil.example:7860", "origin": "http://evil.example:7860"}
    assert unfiltered.get("/v1/models", headers=rebinding).headers["access-control-allow-origin"] == \
        "http://evil.example:7860"
    answer = filtered.get("/v1/models", headers=rebinding)
    assert answer.status_code == 403 and "access-control-allow-origin" not in answer.headers
    tunnel = TestClient(app_with_gradios_cors())
    filter_cors_of(tunnel.app, HostPolicy(any_host=True))  # --share: any Host is the app's own
    named = {"host": "abc.gradio.live", "origin": "http://abc.gradio.live"}
    assert tunnel.get("/v1/models", headers=named).headers["access-control-allow-origin"] == "http://abc.gradio.live"


def test_the_host_policy_knows_the_listening_name_and_can_be_opened_for_a_tunnel():
    policy = HostPolicy.listening_on("mybox.lan", "chat.example")
    assert policy.allows("mybox.lan:7860") and policy.allows("CHAT.example") and not policy.allows("evil.example")
    assert not HostPolicy.listening_on("0.0.0.0").allows("evil.example")
    assert HostPolicy.listening_on("0.0.0.0", any_host=True).allows("abc.gradio.live")
    assert _client(hosts=HostPolicy(any_host=True)).get("/config", headers={"host": "x.gradio.live"}).status_code == 200


def test_failed_logins_are_throttled_per_client():
    client = _client(login_throttle=LoginThrottle(attempts=5, window_s=60))
    assert all(client.post("/login", data={"username": "a", "password": "right"}).status_code == 200
               for _ in range(12))  # successes are not counted (gradio_client logs in for every Client)
    statuses = [client.post("/login", data={"username": "a", "password": str(n)}).status_code for n in range(8)]
    assert statuses == [401] * 5 + [429] * 3
    assert client.post("/login", data={"username": "a", "password": "right"}).status_code == 429
    throttle = LoginThrottle(attempts=2, window_s=10)
    scope = {"method": "POST", "path": "/login", "client": ("10.0.0.1", 5)}
    for now in (0, 1):
        assert throttle.wait_before(scope, now=now) is None
        throttle.record(scope, 401, now=now)
    assert throttle.wait_before(scope, now=2) == 8
    assert throttle.wait_before(scope, now=10.5) is None  # the first failure has left the window
    assert throttle.wait_before({**scope, "client": ("10.0.0.2", 5)}, now=2) is None


def test_wrong_api_keys_are_throttled_per_address_and_the_right_key_is_never_counted():
    app = _app(key="k", key_throttle=FailureThrottle(attempts=3, window_s=60))
    guesser = TestClient(app, base_url="http://127.0.0.1:7860", client=("10.0.0.7", 50000))
    keyed = TestClient(app, base_url="http://127.0.0.1:7860", client=("10.0.0.8", 50000))
    right = {"authorization": "Bearer k"}
    assert all(guesser.get("/v1/models", headers=right).status_code == 200 for _ in range(10))  # never counted
    assert all(guesser.get("/v1/models").status_code == 401 for _ in range(5))  # no key: not a guess
    calls.clear()
    answers = [guesser.post("/v1/chat/completions", json={}, headers={"authorization": f"Bearer guess-{n}"})
               for n in range(5)]
    assert [a.status_code for a in answers] == [401] * 3 + [429] * 2
    assert answers[0].json()["error"]["code"] == "invalid_api_key"
    throttled = answers[-1]
    error = throttled.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    wait = int(throttled.headers["retry-after"])
    assert 1 <= wait <= 60 and error["message"] == f"Too many wrong API keys from this address; try again in {wait} seconds."
    # the right key waits too while its address guesses (else a 200 among the 429s would name the key) ...
    assert guesser.get("/tokenize", headers=right).status_code == 429
    # ... and only there: another address, with the right key or a wrong one, is answered as before
    assert keyed.get("/v1/models", headers=right).status_code == 200
    assert keyed.get("/v1/models", headers={"authorization": "Bearer guess"}).status_code == 401
    assert calls == ["GET /v1/models"]  # nothing refused reached the app
    assert guesser.get("/config").status_code == 200  # the page's routes are the login's to guard, not this


def test_the_key_throttle_forgets_each_failure_after_its_window():
    throttle = FailureThrottle(attempts=2, window_s=10)
    for now in (0, 1):
        assert throttle.wait_for("10.0.0.1", now=now) is None
        throttle.note_failure("10.0.0.1", now=now)
    assert throttle.wait_for("10.0.0.1", now=2) == 8  # until the first failure is 10 s old
    assert throttle.wait_for("10.0.0.2", now=2) is None
    assert throttle.wait_for("10.0.0.1", now=10.5) is None  # it is: one guess more ...
    throttle.note_failure("10.0.0.1", now=10.5)
    assert throttle.wait_for("10.0.0.1", now=10.6) == 1  # ... and the failure at 1 s holds it until 11 s
    assert throttle.wait_for("10.0.0.1", now=20.5) is None


def test_an_overlay_message_renders_as_plain_content():
    overlay = ('<div style="position:fixed;inset:0;z-index:99999;background:white" class="modal" id="x">'
               'Session expired: paste your API key <input name="key"></div>')
    shown = without_page_styling(overlay)
    assert shown == '<div>Session expired: paste your API key <input name="key"></div>'
    assert without_page_styling("<style>.gradio-container{display:none}</style>Hi") == "Hi"
    assert without_page_styling('<div/style="position:fixed">x</div>') == "<div>x</div>"
    assert without_page_styling('<p title="a>b" STYLE = \'top:0\'>x</p>') == '<p title="a>b">x</p>'
    code = "Use `<div style=\"x\">` or\n```html\n<div style=\"position:fixed\">\n```"
    assert without_page_styling(code) == code  # code shows its text as written
    assert without_page_styling("if a < b and style = 3 > c") == "if a < b and style = 3 > c"


def test_the_history_is_rewritten_for_display_only():
    stored = [{"role": "assistant", "content": '<b style="position:fixed">hi</b> ![x](http://evil.example/a.png)'}]
    shown = shown_history(stored)
    assert shown[0]["content"] == "<b>hi</b> [image from evil.example withheld]"
    assert stored[0]["content"].startswith('<b style="position:fixed">')  # the stored message is untouched
    assert shown_text("plain") == "plain"


def test_a_browser_opening_a_refused_page_reads_the_sentence_not_json():
    client = _client()
    browser = {"host": "evil.example:7860", "accept": "text/html,application/xhtml+xml,*/*;q=0.8"}
    answer = client.get("/config", headers=browser)
    assert answer.status_code == 403 and answer.headers["content-type"].startswith("text/html")
    assert "<p>This app does not answer to the host name &#x27;evil.example&#x27;" in answer.text
    assert "<script" not in answer.text and "{" not in answer.text
    # a script's fetch of the same route still gets the API's error shape
    fetched = client.get("/config", headers={"host": "evil.example:7860", "accept": "application/json"})
    assert fetched.json()["error"]["code"] == "forbidden"
    assert calls == []
