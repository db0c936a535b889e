"""Integration: the real default model (SmolLM2-135M-Instruct) through the engine on the CPU."""

import threading

import pytest

from infinigen_core.calibration import calibration_text
from infinigen_core.config import EngineConfig, SamplingConfig
from infinigen_core.engine import ContextOverflowError
from infinigen_core.generation import chat_token_ids, generate


def reply(engine, question, **sampling):
    ids = chat_token_ids(engine.tokenizer, [{"role": "user", "content": question}])
    events = list(generate(engine, ids, SamplingConfig(**{"max_new_tokens": 24, **sampling})))
    return events


def test_answers_a_simple_question(real_engine):
    events = reply(real_engine, "What is the capital of France?")
    assert "Paris" in events[-1].full_text
    assert events[-1].finish_reason in ("eos", "length")
    assert "".join(e.text for e in events) == events[-1].full_text  # the deltas add up to the text


def test_the_next_turn_reuses_the_cache(real_engine):
    first = reply(real_engine, "Name a primary colour.")
    cached = real_engine.num_tokens
    history = [{"role": "user", "content": "Name a primary colour."},
               {"role": "assistant", "content": first[-1].full_text},
               {"role": "user", "content": "And another one?"}]
    ids = chat_token_ids(real_engine.tokenizer, history)
    steps_before = real_engine.steps_run
    list(generate(real_engine, ids, SamplingConfig(max_new_tokens=4)))
    prefill = [s for s in real_engine.history if s.step >= steps_before and not s.is_decode]
    assert sum(s.new_tokens for s in prefill) < len(ids) - cached + 8  # only the new turn was prefilled


def test_stop_strings_and_cancellation(real_engine):
    events = reply(real_engine, "Count from one to ten, separated by commas.", stop_strings=("5",))
    assert events[-1].finish_reason == "stop" and "5" not in events[-1].full_text
    assert events[-1].full_text.strip()  # the text before the stop string is kept
    real_engine.reset()
    # a stop string that spans tokens: no event hands out its first half, so the deltas add up to the text
    events = reply(real_engine, "Count from one to ten in words.", stop_strings=("4.",), max_new_tokens=40)
    assert events[-1].finish_reason == "stop" and "4" not in "".join(e.text for e in events)
    assert "".join(e.text for e in events) == events[-1].full_text and "3" in events[-1].full_text
    real_engine.reset()
    cancel = threading.Event()
    ids = chat_token_ids(real_engine.tokenizer, [{"role": "user", "content": "Tell me a story."}])
    produced = []
    for event in generate(real_engine, ids, SamplingConfig(max_new_tokens=50), cancel=cancel):
        produced.append(event)
        if len(produced) == 3:
            cancel.set()
    assert produced[-1].finish_reason == "cancelled" and len(produced) == 4
    assert real_engine.num_tokens == len(ids) + 3  # what was generated is kept in the cache


def test_text_that_may_begin_a_stop_string_is_held_back():
    from infinigen_core.generation import _stop_prefix_length

    assert _stop_prefix_length("one, two\nTh", ("\nThree", "END")) == 3
    assert _stop_prefix_length("we are at the EN", ("\nThree", "END")) == 2
    assert _stop_prefix_length("nothing here", ("END",)) == 0 and _stop_prefix_length("x", ()) == 0


def test_sampling_is_reproducible_with_a_seed(real_engine):
    first = reply(real_engine, "Write a word.", temperature=1.0, top_p=0.9, top_k=50, seed=7)[-1].full_text
    real_engine.reset()
    second = reply(real_engine, "Write a word.", temperature=1.0, top_p=0.9, top_k=50, seed=7)[-1].full_text
    assert first == second


def test_a_2k_context_decode_with_infinigen(real_engine):
    ids = real_engine.tokenizer(calibration_text())["input_ids"][:2048]
    real_engine.prefill(ids)
    real_engine.score(ids[:16])
    decode = [s for s in real_engine.history if s.is_decode]
    assert len(decode) == 16
    for step in decode:
        sparse = step.sparse_layers()
        assert len(sparse) == 28  # 30 layers, the first 2 dense
        assert 0 < step.fetched_ratio() <= 0.2 + 1e-9
        assert all(layer.selected_positions.shape[0] == 3 for layer in sparse)  # per KV head
        assert step.pool_bytes >= real_engine.pool.bytes_used()


def test_a_prompt_longer_than_the_window_is_refused_and_nothing_changes(real_engine):
    real_engine.prefill([1, 2, 3])
    with pytest.raises(ContextOverflowError, match="context window of 8192"):
        real_engine.prefill([5] * 8192)
    assert real_engine.num_tokens == 3 and real_engine.pool.total_tokens == 3
    real_engine.decode(4)  # still usable


def test_settings_change_keeps_the_conversation(real_engine):
    ids = real_engine.tokenizer(calibration_text())["input_ids"][:100]
    real_engine.prefill(ids)
    real_engine.configure(EngineConfig(policy="h2o", budget=0.5, min_fetch_tokens=0))
    assert real_engine.num_tokens == 100 and real_engine.pool.size(5) == 100
    real_engine.decode(ids[0])
    assert real_engine.history[-1].sparse_layers()
