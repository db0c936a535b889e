"""InfiniGen's partial keys as int8 codes with a power-of-two scale per slot: what the CPU kernels' cache holds.

    codes = encode(partial)       # partial [..., r] float -> [..., r + 1] int8: r codes, then the exponent e
    partial = decode(codes)       # codes * 2^e as float32 [..., r]
    rehearsed = logits(query, cache)  # a query's logits against the cache: what the CPU kernel computes, to the bit

A selection reads every past slot's partial key at every step; at 32k slots that read is most of its time, and
int8 halves the bytes of float16. Each slot (one KV head's r channels) gets its own scale 2^e, the smallest power of
two that puts the slot's largest channel within 127 codes, so a slot's strong channels (what the skew concentrates
the logits in) keep 7 bits. The exponent is stored as the slot's last "channel" (a row of the channel-major cache
[kv_heads, r + 1, slots]), so the cache stays one tensor that every reader already passes around.

A selection scores these codes against the query rounded to 16-bit codes, each query head with its own power of
two (`query_codes`): a logit is the exact integer sum of code products, converted to float32 once and scaled by
the two powers. Each query channel lies within 1/32,768 of its head's largest (each key channel within 1/128 of
its slot's largest), so a logit moves by at most r * 127 * 2^-16 of the head's largest channel times the slot's
step; in exchange the sums do not depend on the order of the additions, so the kernel (infinigen_cpu.cpp, `code_query`) adds two channels at a time with
AVX-512's 16-bit multiply-adds and `logits` below still gives its logits to the bit.

Why powers of two: a code times 2^e (e >= -24, |code| <= 127) is exactly a float16, so `decode` gives the values a
saved session stores (float16) with no rounding, and `encode` of those values gives back the same codes and
exponent: a restore that carries partial keys reproduces the live cache to the bit. The C++ kernels
(decode_lane.cpp, `encode_slot`) do the same arithmetic in the same steps.
"""

from __future__ import annotations

import torch

CODE_LIMIT = 127
MIN_EXPONENT = -24  # float16's smallest step: below it decode(codes) would not be exact in float16
# the largest magnitude kept: 127 * 2^9; anything larger is clamped to it (a float16 partial key goes to 65,504)
MAX_MAGNITUDE = float(CODE_LIMIT * 2**9)
TINY = 2.0**-30  # any magnitude below 2^-18 gets the smallest exponent; frexp of 0 would not


def exponents(magnitude: torch.Tensor) -> torch.Tensor:
    """The per-slot exponent e (int32) for the largest |value| of each slot: the smallest e >= -24 with
    magnitude / 2^e <= 127 after rounding. With magnitude = m * 2^E (m in [0.5, 1)): m * 128 <= 127 needs
    e = E - 7, else (m > 127/128) e = E - 6, where the largest code is 64. A slot of zeros gets -24, as any slot
    too small for a code of its own does (so that encoding a decoded slot gives its exponent back)."""
    mantissa, exponent = torch.frexp(magnitude.clamp(min=TINY))
    chosen = torch.where(mantissa <= CODE_LIMIT / 128, exponent - 7, exponent - 6)
    return chosen.clamp_(min=MIN_EXPONENT)


def encode(partial: torch.Tensor) -> torch.Tensor:
    """Partial keys [..., r] (any float dtype) -> [..., r + 1] int8: each slot's codes, then its exponent."""
    values = partial.float().clamp(-MAX_MAGNITUDE, MAX_MAGNITUDE)
    exponent = exponents(values.abs().amax(dim=-1, keepdim=True))
    codes = torch.ldexp(values, -exponent).round_().clamp_(-CODE_LIMIT, CODE_LIMIT)
    return torch.cat([codes, exponent.float()], dim=-1).to(torch.int8)


def decode(codes: torch.Tensor, channel_dim: int = -1) -> torch.Tensor:
    """int8 codes with their exponent last along `channel_dim` ([..., r + 1] or, channel-major, [kv, r + 1, slots]
    with channel_dim=-2) -> float32 values with r channels there."""
    values, exponent = codes.float().split([codes.shape[channel_dim] - 1, 1], dim=channel_dim)
    return torch.ldexp(values, exponent)


QUERY_CODE_LIMIT = 32767
QUERY_EXPONENT_LIMIT = 100  # the query's powers of two stay far inside float32's normal range


def query_codes(query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A query [..., r] (float32) -> its codes (integers as float32 [..., r], |code| <= 32767) and each row's power
    of two [..., 1]: the smallest one that keeps the row's largest channel's code within 32,767 after rounding."""
    peak = query.abs().amax(dim=-1, keepdim=True)
    mantissa, top = torch.frexp(peak)  # peak = mantissa * 2^top, mantissa in [0.5, 1)
    exponent = top - 15 + ((mantissa * 32768).round() > QUERY_CODE_LIMIT).int()
    exponent = exponent.clamp(-QUERY_EXPONENT_LIMIT, QUERY_EXPONENT_LIMIT)
    codes = torch.ldexp(query, -exponent).round_().clamp_(-QUERY_CODE_LIMIT, QUERY_CODE_LIMIT)
    return codes, torch.ldexp(torch.ones_like(peak), exponent)


def logits(query: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rehearsed logits [kv, group, slots] (float32) of a query [kv, group, r] against a channel-major code cache
    [kv, r + 1, slots]: exact integer sums of the query's and the keys' codes (in float64, which holds them
    exactly), rounded to float32 once, times the query head's power of two, then the slot's."""
    q_codes, q_powers = query_codes(query.float())
    sums = torch.bmm(q_codes.double(), cache[:, :-1].double()).float()
    slot_powers = torch.ldexp(torch.ones(1), cache[:, -1:].float())
    return sums * q_powers * slot_powers
