"""A script the page runs before Gradio's own, and the ASGI middleware that puts it at the start of the <head>
of every HTML response.

The script slows a loop in Gradio 6's frontend that otherwise never ends. Each output component has a status
tracker, and while its event is pending the tracker counts the seconds in a requestAnimationFrame loop. A
tracker that goes away while its event is still pending keeps that loop running, once per display frame, for
the life of the page; on this app's page such loops run within seconds of loading it, an idle page too. The
browser then repaints 60 times a second on the cores the model decodes on: with the page idle in a headless
Chromium on the 2-core VM, Chromium took 0.11 of a core, and the API decoded at 0.90x its rate with no page
open (docs/BENCHMARKS.md, "The page open while a reply decodes").

The tracker's module keeps its own reference to requestAnimationFrame, taken when the module loads, so the
patch has to be in place before any of Gradio's modules: Gradio's `head=` is added by its own script, too
late. A frame asked for from the tracker's module (its file is named statustracker-<hash>.js) comes after a
second instead; the elapsed seconds it shows still count, once a second. Every other frame is the browser's
own, but for one loop more (next paragraph). Where a later Gradio names the file otherwise, nothing changes but the cost of the
loop.

The same goes for the loader, Gradio's animated logo over an output while its event is pending with
show_progress="full": it moves by springs that Svelte steps in an animation loop of its own (one loop for the
whole page, each step asking for the next frame), and the page's first loader, over the whole app while it
loads, goes on springing for about eight seconds after it is gone: 25-45 frames a second, in the very seconds
in which a user's first message decodes. Frames for that loop are deferred likewise while no loader or
progress bar is in the document; once one is, they come at every display frame again. (In Gradio 6 the status
trackers' springs are the loop's only users on this page. The page-load event and the sidebar refresh after
each event show no loader at all: they take milliseconds. Chromium over seconds 1-9 after the page is ready, three pages each:
0.116 -> 0.095 of a core; docs/BENCHMARKS.md.)

It also makes the login page say why a login was refused. Gradio 6's login form posts the user name and key to
/login with `fetch` and reacts to two answers only: 400 ("Incorrect Credentials") and 200 (it reloads). This
app answers some logins otherwise: 429 when a client has failed too often (ui/site_checks.py LoginThrottle),
403 for a request from another site; Gradio's form then did nothing at all. The script wraps `window.fetch` so
that a POST to this origin's /login answered with anything but 200 or 400 puts the answer's sentence (the
`error.message` of the app's JSON refusal; for another body its status) in an element with role="alert" above
the form; 200 and 400 are left to Gradio, and the next attempt clears the sentence. The login module calls the
global `fetch` when the button is pressed, so the wrapper may be installed at any time before that.

    app_kwargs["middleware"] = [Middleware(PageGuard, key=key), Middleware(HeadScript)]
"""

from __future__ import annotations

import re

from .live_reply import LIVE_REPLY_SCRIPT

THROTTLED_FRAME_MS = 1000

# Gradio's loader (its logo, drawn while an event with show_progress="full" is pending) and its progress bar
LOADER_SHOWN = 'svg[viewBox="-1200 -1200 3000 3000"], .eta-bar'

SLOW_STATUS_TRACKER_FRAMES = f"""(() => {{
  const nextFrame = window.requestAnimationFrame.bind(window);
  const loaderShown = () => document.querySelector('{LOADER_SHOWN}') !== null;
  window.requestAnimationFrame = function (callback) {{
    const stack = new Error().stack || "";
    if (stack.includes("statustracker") || (stack.includes("at Object.tick") && !loaderShown())) {{
      return window.setTimeout(() => callback(performance.now()), {THROTTLED_FRAME_MS});
    }}
    return nextFrame(callback);
  }};
}})();"""

LOGIN_REFUSAL_ID = "ig-login-refusal"

SHOW_LOGIN_REFUSALS = """(() => {
  const realFetch = window.fetch;
  if (typeof realFetch !== "function") return;
  const isLoginPost = (input, init) => {
    try {
      const request = input instanceof Request ? input : null;
      const method = ((init && init.method) || (request ? request.method : "GET")).toUpperCase();
      const url = new URL(request ? request.url : String(input), location.href);
      return method === "POST" && url.origin === location.origin && /\\/login\\/?$/.test(url.pathname);
    } catch (error) {
      return false;
    }
  };
  const say = (text) => {
    let line = document.getElementById("%(id)s");
    if (text === null) {
      if (line) line.remove();
      return;
    }
    if (!line) {
      line = document.createElement("p");
      line.id = "%(id)s";
      line.setAttribute("role", "alert");
      line.style.cssText = "color: var(--error-text-color, #b91c1c); font-weight: 600; margin: 0.5em 0;";
      const password = document.querySelector("input[type='password']");
      const form = password && password.closest(".form");
      if (form && form.parentNode) form.parentNode.insertBefore(line, form);
      else document.body.prepend(line);
    }
    line.textContent = text;
  };
  const sentence = async (response) => {
    const fallback = `The login was refused (HTTP ${response.status}).`;
    try {
      const data = await response.clone().json();
      const error = data && data.error;
      const text = (error && typeof error === "object" && error.message) || (typeof error === "string" && error)
        || (data && typeof data.detail === "string" && data.detail);
      return typeof text === "string" && text.trim() ? text.trim().slice(0, 500) : fallback;
    } catch (error) {
      return fallback;
    }
  };
  window.fetch = async function (input, init) {
    if (!isLoginPost(input, init)) return realFetch.apply(window, arguments);
    say(null);
    let response;
    try {
      response = await realFetch.apply(window, arguments);
    } catch (error) {
      say("The app did not answer the login; try again.");
      throw error;
    }
    if (response.status !== 200 && response.status !== 400) say(await sentence(response));
    return response;
  };
})();""" % {"id": LOGIN_REFUSAL_ID}

PAGE_SCRIPT = SLOW_STATUS_TRACKER_FRAMES + "\n" + SHOW_LOGIN_REFUSALS + "\n" + LIVE_REPLY_SCRIPT

_HEAD = re.compile(rb"<head(\s[^>]*)?>", re.IGNORECASE)


def with_script(html: bytes, tag: bytes) -> bytes:
    """`html` with `tag` right after its first <head> tag (unchanged when it has none)."""
    match = _HEAD.search(html)
    if match is None:
        return html
    return html[:match.end()] + tag + html[match.end():]


def _plain_html(headers) -> bool:
    """An HTML body this middleware can read: not compressed (Gradio does not compress its page)."""
    names = {name.lower(): value for name, value in headers}
    return names.get(b"content-type", b"").startswith(b"text/html") and b"content-encoding" not in names


class HeadScript:
    def __init__(self, app, script: str = PAGE_SCRIPT) -> None:
        self.app = app
        self.tag = f"<script>{script}</script>".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start: dict | None = None  # an HTML response's start, held until its whole body is here
        body: list[bytes] = []

        async def send_with_script(message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and _plain_html(message.get("headers", ())):
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                return await send(message)
            body.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            html = b"".join(body)
            changed = with_script(html, self.tag)
            headers = list(start.get("headers", ()))
            if changed is not html:
                headers = [(name, value) for name, value in headers if name.lower() != b"content-length"]
                headers.append((b"content-length", str(len(changed)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": changed})

        await self.app(scope, receive, send_with_script)
