"""The page's reply as it grows, outside Gradio's updates: the route the page reads it from, and the page's script.

Every update Gradio sends while an event streams makes its frontend copy the value of every component that ever
had a status (the whole conversation among them) and redraw the chat; with a long conversation open that took a
fifth of the model's decode rate on a 2-core machine (docs/BENCHMARKS.md, issue 35). So when the page sends a
message (or regenerates, or replaces the last one), its event's `js` step names the reply with 128 random bits
(START_LIVE_REPLY) and starts reading it from GET /live-reply?id=...; the turn writes the reply's text under
that id (chat_service/live_replies.py) and sends the chat only as the reply starts, its last message
LIVE_PLACEHOLDER, and when the turn is over. The route answers one JSON line per change, {"html", "started",
"done"} (and {} when nothing changed for KEEPALIVE_S): the reply rendered as Markdown with any HTML in it shown
as text (remote images as the chat shows them), which the script puts in the placeholder's bubble once the
reply has started, scrolling the chat along if it was at its end; a stream that ends before the reply is done
is asked for again. Once the chat's own value has replaced the placeholder, the script's element goes. A reply
refused before its turn (another reply running) is done without having started, and shows nothing.

    routes = live_reply_routes(service.live_replies)    # given to the app's constructor, guarded like the page
"""

from __future__ import annotations

import asyncio
import json
import time

from markdown_it import MarkdownIt
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import BaseRoute, Route

from chat_service.live_replies import REPLY_ID, LiveReplies
from chat_service.page_turns import LIVE_PLACEHOLDER

from .remote_images import withhold_remote_images
from .scroll_script import CHAT_AREA_OF

LIVE_REPLY_PATH = "/live-reply"
READ_EVERY_S = 0.05  # how often the route looks for new text (the turn writes every PAGE_UPDATE_SECONDS)
# the page asks as it sends; the handler opens the reply when it starts, behind the page's queue (a message sent
# while the model loads opens it at once). A reader whose wait ran out asks again while its message waits
WAIT_FOR_TURN_S = 900.0
WAIT_POLL_S = 0.25
# a line with nothing new after this long without one (a long prefill, a queue): a proxy or tunnel that cuts
# quiet connections leaves the stream open
KEEPALIVE_S = 15.0

# CommonMark with tables and strikethrough, a line break where the text has one (as the chat shows it); HTML in
# the text is escaped, so the result is safe to put in the page; links to javascript: and the like are refused
_MARKDOWN = MarkdownIt("commonmark", {"html": False, "breaks": True}).enable(["table", "strikethrough"])


def rendered(text: str) -> str:
    return _MARKDOWN.render(withhold_remote_images(text))


class GrowingMarkdown:
    """A growing reply rendered at each call at the cost of its last block: the blocks before the last blank line
    outside a code fence are rendered once (a 2,000-token reply rendered whole took ~6 ms of the event loop at
    every change). Until the chat shows the reply, a block is drawn without the ones around it: a list whose
    items are apart renders as separate lists, an indented code block with blank lines as several, and a
    reference link defined in another block as its text."""

    def __init__(self) -> None:
        self._done_text, self._done_html = "", ""

    def render(self, text: str) -> str:
        if not text.startswith(self._done_text):  # not the text this one grew from
            self._done_text, self._done_html = "", ""
        end = _blocks_end(text, len(self._done_text))
        if end > len(self._done_text):
            self._done_html += rendered(text[len(self._done_text):end])
            self._done_text = text[:end]
        return self._done_html + rendered(text[end:])


def _blocks_end(text: str, start: int) -> int:
    """The end of the last blank line after `start` (itself such an end, or 0) with no code fence open."""
    end, fenced, position = start, False, start
    for line in text[start:].splitlines(keepends=True):
        position += len(line)
        stripped = line.strip()
        if stripped.startswith(("```", "~~~")):
            fenced = not fenced
        elif not stripped and not fenced and position < len(text):
            end = position
    return end


def live_reply_routes(replies: LiveReplies) -> list[BaseRoute]:
    async def follow(request: Request):
        reply_id = request.query_params.get("id", "")
        if not REPLY_ID.fullmatch(reply_id):
            return JSONResponse({"error": {"message": "id must be 32 lowercase hex digits"}}, status_code=400)
        return StreamingResponse(_lines(replies, reply_id), media_type="application/x-ndjson",
                                 headers={"cache-control": "no-store"})

    return [Route(LIVE_REPLY_PATH, follow, methods=["GET"])]


