"""InfiniGen's CPU kernels (cpu_kernels.py) against the eager ops they replace, and the engine with them."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
import torch.nn.functional as F
from test_speculation import _chooser

from infinigen_core import cpu_kernels
from infinigen_core.config import EngineConfig
from infinigen_core.cpu_kernels import pack_q4
from infinigen_core.engine import InfiniGenEngine
from infinigen_core.policies import partial_codes

from conftest import greedy_logits, hold_int8_partial_codes, make_tiny_engine, random_tokens


def _eager_selection(partial_query, partial_keys, past, k, alpha, width=None):
    """What the eager ops choose from the same query and cache (int8 codes: scored as partial_codes.logits does)."""
    chooser = _chooser(alpha=alpha, budget=1.0)
    chooser.ctx.adapter.num_heads = partial_query.shape[0] * partial_query.shape[1]
    keys = partial_keys[:, :, :past]
    logits = partial_codes.logits(partial_query, keys) if keys.dtype == torch.int8 else torch.bmm(partial_query, keys.float())
    return chooser.choose(logits, k, width=width)


def _same_rows_per_head(slots, valid, eager) -> bool:
    """Whether each head of a kernel's selection reads the rows the eager one reads (the slots its mask keeps)."""
    def read(selection_slots, mask, head):
        row = mask[head if mask.shape[0] > 1 else 0, 1:]
        return set(selection_slots[head, row].tolist())
    return all(read(slots, valid, head) == read(eager.slots, eager.valid, head) for head in range(slots.shape[0]))


