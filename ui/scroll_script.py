"""The script that shows a search hit's message once its chat is open: scrolled into the middle of the chat and
outlined for a moment (the class `ig-found`, styled in ui/layout.py's CSS).

    event.then(None, scroll_target, None, js=SCROLL_TO_FOUND)   # scroll_target: 'index/count' or ''

The target is '<message index>/<messages in the chat>': the script waits (up to 10 s) until the chat shows
that many messages, so it never scrolls the chat that was open before. Gradio's Chatbot scrolls itself to its
newest message 300 ms after a new value (later on a loaded machine): while the message is outlined, a scroll
that hides it is undone unless the user moved the chat (wheel, touch, key or pointer). Gradio's chat renders one element per
message, `data-testid` 'user' or 'bot', in order.
"""

from __future__ import annotations

FOUND_SECONDS = 3  # how long the found message stays outlined

# the chat's scrolled area around an element in it, or null while the chat does not overflow (never the page
# around the chat); ui/live_reply.py's script follows a growing reply with it too
CHAT_AREA_OF = """(element) => {
  const chat = document.getElementById("ig-chat");
  let area = element.parentElement;
  while (area && area !== chat && area.scrollHeight <= area.clientHeight + 1) area = area.parentElement;
  return area && area !== chat ? area : null;
}"""

SCROLL_TO_FOUND = """(target) => {
  const [index, count] = String(target || "").split("/").map(Number);
  if (!Number.isInteger(index) || index < 0) return;
  const deadline = Date.now() + 10000;
  const areaOf = %(area_of)s;
  const hidden = (element, area) => {
    const shown = area.getBoundingClientRect(), box = element.getBoundingClientRect();
    return box.bottom <= shown.top || box.top >= shown.bottom;
  };
  const messages = () => {
    const chat = document.getElementById("ig-chat");
    return chat ? chat.querySelectorAll('[data-testid="user"], [data-testid="bot"]') : [];
  };
  const show = () => {
    if (messages().length !== count) {
      if (Date.now() < deadline) setTimeout(show, 100);
      return;
    }
    let found = messages()[index];
    const area = areaOf(found);
    found.scrollIntoView({block: "center"});
    found.classList.add("ig-found");
    if (!area) {  // a chat that does not scroll cannot hide it
      setTimeout(() => found.classList.remove("ig-found"), %(found_ms)d);
      return;
    }
    // the chat scrolls itself to its newest message a moment after each new value (and may draw its messages
    // anew): while the message is outlined, such a scroll is undone, unless the user moved the chat
    let moved = false;
    const byUser = () => { moved = true; };
    const back = () => {
      if (!found.isConnected && messages().length === count) {
        found = messages()[index];
        found.classList.add("ig-found");
      }
      if (!moved && found.isConnected && hidden(found, area)) found.scrollIntoView({block: "center"});
    };
    const events = ["wheel", "touchstart", "keydown", "pointerdown"];
    events.forEach((name) => area.addEventListener(name, byUser, {passive: true}));
    area.addEventListener("scroll", back, {passive: true});
    setTimeout(() => {
      found.classList.remove("ig-found");
      area.removeEventListener("scroll", back);
      events.forEach((name) => area.removeEventListener(name, byUser));
    }, %(found_ms)d);
  };
  show();
}""" % {"area_of": CHAT_AREA_OF, "found_ms": FOUND_SECONDS * 1000}