async def _lines(replies: LiveReplies, reply_id: str):
    """One line per change of the reply until it is done, {"html", "started", "done"} ("started": the turn wrote
    text; a reply refused before its turn began is done without), and {} after KEEPALIVE_S without one; nothing
    when no turn opens the reply in time."""
    deadline = time.monotonic() + WAIT_FOR_TURN_S
    while (reply := replies.find(reply_id)) is None:
        if time.monotonic() > deadline:
            return
        await asyncio.sleep(WAIT_POLL_S)
    sent, markdown, last_line = -1, GrowingMarkdown(), time.monotonic()
    while True:
        state = reply.read()
        if state.version != sent:
            sent, last_line = state.version, time.monotonic()
            yield json.dumps({"html": markdown.render(state.text), "started": state.started,
                              "done": state.done}) + "\n"
        elif time.monotonic() - last_line > KEEPALIVE_S:
            last_line = time.monotonic()
            yield "{}\n"
        if state.done:
            return
        await asyncio.sleep(READ_EVERY_S)


# the events' `js` step: the last input (a hidden textbox) becomes the new reply's id, which the page follows
START_LIVE_REPLY = """(...values) => {
  values[values.length - 1] = window.igLiveReply ? window.igLiveReply() : "";
  return values;
}"""

# in the page's head (ui/head_script.py): window.igLiveReply() makes an id, follows its reply, returns the id.
# Gradio's chat draws each message as an element with data-testid 'bot' or 'user' and the message's own
# rendering in '.message-content > span.md'; the reply's element sits beside that span, which the page's CSS
# hides while the content is marked 'ig-live-shown' (ui/layout.py)
LIVE_REPLY_SCRIPT = """(() => {
  const PLACEHOLDER = %(placeholder)s;
  const ASK_AGAIN = 5;  // a stream that ends before its reply is done (a dropped connection) is asked for again
  const newId = () => Array.from(crypto.getRandomValues(new Uint8Array(16)),
                                 (byte) => byte.toString(16).padStart(2, "0")).join("");
  const ownText = (bubble) => {
    const own = bubble && bubble.querySelector(".message-content > span.md");
    return own ? own.textContent.trim() : null;
  };
  const placeholderBubble = () => {
    const bots = document.querySelectorAll("#ig-chat [data-testid='bot']");
    const last = bots[bots.length - 1];
    return last && ownText(last) === PLACEHOLDER ? last : null;
  };
  const scrolledArea = %(area_of)s;
  const follow = async (id) => {
    let shown = null, shownHtml = null, html = "", started = false, done = false;
    const show = () => {
      if (shown && (!shown.isConnected || ownText(shown.closest("[data-testid='bot']")) !== PLACEHOLDER)) {
        if (shown.parentElement) shown.parentElement.classList.remove("ig-live-shown");
        shown.remove();  // the chat drew its message anew, or has the reply now
        shown = shownHtml = null;
      }
      const bubble = shown || !started ? null : placeholderBubble();
      if (bubble) {
        shown = document.createElement("div");
        shown.className = "ig-live md chatbot prose";
        bubble.querySelector(".message-content").appendChild(shown);
      }
      if (!shown) return;
      shown.parentElement.classList.add("ig-live-shown");  // the page's CSS hides the placeholder beside it
      if (shownHtml === html) return;
      const area = scrolledArea(shown);
      const atEnd = area && area.scrollHeight - area.scrollTop - area.clientHeight < 48;
      shown.innerHTML = shownHtml = html;
      if (atEnd) area.scrollTop = area.scrollHeight;
    };
    const read = async () => {
      const response = await fetch("live-reply?id=" + id, {credentials: "same-origin", cache: "no-store"});
      if (!response.ok || !response.body) return;
      const reader = response.body.getReader(), decoder = new TextDecoder();
      let pending = "";
      for (;;) {
        const {value, done: ended} = await reader.read();
        if (ended) return;
        pending += decoder.decode(value, {stream: true});
        let end;
        while ((end = pending.indexOf("\\n")) >= 0) {
          const update = pending.slice(0, end) ? JSON.parse(pending.slice(0, end)) : {};
          pending = pending.slice(end + 1);
          done = done || update.done === true;
          if (update.started) {
            started = true;
            html = update.html;
            show();
          }
        }
      }
    };
    for (let asked = 0; !done && asked < ASK_AGAIN; asked++) {
      try {
        await read();
      } catch (error) {
        // asked again below, unless the reply is done
      }
      if (!done) await new Promise((resume) => setTimeout(resume, 1000));
    }
    if (!started) return;  // a message refused before its turn: its placeholder, if any, is another reply's
    // the turn is over: the element goes once the chat shows the reply itself (it is sent after the turn's save)
    const deadline = Date.now() + 600000;
    const tidy = () => {
      show();
      if (shown && Date.now() < deadline) setTimeout(tidy, 100);
      else if (shown) {
        shown.parentElement.classList.remove("ig-live-shown");
        shown.remove();
      }
    };
    tidy();
  };
  window.igLiveReply = () => {
    const id = newId();
    follow(id);
    return id;
  };
})();""" % {"placeholder": json.dumps(LIVE_PLACEHOLDER), "area_of": CHAT_AREA_OF}