@pytest.mark.parametrize("alpha", [3.0, 1e6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("past, spreads, capped", [
    (650, (3.0, 1.0, 0.05), False),  # too short a past for the sample: each head's best 2k first, then the shares
    (3000, (3.0, 1.0, 0.05), True),  # head 1 would take more than 2k: the same exact way
    (3000, (1.0, 0.8, 0.5), False),  # the shares from one sample of every head
])
def test_heads_sharing_a_budget_read_the_rows_the_eager_ops_read(kernels, alpha, dtype, past, spreads, capped):
    """The heads' shared budget (EngineConfig.budget_by_head): each head's best 2k, of all of them the kv x k
    largest weights. The heads' queries differ in scale, so their weights spread differently: they read different
    counts, together kv x k (one of them at the 2k cap where `capped`), each head's rows first in its slots and its
    mask its own. Whichever way the kernel finds them, the eager ops read the same rows."""
    torch.manual_seed(1)
    kv, group, r, k = 3, 4, 16, 60
    partial_query = torch.randn(kv, group, r) * torch.tensor(spreads).view(kv, 1, 1)  # peaked .. flat
    partial_keys, _ = _as_stored(torch.randn(kv, r, past + 50), dtype)
    slots, scores, valid, alpha_total = kernels.rehearse_select(partial_query, partial_keys, past, k, alpha, 2 * k)
    eager = _eager_selection(partial_query, partial_keys, past, k, alpha, width=2 * k)
    assert slots.shape == (kv, 2 * k) and valid.shape == eager.valid.shape == (kv, 2 * k + 1)
    assert int(alpha_total) == int(eager.alpha_total) and torch.equal(valid, eager.valid)
    assert _same_rows_per_head(slots, valid, eager)
    counts = valid[:, 1:].sum(dim=1).tolist()
    if alpha > 1e3:  # nothing cut by alpha: the counts are the heads' shares of the budget
        assert sum(counts) == kv * k and len(set(counts)) == kv
        assert (max(counts) == 2 * k) == capped
    for head in range(kv):  # the rows read come first, whatever the order after them
        assert valid[head, 1:].tolist() == sorted(valid[head, 1:].tolist(), reverse=True)
    assert int(slots.max()) < past and int(slots.min()) >= 0


@pytest.mark.parametrize("past", [650, 3000])  # each head's best 2k first / the shares from one sample
def test_heads_holding_the_same_weights_share_the_budget_exactly(kernels, past):
    """Two KV heads with the same query and keys hold the same (weight, slot) values: at the cut, the lower head
    reads the value first, so the heads still read kv x k rows in all, as the exact way and the sample agree."""
    torch.manual_seed(3)
    kv, group, r, k = 3, 4, 16, 60
    partial_query = torch.randn(kv, group, r) * torch.tensor([0.6, 0.6, 0.3]).view(kv, 1, 1)
    partial_query[1] = partial_query[0]
    keys = torch.randn(kv, r, past + 50)
    keys[1] = keys[0]
    slots, _, valid, _ = kernels.rehearse_select(partial_query, keys, past, k, 1e6, 2 * k)
    counts = valid[:, 1:].sum(dim=1).tolist()
    assert sum(counts) == kv * k and abs(counts[0] - counts[1]) <= 1  # the twins split the cut's value, lower first
    assert counts[0] >= counts[1]
    read = [set(slots[head, :count].tolist()) for head, count in enumerate(counts)]
    assert read[1] <= read[0]  # the same weights: the higher twin reads the lower one's rows, less at most one


def test_attend_rows_masks_each_head_by_its_own_row(kernels):
    """A mask per KV head [kv, rows]: each head attends over its own kept rows, as SDPA with that mask does."""
    torch.manual_seed(2)
    kv, group, dim, slots_held = 3, 4, 64, 500
    query = torch.randn(kv, group, dim)
    keys, values = torch.randn(kv, slots_held, dim), torch.randn(kv, slots_held, dim)
    rows = torch.stack([torch.randperm(slots_held)[:300] for _ in range(kv)])
    valid = torch.zeros(kv, 300, dtype=torch.bool)
    for head, count in enumerate((5, 300, 260)):  # a chunk of 256 rows, two of them, and a part of the second
        valid[head, :count] = True
    out = kernels.attend_rows(query, keys, values, rows, valid, 0.125)
    gathered_k = keys.gather(1, rows.unsqueeze(-1).expand(-1, -1, dim)).unsqueeze(1)
    gathered_v = values.gather(1, rows.unsqueeze(-1).expand(-1, -1, dim)).unsqueeze(1)
    expected = F.scaled_dot_product_attention(query.unsqueeze(1), gathered_k, gathered_v,
                                              attn_mask=valid.view(kv, 1, 1, -1), scale=0.125).squeeze(1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    alike = kernels.attend_rows(query, keys, values, rows, valid[1:2], 0.125)  # [1, rows]: every head the same
    torch.testing.assert_close(alike, kernels.attend_rows(query, keys, values, rows, None, 0.125))


@pytest.mark.parametrize("alpha", [3.0, 1e6])  # the alpha mask cuts inside the k rows / keeps all of them
def test_rehearse_select_keeps_what_the_eager_ops_keep(kernels, alpha):
    torch.manual_seed(0)
    partial_query, partial_keys = torch.randn(3, 4, 16), torch.randn(3, 16, 700)  # 700 slots, 650 in the past
    past, k = 650, 97
    slots, scores, valid, alpha_total = kernels.rehearse_select(partial_query, partial_keys, past, k, alpha)
    eager = _eager_selection(partial_query, partial_keys, past, k, alpha)
    assert int(alpha_total) == int(eager.alpha_total)
    assert torch.equal(valid, eager.valid)
    kept = int(valid[0, 1:].sum())
    assert (kept < k) == (alpha == 3.0)
    for head in range(3):
        assert set(slots[head].tolist()) == set(eager.slots[head].tolist())  # the same k slots...
        assert set(slots[head, :kept].tolist()) == set(eager.slots[head, :kept].tolist())  # ...the kept ones first
        by_slot = dict(zip(eager.slots[head].tolist(), eager.scores[head].tolist()))
        assert scores[head].tolist() == pytest.approx([by_slot[s] for s in slots[head].tolist()], rel=1e-5, abs=1e-7)
    assert int(slots.max()) < past  # the new token's slot and the unwritten ones are never chosen


def _as_stored(values: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Channel-major partial keys [kv, r, slots] in a cache's dtype (int8: codes and exponent row, [kv, r + 1,
    slots]), and the float32 values they stand for."""
    if dtype == torch.int8:
        codes = partial_codes.encode(values.transpose(1, 2)).transpose(1, 2).contiguous()
        return codes, partial_codes.decode(codes, channel_dim=1)
    stored = values.to(dtype)
    return stored, stored.float()


@pytest.mark.parametrize("group", [1, 4, 5, 8, 9])  # 1-8: sums held in registers per 32 or 64 slots; 9: the row loop
@pytest.mark.parametrize("dtype, channels", [(torch.float32, 40), (torch.float16, 40), (torch.int8, 40),
                                             (torch.int8, 33)])  # int8 in channel pairs: an odd one meets the exponents
def test_every_query_group_size_selects_what_the_eager_ops_select(kernels, group, dtype, channels):
    torch.manual_seed(group)
    partial_query = torch.randn(2, group, channels)
    partial_keys, _ = _as_stored(torch.randn(2, channels, 620), dtype)
    for past, k in ((600, 90), (300, 30), (45, 9)):  # blocks of 256 slots: tails of 88, 44 and 45 slots
        slots, scores, valid, alpha_total = kernels.rehearse_select(partial_query, partial_keys, past, k, 4.0)
        eager = _eager_selection(partial_query, partial_keys, past, k, 4.0)
        assert int(alpha_total) == int(eager.alpha_total) and torch.equal(valid, eager.valid)
        for head in range(2):
            assert set(slots[head].tolist()) == set(eager.slots[head].tolist())
            by_slot = dict(zip(eager.slots[head].tolist(), eager.scores[head].tolist()))
            assert scores[head].tolist() == pytest.approx([by_slot[s] for s in slots[head].tolist()], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("spiked", [False, True])
def test_a_long_past_selects_the_eager_top_k_whichever_way_it_is_partitioned(kernels, spiked):
    """Past 64 x 16 slots the kernel partitions only the values above a floor taken from a sample of every 16th
    slot; where the sample misleads it (every 16th slot spiked: fewer than k lie above its floor) it partitions
    them all. Either way the k slots are the eager top-k, the kept ones first."""
    torch.manual_seed(3)
    partial_query, partial_keys = torch.randn(2, 3, 16), torch.randn(2, 16, 5200)
    past, k = 5000, 750
    if spiked:
        partial_keys[:, :, 0:past:16] = partial_query.sum(1).unsqueeze(-1) * 3  # the sampled slots score highest
    slots, _, valid, _ = kernels.rehearse_select(partial_query, partial_keys, past, k, 2.0)
    eager = _eager_selection(partial_query, partial_keys, past, k, 2.0)
    kept = int(valid[0, 1:].sum())
    assert torch.equal(valid, eager.valid) and 0 < kept < k
    for head in range(2):
        assert set(slots[head].tolist()) == set(eager.slots[head].tolist())
        assert set(slots[head, :kept].tolist()) == set(eager.slots[head, :kept].tolist())


@pytest.mark.parametrize("past, k", [(5000, 750), (600, 599), (3000, 2)])
def test_equal_weights_choose_the_lowest_slots(kernels, past, k):
    """Every slot weighs the same (keys of zeros): the k chosen are the k lowest slots, whatever the counts per
    digit of the radix passes (one digit holds them all until the slot's bits), and all are kept."""
    partial_query, partial_keys = torch.randn(2, 3, 16), torch.zeros(2, 16, past + 10)
    slots, _, valid, _ = kernels.rehearse_select(partial_query, partial_keys, past, k, 4.0)
    assert bool(valid.all())
    for head in range(2):
        assert sorted(slots[head].tolist()) == list(range(k))


def test_float16_partial_keys_select_as_their_float32_values_do(kernels):
    """To the bit: float16 keys are widened exactly (slots of every scale)."""
    torch.manual_seed(2)
    partial_query = torch.randn(3, 3, 32)
    magnitudes = torch.logspace(-6, 4, 1100)[torch.randperm(1100)]  # 1,100 slots: a 16-lane tail
    stored, values = _as_stored(torch.randn(3, 32, 1100) * magnitudes, torch.float16)
    for past, k in ((1037, 151), (20, 7)):
        from_stored = kernels.rehearse_select(partial_query, stored, past, k, 12.0)
        from_float = kernels.rehearse_select(partial_query, values, past, k, 12.0)
        for got, expected in zip(from_stored, from_float):
            assert torch.equal(got, expected)


@pytest.mark.parametrize("channels", [256, 32])  # Gemma 3's global layers (every channel), SmolLM2's partial keys
def test_int8_partial_keys_of_every_scale_select_what_their_exact_logits_select(kernels, channels):
    """int8 codes against the query's 16-bit codes, two channels at a time (slots of exponents from 2^-22 and below
    to 2^2, query heads whose largest channels differ 1,000-fold): the kernel keeps what partial_codes.logits ranks."""
    torch.manual_seed(4)
    partial_query = torch.randn(2, 4, channels) * torch.tensor([0.01, 0.1, 1.0, 10.0]).view(1, 4, 1) / channels ** 0.5
    magnitudes = torch.logspace(-5, 2.5, 1100)[torch.randperm(1100)]
    stored, values = _as_stored(torch.randn(2, channels, 1100) * magnitudes, torch.int8)
    assert int(stored[:, -1].min()) < -15 and int(stored[:, -1].max()) >= 2  # exponents from 2^-22 and below to 2^2
    for past, k in ((1037, 151), (1100, 1099), (20, 7)):
        slots, _, valid, alpha_total = kernels.rehearse_select(partial_query, stored, past, k, 12.0)
        eager = _eager_selection(partial_query, stored, past, k, 12.0)
        assert int(alpha_total) == int(eager.alpha_total) and torch.equal(valid, eager.valid)
        for head in range(2):
            assert set(slots[head].tolist()) == set(eager.slots[head].tolist())
    exact = partial_codes.logits(partial_query, stored[:, :, :1037])
    assert not torch.equal(exact, torch.bmm(partial_query, values[:, :, :1037]))  # the query's codes are not its values


def test_the_cache_is_int8_only_where_every_selection_takes_the_kernels(tiny_llama, kernels):
    model, skew = tiny_llama
    dtypes = {}
    for name, extra in (("kernels", {}), ("evicting", {"pool_limit_tokens": 500}), ("eager", None)):
        engine = InfiniGenEngine(model, None, EngineConfig(**(extra or {})), skew_set=skew, fingerprint="tiny",
                                 kernels=None if extra is None else kernels)
        dtypes[name] = engine.policy.partial_store_dtype
        engine.close()
    assert dtypes == {"kernels": torch.int8, "evicting": torch.float32, "eager": torch.float32}


def test_partial_key_rows_never_lie_a_whole_number_of_pages_apart(tiny_llama, kernels):
    # a selection reads every channel's row at the same slots: rows 2^k bytes apart share the CPU caches' sets
    engine = make_tiny_engine(tiny_llama, kernels=kernels, policy="infinigen", budget=0.5)
    engine.prefill(random_tokens(40, seed=3))
    policy = engine.policy
    layer = policy.sparse_layers[0]
    before = policy.partial_keys_t[layer][..., :40].clone()
    for capacity in (1 << 15, 64):  # grown to a power of two of slots, then released back to a few
        if capacity > policy.partial_keys_t[layer].shape[-1]:
            policy.ensure_capacity(capacity)
        else:
            policy.release_capacity(capacity)
        cache = policy.partial_keys_t[layer]
        assert cache.shape[-1] == capacity and cache.stride(-1) == 1
        assert (cache.stride(-2) * cache.element_size()) % 4096 != 0
        assert torch.equal(cache[..., :40], before) and before.abs().sum() > 0
    engine.close()


def test_rehearse_select_refuses_a_k_past_the_slots(kernels):
    with pytest.raises(RuntimeError, match="bad sizes"):
        kernels.rehearse_select(torch.randn(2, 2, 8), torch.randn(2, 8, 50), 40, 41, 5.0)


def test_attend_rows_is_attention_over_the_gathered_rows(kernels):
    torch.manual_seed(1)
    keys, values = torch.randn(2, 900, 32), torch.randn(2, 900, 32)  # [kv, slots, dim]: pool rows
    query = torch.randn(2, 3, 32)
    rows = torch.stack([torch.randperm(880)[:601] for _ in range(2)])  # 601 rows: three chunks, the last short
    valid = torch.rand(601) < 0.7
    valid[0] = True
    out = kernels.attend_rows(query, keys[:, :880], values[:, :880], rows, valid, 0.2)
    picked_keys = torch.stack([keys[h, rows[h]] for h in range(2)]).unsqueeze(1)
    picked_values = torch.stack([values[h, rows[h]] for h in range(2)]).unsqueeze(1)
    expected = F.scaled_dot_product_attention(query.unsqueeze(1), picked_keys, picked_values, attn_mask=valid.view(1, -1),
                                              scale=0.2)[:, 0]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    unmasked = kernels.attend_rows(query, keys, values, rows, None, 0.2)
    expected = F.scaled_dot_product_attention(query.unsqueeze(1), picked_keys, picked_values, scale=0.2)[:, 0]
    torch.testing.assert_close(unmasked, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernels.attend_rows(query, keys[:, :100], values[:, :100], rows, None, 0.2)


# Gemma 3 270M's and SmolLM2's heads (sums in registers, 64 channels at a time), a group of 5 over 96 channels
# (32 at a time), and a group of 9 over 40 channels (the plain loop)
@pytest.mark.parametrize("kv,group,dim", [(1, 4, 256), (3, 3, 64), (2, 5, 96), (1, 9, 40)])
@pytest.mark.parametrize("repeated", [False, True])
def test_attend_rows_visits_in_slot_order_what_the_rows_name(kernels, kv, group, dim, repeated):
    """The kernel reads the rows in slot order, not in the order named: masked rows must stay out wherever they
    sort to, and a slot named twice must weigh twice (as two gathered copies would), not once."""
    torch.manual_seed(2)
    keys, values, query = torch.randn(kv, 2000, dim), torch.randn(kv, 2000, dim), torch.randn(kv, group, dim)
    rows = torch.stack([torch.randperm(2000)[:700] for _ in range(kv)])  # descending and ascending runs mixed
    if repeated:
        rows[:, 5] = rows[:, 9]
        rows[:, 300] = rows[:, 9]
    valid = torch.rand(700) < 0.6
    valid[[5, 9, 300]] = True
    out = kernels.attend_rows(query, keys, values, rows, valid, dim ** -0.5)
    picked_keys = torch.stack([keys[h, rows[h]] for h in range(kv)]).unsqueeze(1)
    picked_values = torch.stack([values[h, rows[h]] for h in range(kv)]).unsqueeze(1)
    expected = F.scaled_dot_product_attention(query.unsqueeze(1), picked_keys, picked_values,
                                              attn_mask=valid.view(1, -1), scale=dim ** -0.5)[:, 0]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("first, end", [(0, 41), (0, 700), (183, 700)])  # a short chat, several chunks, a window
def test_attend_span_is_attend_rows_over_every_slot_and_sdpas_attention(kernels, first, end):
    torch.manual_seed(end)
    kv, group, dim = 3, 3, 64
    query, keys, values = torch.randn(kv, group, dim), torch.randn(kv, 800, dim), torch.randn(kv, 800, dim)
    out = kernels.attend_span(query, keys, values, first, end, dim ** -0.5)
    rows = torch.arange(first, end).expand(kv, -1)
    assert torch.equal(out, kernels.attend_rows(query, keys, values, rows, None, dim ** -0.5))  # the same arithmetic
    expected = F.scaled_dot_product_attention(query.unsqueeze(1), keys[:, first:end].unsqueeze(1),
                                              values[:, first:end].unsqueeze(1), scale=dim ** -0.5)[:, 0]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="outside"):
        kernels.attend_span(query, keys, values, 0, 801, 1.0)


@pytest.mark.parametrize("settings, narrow", [
    ({}, False),
    ({"pool_limit_tokens": 244, "recent_window": 16}, False),  # a pool that evicts (from step 5): rows gathered
    ({}, True),  # kernels too narrow for the model's query groups: the eager ops throughout
])
@torch.inference_mode()
def test_the_engine_decodes_the_same_with_the_kernels(tiny_llama, kernels, settings, narrow):
    """Selected rows read in place by the kernels, or gathered where they cannot: the eager path's logits."""
    config = dict(policy="infinigen", budget=0.2, alpha=4.0, dense_under_budget=False, min_fetch_tokens=0, **settings)
    prompt = random_tokens(240, seed=5)
    eager = make_tiny_engine(tiny_llama, **config)
    if narrow:
        kernels = dataclasses.replace(kernels, max_group=1)  # the tiny Llama has 2 query heads per KV head
    fast = make_tiny_engine(tiny_llama, kernels, **config)
    assert fast.kernels is kernels and eager.kernels is None
    # the heads share each layer's budget only where the kernels read the rows in place; the eager path can share
    # too (its gather then copies each head's 2k slots, masked): set alike, it must give the kernels' logits
    assert not eager.policy.heads_share_budget and fast.policy.heads_share_budget == (not settings and not narrow)
    eager.policy.heads_share_budget = fast.policy.heads_share_budget
    assert fast.policy.coded == (not settings and not narrow)  # int8 only where every selection takes the kernels
    if fast.policy.coded:
        hold_int8_partial_codes(eager)
    expected, got = greedy_logits(eager, prompt, 8), greedy_logits(fast, prompt, 8)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    fetched = [[(layer.sparse, layer.fetched) for layer in step.layers] for step in (eager.history[-1], fast.history[-1])]
    assert fetched[0] == fetched[1] and any(sparse for sparse, _ in fetched[1])  # the same statistics
    eager.close(), fast.close()


def test_a_build_that_fails_leaves_the_eager_path_with_a_reason(tmp_path, monkeypatch):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", broken)
    kernels, reason = cpu_kernels._build(tmp_path / "build", None)
    assert kernels is None and reason  # one line saying why, logged; the caller decodes eagerly


def test_the_summary_and_the_options_say_whether_the_kernels_run(tiny_llama, kernels):
    from chat_service.model_host import ModelHost
    from infinigen_core.cli import build_parser
    from ui.cli import parse_args

    model, skew = tiny_llama
    host = ModelHost()
    host.engine = InfiniGenEngine(model, None, EngineConfig(), skew_set=skew, fingerprint="tiny", kernels=kernels)
    host.engine.model_name = "tiny"
    assert host.model_summary().endswith(f"· eager decode · {kernels.label}")
    host.engine.close()
    assert parse_args([]).cpu_kernels is None and parse_args(["--no-cpu-kernels"]).cpu_kernels is False
    assert build_parser().parse_args(["generate", "--prompt", "hi", "--no-cpu-kernels"]).cpu_kernels is False
    seen = {}
    off = ModelHost(loader=lambda *args, **kwargs: seen.update(kwargs))
    off.cpu_kernels = False
    off._load(None, None, print)
    assert seen["cpu_kernels"] is False  # reaches load_engine, which then builds nothing


@torch.inference_mode()
def test_every_selection_of_a_real_compiled_reply_is_the_eager_ops_choice(real_engine, monkeypatch):
    """The default engine (compiled step, kernels, int8 partial keys) at ~300 tokens: each rehearse_select
    keeps the rows, alpha count and mask that the eager ops compute from the same query and cache. Through the
    Python path, which calls the kernels through the policy (the decode lane's are the same calls, to the bit:
    tests/test_decode_lane.py)."""
    from infinigen_core.calibration import calibration_text
    from infinigen_core.decode_lane import DecodeLane

    monkeypatch.setattr(DecodeLane, "for_work", staticmethod(lambda work: None))

    kernels, seen, widths = real_engine.kernels, [], []
    assert kernels is not None and real_engine.decode_step.is_compiled

    class Checked:
        label = kernels.label
        fit = kernels.fit

        @staticmethod
        def rehearse_select(query, keys, past, k, alpha, width=None):
            slots, scores, valid, alpha_total = kernels.rehearse_select(query, keys, past, k, alpha, width)
            widths.append((k, width))
            chooser = _chooser(alpha=alpha, budget=1.0)
            chooser.ctx.adapter.num_heads = query.shape[0] * query.shape[1]
            eager = chooser.choose(partial_codes.logits(query, keys[:, :, :past]), k, width=width)
            seen.append(torch.equal(valid, eager.valid) and int(alpha_total) == int(eager.alpha_total)
                        and _same_rows_per_head(slots, valid, eager))
            return slots, scores, valid, alpha_total

    ids = real_engine.tokenizer(calibration_text())["input_ids"]
    real_engine.prefill(ids[:300])
    real_engine.policy.ctx.kernels = Checked()
    real_engine.score(ids[300:306])
    assert len(seen) == 6 * len(real_engine.policy.sparse_layers) and all(seen)
    assert real_engine.policy.partial_store_dtype == torch.int8
    assert sum(width > k for k, width in widths) > len(widths) // 2  # most layers' heads share their budget


def test_a_build_killed_before_it_ended_does_not_stop_the_next_start(kernels):
    """torch's loader waits for ever while its `lock` marker exists, and a killed build leaves it: the next build
    (holding the OS lock that dies with its holder) removes it and loads, rather than hanging every later start."""
    # where this process's kernels came from: a library built elsewhere would register the same ops twice
    folder = cpu_kernels.loaded_from
    marker = folder / "lock"
    marker.write_text("left by a build that was killed")
    outcome: list = []
    thread = threading.Thread(target=lambda: outcome.append(cpu_kernels._build(folder.parent, None)), daemon=True)
    thread.start()
    thread.join(timeout=180)  # loading a built library takes seconds; torch alone waits for ever
    assert not thread.is_alive(), "the build waited on the stale marker"
    assert outcome[0][0] is not None and not marker.exists()


def test_q8_product_equals_the_dequantised_weights(kernels):
    """The output head's product at Q8_0 codes: codes x group scales, read as one float32 row times the
    dequantised weight (float64 reference), for a row count past the kernel's 256-row chunks."""
    generator = torch.Generator().manual_seed(0)
    out_features, in_features = 300, 96
    codes = torch.randint(-127, 128, (out_features, in_features), generator=generator).to(torch.int8)
    scales = torch.rand(out_features, in_features // 32, generator=generator) * 0.02
    weight = (codes.double().view(out_features, -1, 32) * scales.double().unsqueeze(-1)).view(out_features, in_features)
    row = torch.randn(1, in_features, generator=generator)
    product = kernels.q8_matvec(row, codes, scales)
    assert product.shape == (1, out_features) and product.dtype == torch.float32
    torch.testing.assert_close(product.double(), row.double() @ weight.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.q8_matvec(row[:, :90], codes[:, :90].contiguous(), scales)


def test_q4_product_equals_the_dequantised_weights(kernels):
    """The body's product at Q4_1 codes: code x scale + minimum per group of 32 inputs, packed two codes a byte,
    read as one float32 row times the dequantised weight (float64 reference). 301 output rows: past the
    kernel's 256-row chunks, and an odd count for its two-rows-at-a-time loop."""
    generator = torch.Generator().manual_seed(0)
    out_features, in_features = 301, 96
    codes = torch.randint(0, 16, (out_features, in_features), generator=generator)
    scales = torch.rand(out_features, in_features // 32, generator=generator) * 0.02
    lows = -8 * scales + torch.randn(out_features, in_features // 32, generator=generator) * 0.01
    weight = (codes.double().view(out_features, -1, 32) * scales.double().unsqueeze(-1)
              + lows.double().unsqueeze(-1)).view(out_features, in_features)
    row = torch.randn(1, in_features, generator=generator)
    product = kernels.q4_matvec(row, pack_q4(codes), scales, lows)
    assert product.shape == (1, out_features) and product.dtype == torch.float32
    torch.testing.assert_close(product.double(), row.double() @ weight.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="one value per input channel"):
        kernels.q4_matvec(row[:, :64], pack_q4(codes), scales, lows)


def test_the_build_asks_for_vnni_only_where_the_cpu_has_it(monkeypatch):
    """`vpdpwssd` (the int8 partial keys' selection) on an AVX-512 CPU that lists avx512_vnni; other AVX-512 CPUs
    build the same source without it (16-bit multiply-adds then an add), AVX2 ones never ask for it."""
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: {"avx512f", "avx512_vnni"})
    assert cpu_kernels._VNNI_FLAG in cpu_kernels._arch_flags("AVX512")
    assert cpu_kernels._VNNI_FLAG not in cpu_kernels._arch_flags("AVX2")
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: {"avx512f"})
    assert cpu_kernels._VNNI_FLAG not in cpu_kernels._arch_flags("AVX512")
    assert cpu_kernels._arch_flags("AVX512") == cpu_kernels._ARCH_FLAGS["AVX512"]
