"""Generation on a tiny model: cancelling a long prompt stops its prefill between chunks."""

import threading

from infinigen_core.config import SamplingConfig
from infinigen_core.generation import generate

from conftest import make_tiny_engine, random_tokens


def test_cancel_stops_a_long_prefill_at_the_next_chunk_and_keeps_what_was_read(tiny_llama):
    engine = make_tiny_engine(tiny_llama, prefill_chunk=32)
    prompt = random_tokens(200, seed=4)
    cancel, seen = threading.Event(), []

    def progress(done, total):
        seen.append(done)
        cancel.set()  # the client goes away while the first chunk is read

    events = list(generate(engine, prompt, SamplingConfig(max_new_tokens=5), cancel, progress))
    assert [e.finish_reason for e in events] == ["cancelled"] and events[0].full_text == ""
    assert seen == [32] and engine.token_ids == prompt[:32]  # one chunk read, and it stays cached

    cancel.clear()
    steps_before = engine.steps_run
    events = list(generate(engine, prompt, SamplingConfig(max_new_tokens=3), cancel))
    assert events[-1].finish_reason == "length" and engine.token_ids[:200] == prompt
    prefilled = sum(s.new_tokens for s in engine.history if s.step >= steps_before and not s.is_decode)
    assert prefilled == 200 - 32  # the next try reads only the rest


def test_cancel_set_before_the_last_chunk_is_read_still_returns_no_reply(tiny_llama):
    engine = make_tiny_engine(tiny_llama, prefill_chunk=64)
    cancel = threading.Event()
    cancel.set()
    events = list(generate(engine, random_tokens(100, seed=5), SamplingConfig(max_new_tokens=5), cancel))
    assert events[-1].finish_reason == "cancelled" and events[-1].token_id is None
    assert engine.num_tokens == 64
