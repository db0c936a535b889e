"""InfiniGen's int8 partial keys (policies/partial_codes.py): codes with a power-of-two scale per slot, made alike in
Python and in the kernels' C++, exact in float16, and restored to the bit."""

from __future__ import annotations

import pytest
import torch

from infinigen_core.policies import partial_codes

from conftest import make_tiny_engine, random_tokens


def _slots_of_every_scale(seed: int = 0) -> torch.Tensor:
    """[2, 600, 24] partial keys: slots from 1e-9 to 1e6 in magnitude, one of zeros, one at float16's largest."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(2, 600, 24, generator=generator) * torch.logspace(-9, 6, 600)[None, :, None]
    values[0, 0] = 0.0
    values[1, 1] = 65504.0
    return values


def test_codes_stand_for_their_slot_within_half_a_step_and_use_seven_bits():
    values = _slots_of_every_scale()
    codes = partial_codes.encode(values)
    assert codes.dtype == torch.int8 and codes.shape == (2, 600, 25)
    exponent = codes[..., -1].long()
    assert int(exponent.min()) == partial_codes.MIN_EXPONENT and int(exponent.max()) == 9
    clamped = values.clamp(-partial_codes.MAX_MAGNITUDE, partial_codes.MAX_MAGNITUDE)
    error = (partial_codes.decode(codes) - clamped).abs()
    half_step = torch.ldexp(torch.full(exponent.shape, 0.5), exponent).unsqueeze(-1)
    assert (error <= half_step).all()  # rounded to the nearest code
    # the smallest exponent that fits: a slot's largest code is 64-127 unless the slot is below 2^-18
    largest = codes[..., :-1].abs().amax(dim=-1).long()
    coded = clamped.abs().amax(dim=-1) >= 2.0**-18
    assert ((largest >= 64) & (largest <= 127))[coded].all() and not coded.all()


def test_decoded_codes_are_float16_values_that_encode_to_the_same_codes():
    codes = partial_codes.encode(_slots_of_every_scale(1))
    decoded = partial_codes.decode(codes)
    assert torch.equal(decoded.half().float(), decoded) and decoded.half().isfinite().all()
    assert torch.equal(partial_codes.encode(decoded.half()), codes)
    channel_major = codes.transpose(1, 2)
    assert torch.equal(partial_codes.decode(channel_major, channel_dim=1), decoded.transpose(1, 2))


def test_a_query_is_coded_in_16_bits_per_head_and_its_logits_are_exact_sums():
    generator = torch.Generator().manual_seed(5)
    query = torch.randn(2, 4, 33, generator=generator) * torch.tensor([1e-30, 1e-3, 1.0, 1e4]).view(1, 4, 1)
    query[1, 0] = 0.0  # a head of zeros
    query[1, 1, 0] = (1 - 2.0**-17) * 2.0**3  # a peak whose code rounds up to 32,768: one power of two more
    codes, powers = partial_codes.query_codes(query)
    assert torch.equal(codes, codes.round()) and int(codes.abs().max()) <= partial_codes.QUERY_CODE_LIMIT
    assert torch.equal(powers, torch.ldexp(torch.ones(1), torch.frexp(powers).exponent - 1))  # powers of two
    peak_codes = codes.abs().amax(dim=-1)
    assert (peak_codes[:, 1:][query[:, 1:].abs().amax(dim=-1) > 0] >= 16384).all() and int(peak_codes[1, 0]) == 0
    # a head below 2^-85 keeps the smallest power, 2^-100: fewer bits for it, never a power float32 cannot hold
    assert float(powers[0, 0]) == 2.0**-partial_codes.QUERY_EXPONENT_LIMIT and int(peak_codes[0, 0]) < 16384
    assert int(peak_codes[1, 1]) == 16384 and float(powers[1, 1]) == 2.0**-11
    assert ((codes * powers - query).abs() <= powers / 2).all()  # each channel within half a step
    keys = partial_codes.encode(torch.randn(2, 500, 33, generator=generator) * 3).transpose(1, 2)
    logits = partial_codes.logits(query, keys)
    values = partial_codes.decode(keys, channel_dim=1)
    # the integer sums, exact in float64, rounded to float32 once, then times the two powers of two
    exact = (codes.double() @ keys[:, :-1].double()).float() * powers * torch.ldexp(torch.ones(1), keys[:, -1:].float())
    assert torch.equal(logits, exact)
    # within the query's rounding of the float logits: half a step of each channel against the slot's values
    bound = powers / 2 * values.abs().sum(dim=1, keepdim=True) + 1e-5 * (query.abs() @ values.abs())
    assert ((logits - query @ values).abs() <= bound).all()


def test_the_kernels_encode_a_partial_key_as_python_does(kernels):
    """`write_step_partial_keys` through identity projections: the C++ codes of the keys themselves, to the bit."""
    values = _slots_of_every_scale(2)[:, :40]  # [2 layers, 40 "heads", 24]: one key per head, every scale
    layers, heads, r = values.shape
    keys = values.unsqueeze(2).contiguous()  # [layers, heads, 1, dim = r]
    identity = torch.eye(r).expand(layers * heads, r, r).contiguous()
    cache = torch.zeros(layers, heads, r + 1, 8, dtype=torch.int8)
    torch.ops.infinigen_cpu.write_step_partial_keys(keys, identity, cache, 5)
    assert torch.equal(cache[..., 5], partial_codes.encode(values))


def test_the_kernels_encode_a_batch_of_partial_keys_into_the_cache_as_python_does(kernels):
    """`encode_partial_keys` (a prefill's or a restore's batch): each row's codes written at its slot, the cache's
    other slots untouched, to the bit what partial_codes.encode and an index copy leave."""
    values = _slots_of_every_scale(3)  # [2 heads, 600 rows, 24]
    generator = torch.Generator().manual_seed(7)
    for r in (24, 7):  # an odd count too
        partial = values[..., :r].contiguous()
        slots = torch.randperm(900, generator=generator)[:600]  # scattered, out of order
        cache = torch.randint(-127, 128, (2, r + 1, 900), generator=generator, dtype=torch.int8)
        expected = cache.clone().index_copy_(2, slots, partial_codes.encode(partial).transpose(1, 2))
        torch.ops.infinigen_cpu.encode_partial_keys(partial, cache, slots)
        assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.infinigen_cpu.encode_partial_keys(partial, cache, torch.full((600,), 900))
    with pytest.raises(RuntimeError, match="an int8 cache"):
        torch.ops.infinigen_cpu.encode_partial_keys(partial, cache[:, 1:], slots)


@pytest.mark.one_device  # the int8 cache is the CPU kernels', where pool and compute share the CPU
@pytest.mark.parametrize("settings", [{}, {"budget": 0.3, "budget_by_layer": False}])
def test_int8_partial_keys_exported_and_imported_are_the_live_ones(tiny_llama, kernels, settings):
    live = make_tiny_engine(tiny_llama, kernels, policy="infinigen", **settings)
    live.prefill(random_tokens(180, seed=4))
    for token in random_tokens(6, seed=5):
        live.decode(token)
    assert live.policy.coded
    rows = live.export_rows(0, live.num_tokens, partial_keys=True)
    layer = live.policy.sparse_layers[0]
    assert rows[f"pk.{layer}"].dtype == torch.float16
    restored = make_tiny_engine(tiny_llama, kernels, policy="infinigen", **settings)
    restored.import_rows([rows])
    size = live.num_tokens
    assert torch.equal(restored.policy._partial_all[..., :size], live.policy._partial_all[..., :size])
    follow = random_tokens(3, seed=6)
    assert all(torch.equal(restored.decode(token), live.decode(token)) for token in follow)
