"""A session that shrinks gives its memory back (issue 34): after a long prefill, a reset or a truncate to a
few tokens leaves the pool and the policy's per-slot state sized for what is left, and decoding goes on as
in a fresh engine. Run under the separate-devices mode (the pool in emulated host memory, the policy's
state on the emulated compute device), where a mixed or stale storage would be refused."""

import pytest
import torch

from conftest import make_tiny_engine, random_tokens

PROMPT = random_tokens(300, seed=11)
KEPT = 40
GROWTH = 32  # the engine's pool grows in 1024-token steps; a tiny model's window is 1024, so smaller here


def long_session(model, policy):
    engine = make_tiny_engine(model, policy=policy, budget=0.3, prefill_chunk=40)
    engine.pool.growth_tokens = GROWTH
    engine.prefill(PROMPT)
    return engine


def held_bytes(engine) -> int:
    """What the pool's and the policy's tensors really hold (storage sizes, not the accounting's word)."""
    pool = engine.pool
    tensors = [pool._positions, pool._fetch_counts, *(t for store in pool._layers for t in (store.keys, store.values))]
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values()) + engine.policy.device_bytes()


def decode_after(engine, prompt):
    """Logits of the prompt's prefill (if any) and four decode steps after it."""
    steps = random_tokens(4, seed=12)
    first = [engine.prefill(prompt)] if prompt else []
    return torch.stack([*first, *engine.score(steps)])


@pytest.mark.parametrize("policy", ["infinigen", "h2o"])  # the policies with per-slot state
def test_a_truncate_to_a_few_tokens_gives_memory_back_and_decodes_as_a_fresh_engine(tiny_llama, separate_devices,
                                                                                       policy):
    with long_session(tiny_llama, policy) as engine, \
            make_tiny_engine(tiny_llama, policy=policy, budget=0.3, prefill_chunk=40) as fresh:
        capacity, held, device_bytes = engine.pool.capacity, held_bytes(engine), engine.policy.device_bytes()
        assert capacity >= len(PROMPT)
        engine.truncate(KEPT)
        assert engine.pool.capacity == 3 * GROWTH  # twice the 40 tokens kept (80), rounded up to the growth step
        assert held_bytes(engine) * 3 < held
        if policy == "infinigen":  # the partial key cache shrank with the pool
            assert engine.policy.device_bytes() * 3 < device_bytes
        fresh.prefill(PROMPT[:KEPT])
        logits, reference = decode_after(engine, []), decode_after(fresh, [])
        assert engine.history[-1].layers[-1].sparse  # the sparse path ran after the shrink
        torch.testing.assert_close(logits, reference, rtol=0, atol=1e-5)


def test_a_reset_gives_memory_back_and_the_next_conversation_matches_a_fresh_one(tiny_llama, separate_devices):
    with long_session(tiny_llama, "infinigen") as engine, make_tiny_engine(tiny_llama, budget=0.3, prefill_chunk=40) as fresh:
        held = held_bytes(engine)
        engine.reset()
        assert engine.pool.capacity == GROWTH and engine.num_tokens == 0
        assert held_bytes(engine) * 8 < held
        prompt = random_tokens(KEPT, seed=13)
        torch.testing.assert_close(decode_after(engine, prompt), decode_after(fresh, prompt), rtol=0, atol=1e-5)


def test_an_edit_near_the_end_keeps_the_storage(tiny_llama, separate_devices):
    """Hysteresis: regenerating the last turn of a long session must not reallocate the pool."""
    with long_session(tiny_llama, "infinigen") as engine:
        keys, partial = engine.pool._storage.layers[0].keys, engine.policy._partial_all
        engine.sync_to(PROMPT[:250] + random_tokens(30, seed=14))
        assert engine.pool._storage.layers[0].keys is keys and engine.policy._partial_all is partial
