"""The model's thread: one long-lived thread runs every job; a paced job runs on without waiting for its consumer,
which takes what arrived since it last looked."""

from __future__ import annotations

import threading
import time

import pytest

from chat_service.engine_thread import EngineThread, model_thread

WAIT_S = 10.0  # generous: a wrong implementation deadlocks, and these waits turn that into a failure


@pytest.fixture
def thread():
    engine_thread = EngineThread("test-model")
    yield engine_thread
    engine_thread.close()


def test_every_call_runs_in_the_same_long_lived_thread_and_returns_or_raises(thread):
    names = {thread.call(lambda: threading.current_thread().name) for _ in range(5)}
    assert names == {"test-model"}
    assert thread.call(lambda a, b: a * b, 6, 7) == 42
    with pytest.raises(KeyError, match="missing"):
        thread.call(lambda: {}["missing"])
    assert thread.call(lambda: thread.call(lambda: "inline")) == "inline"  # a job calling in runs inline
    assert model_thread() is model_thread()  # one per process


def test_paced_yields_every_item_in_order_and_the_first_at_once(thread):
    first_seen = threading.Event()

    def items():
        yield 0
        assert first_seen.wait(WAIT_S), "the consumer never got the first item while the job ran"
        yield from range(1, 50)

    batches = []
    for batch in thread.paced(items(), interval_s=0.05, stop=lambda: None):
        batches.append(batch)
        first_seen.set()
    assert [item for batch in batches for item in batch] == list(range(50))
    assert batches[0] == [0]


def test_the_job_never_waits_for_its_consumer_and_late_items_are_gathered(thread):
    all_made = threading.Event()

    def items():
        yield from range(100)
        all_made.set()

    updates = thread.paced(items(), interval_s=0.01, stop=lambda: None)
    first = next(updates)
    # the consumer looks away (a page post-processing and sending the first update): the job goes on
    assert all_made.wait(WAIT_S), "the job waited for its consumer"
    rest = [item for batch in updates for item in batch]
    assert first + rest == list(range(100))


def test_updates_come_at_most_once_per_interval(thread):
    def items():
        for item in range(40):
            time.sleep(0.005)
            yield item

    started = time.monotonic()
    batches = list(thread.paced(items(), interval_s=0.1, stop=lambda: None))
    elapsed = time.monotonic() - started
    assert [item for batch in batches for item in batch] == list(range(40))
    assert len(batches) <= elapsed / 0.1 + 2  # the first at once, the last when the job ends, 0.1 s between
    assert len(batches) < 40


def test_an_error_of_the_job_comes_after_the_items_before_it(thread):
    def items():
        yield from (1, 2, 3)
        raise ValueError("the turn failed")

    received = []
    with pytest.raises(ValueError, match="the turn failed"):
        for batch in thread.paced(items(), interval_s=0, stop=lambda: None):
            received += batch
    assert received == [1, 2, 3]
    assert thread.call(lambda: "still serving") == "still serving"


def test_closing_early_stops_the_job_and_waits_for_it(thread):
    stop, finished = threading.Event(), threading.Event()

    def items():
        try:
            while not stop.is_set():  # like a turn: it ends at the next token once its cancel flag is set
                time.sleep(0.01)
                yield "token"
        finally:
            finished.set()

    updates = thread.paced(items(), interval_s=0.05, stop=stop.set)
    assert next(updates) == ["token"]
    updates.close()  # the page went away
    assert stop.is_set() and finished.is_set()  # stopped, and over by the time close returned
    assert thread.call(lambda: "free") == "free"


def test_a_paced_job_started_inside_the_thread_runs_inline(thread):
    def job():
        return [batch for batch in thread.paced(iter("abc"), interval_s=1.0, stop=lambda: None)]

    assert thread.call(job) == [["a"], ["b"], ["c"]]


def test_an_urgent_item_comes_at_once_not_after_the_work_that_follows_it(thread):
    consumer_has_first, consumer_has_it = threading.Event(), threading.Event()

    def items():
        yield "first"
        assert consumer_has_first.wait(WAIT_S)  # then its interval runs: the rest would wait for it
        yield "token"
        time.sleep(0.2)  # the consumer, woken by "token", now gathers until its interval ends: only "end" may wake it
        yield "end"  # a turn's last event
        # the turn's save: the consumer, whose interval is far from over, must already have the end
        assert consumer_has_it.wait(WAIT_S), "the urgent item waited for the job to end"

    received = []
    for batch in thread.paced(items(), interval_s=60.0, stop=lambda: None, urgent=lambda item: item == "end"):
        received += batch
        consumer_has_first.set()
        if "end" in batch:
            consumer_has_it.set()
    assert received == ["first", "token", "end"]
