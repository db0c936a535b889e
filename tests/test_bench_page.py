"""bench/page.py's reading of the chat value that the page's /send streams to gradio_client, and of the CPU over
a page reply's own window."""

import os
import time

import pytest

from bench.page import CpuClock, CpuTrace, reply_text


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


def test_the_cpu_over_a_reply_is_read_between_its_own_first_and_last_change():
    trace = CpuTrace(CpuClock(os.getpid()))
    trace.samples = [(100.0, 10.0, 1.0), (101.0, 12.0, 1.5), (102.0, 14.0, 1.5), (103.0, 14.0, 1.5)]
    # from halfway through the first sample's period to halfway through the second: 2 CPU s in 1 s
    assert trace.cores_between(100.5, 101.5) == (2.0, 0.25)
    # the app went idle after 102: a window that runs on past the reply's end is diluted, as it should be
    app, browser = trace.cores_between(100.0, 103.0)
    assert (round(app, 6), round(browser, 6)) == (round(4 / 3, 6), round(0.5 / 3, 6))
    for outside in ((99.0, 101.0), (101.0, 104.0)):  # a reply timed outside its trace is an error, not a clamp
        with pytest.raises(ValueError, match="not within"):
            trace.cores_between(*outside)


def test_a_browser_process_that_ended_keeps_the_cpu_it_used():
    trace = CpuTrace(CpuClock(os.getpid()))
    trace._browser = [os.getpid()]  # this process stands in for a browser process that is read, then ends
    trace._sample()
    _, app, browser = trace.samples[-1]
    assert browser == app > 0
    trace._browser = [os.getpid(), 2**22 + 12345]  # and one that has already gone (no such pid)
    trace._seen[2**22 + 12345] = 1.5
    trace._sample()
    assert trace.samples[-1][2] >= browser + 1.5


def test_the_trace_samples_this_process_while_it_works():
    with CpuTrace(CpuClock(os.getpid())) as trace:  # this process stands in for the app
        started = time.time()
        while time.time() - started < 0.5:
            pass
    assert len(trace.samples) >= 3
    assert [s[1] for s in trace.samples] == sorted(s[1] for s in trace.samples)
    app, _ = trace.cores_between(trace.samples[0][0], trace.samples[-1][0])
    assert app > 0.2  # busy all along (a loaded machine still gives it a good share of a core)


def test_the_page_is_set_beside_the_mean_of_the_api_replies_before_and_after_it():
    from bench.page import CASES, _round_row

    def reply(seconds, text="Once upon a time"):
        return {"tokens": 101, "prompt_tokens": 46, "seconds": seconds, "text": text, "app_cores": 2.0}

    # the machine slowed down during the round: 50 tokens/s before the page, 25 after
    row = _round_row(1, CASES["short"], (reply(2.0), reply(4.0)), {**reply(3.0), "browser_cores": 0.1},
                     count_tokens=len)
    assert row["api_tokens_per_s_before_after"] == [50.0, 25.0]
    assert row["api_tokens_per_s"] == 37.5 and round(row["ratio"], 6) == round((100 / 3) / 37.5, 6)
    assert row["same_reply"] and row["page_tokens"] == 101
