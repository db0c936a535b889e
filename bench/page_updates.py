"""What one update of a streaming reply costs the app's process and the browser, with no model running:
where the page's time goes while a reply streams (issue 35).

    python -m bench page-updates [--updates 80] [--interval 0.1]

A Gradio app in this process with the page's chat display (ui/chat_view.py) streams a reply into it,
`--updates` updates `--interval` s apart, after the short or the long conversation of `python -m bench page`
(none, or 120 messages); headless Chromium shows it. 'reply only' streams the same text into a plain HTML
component instead: Gradio's own cost of an update, whatever the output. Per update: CPU milliseconds of
this process (the server; the bench's own sampling included, a constant) and of the browser, from /proc,
over the whole stream (an idle page's share included: a short interval keeps it small).
"""

from __future__ import annotations

import os
import time

from .page import CASES, CpuClock, _launch

WORDS = (CASES["long"].earlier[0][1] + " ").split() * 40


def _app(updates: int, interval_s: float, shown: dict):
    import gradio as gr

    from ui.chat_view import ChatView

    def stream_chat():
        text = ""
        for number in range(updates):
            text += " " + " ".join(WORDS[number * 4:(number + 1) * 4])
            yield shown["history"] + [{"role": "user", "content": "Write a story"},
                                      {"role": "assistant", "content": text}]
            time.sleep(interval_s)

    def stream_text():
        for history in stream_chat():
            yield history[-1]["content"]

    with gr.Blocks() as demo:
        chat = ChatView(elem_id="ig-chat", height=460)
        reply = gr.HTML(elem_id="reply")
        gr.Button("chat", elem_id="go-chat").click(stream_chat, None, chat, show_progress="hidden")
        gr.Button("text", elem_id="go-text").click(stream_text, None, reply, show_progress="hidden")
        gr.Button("show", elem_id="show").click(lambda: shown["history"], None, chat)
    return demo


def measure(updates: int = 80, interval_s: float = 0.1, show=print) -> list[dict]:
    from playwright.sync_api import sync_playwright

    shown: dict = {"history": []}
    demo = _app(updates, interval_s, shown)
    demo.queue()
    _, url, _ = demo.launch(prevent_thread_lock=True, quiet=True)
    clock = CpuClock(-1)  # no app subprocess: every descendant of this process is the browser
    rows = []
    show("| conversation | into | app CPU (ms/update) | browser CPU (ms/update) |\n|---|---|---|---|")
    try:
        with sync_playwright() as playwright:
            browser = _launch(playwright)
            page = browser.new_page(viewport={"width": 1400, "height": 1300})
            page.goto(url)
            for case in ("short", "long", "short", "long"):
                shown["history"] = CASES[case].messages()[:-1]
                page.locator("#show").click()
                for into in ("chat", "text"):
                    time.sleep(2)
                    app_start, browser_start = sum(os.times()[:2]), clock.sample()[1]
                    page.locator(f"#go-{into}").click()
                    time.sleep(updates * interval_s + 1.5)  # the stream, and its last update drawn
                    app_end, browser_end = sum(os.times()[:2]), clock.sample()[1]
                    rows.append({"conversation": case, "into": "the chat" if into == "chat" else "reply only",
                                 "app_ms": 1000 * (app_end - app_start) / updates,
                                 "browser_ms": 1000 * (browser_end - browser_start) / updates})
                    r = rows[-1]
                    show(f"| {case} | {r['into']} | {r['app_ms']:.1f} | {r['browser_ms']:.1f} |")
            browser.close()
    finally:
        demo.close()
    return rows
