"""Compact decode weights (infinigen_core/weights.py): one-row steps read int4/int8/bf16 copies, prefill stays
exactly fp32, 4-bit files keep their codes, and a clean fallback."""

import copy
import logging

import pytest
import torch
from torch import nn

from infinigen_core.loading import ModelLoadError, resolve_weights
from infinigen_core.weights import (
    GROUP,
    Bf16DecodeLinear,
    Int4DecodeLinear,
    Int8DecodeLinear,
    Q8DecodeLinear,
    decode_weight_kinds,
    int4_codes,
    plain_fp32_weights,
    q8_codes,
    restore_fp32_weights,
    use_decode_weights,
    weights_label,
)

from conftest import make_tiny_engine, random_tokens


def _four_bit_linear(out_features=96, in_features=128, seed=0) -> nn.Linear:
    """A Linear whose weights are Q4_1 blocks dequantised: code * scale + minimum, per group of 32 inputs."""
    generator = torch.Generator().manual_seed(seed)
    groups = in_features // GROUP
    codes = torch.randint(0, 16, (out_features, groups, GROUP), generator=generator).float()
    codes[..., 0], codes[..., 1] = 0, 15  # every block of a Q4_1 file spans its codes' full range
    scale = torch.rand(out_features, groups, 1, generator=generator) * 0.01 + 1e-3
    low = -torch.rand(out_features, groups, 1, generator=generator) * 0.05
    linear = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_((codes * scale + low).reshape(out_features, in_features))
    return linear


def _compact_copy(tiny_llama, monkeypatch, choice="auto"):
    model, skew = tiny_llama
    model = copy.deepcopy(model)
    monkeypatch.setattr("infinigen_core.weights.MIN_COMPACT_WEIGHTS", 1)  # the tiny model's layers are small
    assert use_decode_weights(model, choice)
    return model, skew


@pytest.mark.parametrize("kind", [Int4DecodeLinear, Int8DecodeLinear, Bf16DecodeLinear])
def test_each_kind_is_close_at_one_row_and_exactly_fp32_for_more(kind):
    torch.manual_seed(0)
    linear = nn.Linear(64, 96)
    layer = kind(linear)
    assert layer.weight is linear.weight and layer.bias is linear.bias  # the fp32 parameters are kept, not copied
    batch = torch.randn(1, 7, 64)
    assert torch.equal(layer(batch), linear(batch))
    row = torch.randn(1, 1, 64)
    out, exact = layer(row), linear(row)
    assert out.shape == exact.shape and out.dtype == torch.float32 and not torch.equal(out, exact)
    assert (out - exact).norm() / exact.norm() < (0.15 if kind is Int4DecodeLinear else 0.02)


def test_four_bit_weights_give_back_their_codes_and_only_bf16_rounding():
    linear = _four_bit_linear()
    codes, scale, low, exact = int4_codes(linear.weight)
    assert exact
    rebuilt = codes.view(96, -1, GROUP).float() * scale.unsqueeze(-1) + low.unsqueeze(-1)
    torch.testing.assert_close(rebuilt.view(96, 128), linear.weight, atol=1e-6, rtol=0)
    row = torch.randn(1, 128)
    # what is left is bf16: the row and each group's scale and middle; the weights themselves are not rounded
    bf16_reference = nn.functional.linear(row.bfloat16().float(), linear.weight)
    error = (Int4DecodeLinear(linear)(row) - bf16_reference).norm() / bf16_reference.norm()
    assert error < 0.01
    # a weight off the 4-bit grid is not exact
    noisy = linear.weight + torch.randn_like(linear.weight) * 1e-3
    assert not int4_codes(noisy)[3]


def test_int4_codes_give_back_a_q4_k_files_groups_that_use_only_some_codes(kernels, monkeypatch):
    """A Q4_K group is its sub-block's scale times codes 0..15 minus an offset, and most groups use fewer than all
    16 codes: their range / 15 is not their step. The longest span their weights lie on gives them back."""
    generator = torch.Generator().manual_seed(7)
    out_features, groups = 80, 4
    spans = torch.randint(1, 16, (out_features, groups, 1), generator=generator)  # 1 to 15 of the codes' steps
    codes = (torch.rand(out_features, groups, GROUP, generator=generator) * (spans + 1)).floor().clamp(max=spans)
    codes[..., 0], codes[..., 1] = 0, spans[..., 0]  # each group's lowest and highest code
    scale = (torch.rand(out_features, groups, 1, generator=generator) * 0.01 + 1e-4).half().float()
    offset = (torch.rand(out_features, groups, 1, generator=generator) * 0.05).half().float()
    linear = nn.Linear(groups * GROUP, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_((codes * scale - offset).reshape(out_features, -1))
    got, got_scale, low, exact = int4_codes(linear.weight)
    assert exact and int(got.max()) <= 15
    rebuilt = got.view(out_features, groups, GROUP).float() * got_scale.unsqueeze(-1) + low.unsqueeze(-1)
    torch.testing.assert_close(rebuilt.view(out_features, -1), linear.weight, atol=1e-6, rtol=0)
    # the file's step or a whole fraction of it (a group of span 5 lies on a grid of 15 too), not the range / 15
    ratio = scale.squeeze(-1) / got_scale
    torch.testing.assert_close(ratio, ratio.round(), atol=1e-4, rtol=0)
    assert bool((ratio.round() == 1).any())
    assert not int4_codes(linear.weight + torch.randn_like(linear.weight) * 1e-4)[3]  # off the grid: said so
    monkeypatch.setattr("infinigen_core.weights.MIN_COMPACT_WEIGHTS", 1)
    model = nn.Sequential(linear)
    assert use_decode_weights(model, "auto", kernels) == {"int4": 1}  # not 8-bit groups rounded to 127 levels
    row = torch.randn(1, 1, groups * GROUP)
    torch.testing.assert_close(model[0](row), linear(row), rtol=1e-5, atol=1e-6)


def test_auto_keeps_four_bit_layers_int4_puts_the_rest_in_int8_and_the_head_in_bf16(monkeypatch):
    monkeypatch.setattr("infinigen_core.weights.MIN_COMPACT_WEIGHTS", 1)
    torch.manual_seed(0)

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.four_bit, self.plain, self.odd = _four_bit_linear(), nn.Linear(128, 96), nn.Linear(100, 96)
            self.head = nn.Linear(96, 50)

        def get_output_embeddings(self):
            return self.head

    model = Tiny()
    assert use_decode_weights(model, "auto") == {"int4": 1, "int8": 2, "bf16": 1}
    assert (type(model.four_bit), type(model.plain), type(model.odd), type(model.head)) == (
        Int4DecodeLinear, Int8DecodeLinear, Int8DecodeLinear, Bf16DecodeLinear)  # 100 inputs: no groups of 32
    assert weights_label(model) == "int8/int4 weights (head bf16)"
    restore_fp32_weights(model)
    assert use_decode_weights(model, "int4") == {"int4": 2, "int8": 1, "bf16": 1}  # int4 even off the grid


@torch.inference_mode()
@pytest.mark.parametrize("choice", ["auto", "int8"])
def test_compact_decoding_keeps_the_greedy_tokens_and_the_prefill_cache_exact(tiny_llama, monkeypatch, choice):
    compact = _compact_copy(tiny_llama, monkeypatch, choice)
    assert weights_label(compact[0]).endswith("(head bf16)") and weights_label(tiny_llama[0]) == "fp32 weights"
    prompt = random_tokens(60, seed=2)
    with make_tiny_engine(tiny_llama, policy="full") as fp32, make_tiny_engine(compact, policy="full") as small:
        engines = [fp32, small]
        first = [engine.prefill(prompt) for engine in engines]
        # prefill runs the fp32 model: the first reply token's logits and the prompt's K/V (what sessions
        # save) are fp32's bit for bit, also when only the last prompt token runs again (a cached prompt)
        assert torch.equal(first[0], first[1])
        for layer in range(engines[0].adapter.num_layers):
            assert torch.equal(engines[0].pool.keys(layer), engines[1].pool.keys(layer))
            assert torch.equal(engines[0].pool.values(layer), engines[1].pool.values(layer))
        engines[1].truncate(len(prompt) - 1)
        again = engines[1].prefill(prompt[-1:])  # one row, yet through the fp32 weights
        torch.testing.assert_close(again, first[0], atol=1e-4, rtol=0)
        engines[1].truncate(len(prompt) - 1)
        decoded = engines[1].decode(prompt[-1])  # the same token as a decode step reads the compact weights
        assert 1e-4 < float((decoded - first[0]).abs().max()) < 0.1
        token = [int(random_tokens(1, seed=3)[0])] * 2
        agree = 0
        for _ in range(16):
            logits = [engine.decode(t) for engine, t in zip(engines, token)]
            torch.testing.assert_close(logits[1], logits[0], atol=0.1, rtol=0)
            agree += int(logits[0].argmax() == logits[1].argmax())
            token = [int(logits[0].argmax())] * 2  # teacher-forced on the fp32 tokens
        assert agree >= 15


def test_the_fp32_layers_come_back_and_the_compact_ones_return_unchanged(tiny_llama, monkeypatch):
    model, _ = _compact_copy(tiny_llama, monkeypatch)
    head, compact_head = model.lm_head.weight, model.lm_head
    with plain_fp32_weights(model):
        assert decode_weight_kinds(model) == {}
        assert model.lm_head.weight is head  # the same Parameter (a tied head stays tied)
        assert model.lm_head is compact_head.plain  # the very Linear it replaced: no module built per prefill
    assert model.lm_head is compact_head  # not quantised again
    restore_fp32_weights(model)
    assert weights_label(model) == "fp32 weights" and model.lm_head is compact_head.plain


def test_where_the_kernels_fail_the_model_stays_fp32_and_the_log_says_why(tiny_llama, monkeypatch, caplog):
    model = copy.deepcopy(tiny_llama[0])
    monkeypatch.setattr("infinigen_core.weights.MIN_COMPACT_WEIGHTS", 1)

    def no_kernel(*args, **kwargs):
        raise RuntimeError("no int4 kernel in this build")

    monkeypatch.setattr("infinigen_core.weights.Int4DecodeLinear.__init__", no_kernel)
    with caplog.at_level(logging.WARNING, logger="infinigen_core.weights"):
        assert use_decode_weights(model, "int4") == {}
    assert "no int4 kernel" in caplog.text and weights_label(model) == "fp32 weights"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="infinigen_core.weights"):
        assert use_decode_weights(copy.deepcopy(model).to(torch.bfloat16), "int8") == {}
    assert "float32 models on the CPU" in caplog.text


def test_the_weights_option_defaults_to_auto_on_the_cpu_and_compact_kinds_are_for_the_cpu():
    assert resolve_weights(None, torch.device("cpu")) == "auto"
    assert resolve_weights(None, torch.device("cuda")) == "fp32"
    assert resolve_weights("auto", torch.device("cuda")) == "fp32"
    assert resolve_weights("fp32", torch.device("cpu")) == "fp32"
    for kind in ("int8", "int4"):
        assert resolve_weights(kind, torch.device("cpu")) == kind
        with pytest.raises(ModelLoadError, match="CPU"):
            resolve_weights(kind, torch.device("cuda"))
    with pytest.raises(ModelLoadError, match="unknown weights"):
        resolve_weights("int3", torch.device("cpu"))


def _q8_linear(out_features=80, in_features=96, seed=0) -> nn.Linear:
    """A Linear whose weights are Q8_0 blocks dequantised: code * scale per group of 32 inputs, each group's
    largest magnitude at code +-127 (how the format chooses its scale)."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (out_features, in_features // GROUP, GROUP), generator=generator).float()
    codes[..., 0] = 127
    scales = torch.rand(out_features, in_features // GROUP, 1, generator=generator) * 0.01 + 1e-4
    linear = nn.Linear(in_features, out_features, bias=False)
    with torch.no_grad():
        linear.weight.copy_((codes * scales.half().float()).reshape(out_features, in_features))  # fp16 scales, as stored
    return linear


def test_q8_codes_give_back_a_q8_0_files_codes():
    linear = _q8_linear()
    codes, scales, exact = q8_codes(linear.weight)
    assert exact and codes.dtype == torch.int8 and scales.shape == (80, 3)
    rebuilt = (codes.float().view(80, 3, GROUP) * scales.unsqueeze(-1)).view(80, 96)
    assert torch.equal(rebuilt, linear.weight)
    assert not q8_codes(nn.Linear(96, 80).weight)[2]  # plain float weights are off the 8-bit grid


@pytest.mark.parametrize("levels", [16, 8])  # GGUF's Q5_0 and Q4_0: codes q - 16 and q - 8 times one scale
def test_q8_codes_give_back_a_q5_0_or_q4_0_files_codes(levels, kernels, monkeypatch):
    generator = torch.Generator().manual_seed(levels)
    codes = torch.randint(-levels, levels, (80, 3, GROUP), generator=generator).float()
    codes[..., 5] = -levels  # the quantiser puts each group's largest magnitude at -levels
    signs = torch.where(torch.rand(80, 3, 1, generator=generator) < 0.5, -1.0, 1.0)  # a scale may be negative
    scales = (torch.rand(80, 3, 1, generator=generator) * 0.01 + 1e-4) * signs
    linear = nn.Linear(96, 80, bias=False)
    with torch.no_grad():
        linear.weight.copy_((codes * scales.half().float()).reshape(80, 96))
    got, got_scales, exact = q8_codes(linear.weight)
    rebuilt = (got.float().view(80, 3, GROUP) * got_scales.unsqueeze(-1)).view(80, 96)
    assert exact and torch.equal(rebuilt, linear.weight)  # the file's weights, not a rounding to 127 levels
    assert int(got.abs().amax()) <= 16  # a 5- or 4-bit grid (a Q4_0 file fits Q5_0's too)
    assert not q8_codes(linear.weight * 1.001 + 1e-6)[2]  # off every grid: rounded, and said so
    monkeypatch.setattr("infinigen_core.weights.MIN_COMPACT_WEIGHTS", 1)
    model = nn.Sequential(linear)
    # a Q4_0 layer is on a 4-bit grid too (auto's first choice: half the bytes), a Q5_0 one is not
    assert use_decode_weights(model, "auto", kernels) == {"int4" if levels == 8 else "q8_0": 1}
    row = torch.randn(1, 1, 96)
    torch.testing.assert_close(model[0](row), linear(row), rtol=1e-5, atol=1e-6)


def test_a_q8_0_head_runs_at_its_own_codes_with_the_cpu_kernels(kernels, monkeypatch):
    monkeypatch.setattr("infinigen_core.weights.MIN_COMPACT_WEIGHTS", 1)  # small layers, compacted all the same

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = _four_bit_linear(out_features=96), _q8_linear()

        def get_output_embeddings(self):
            return self.head

    model = Tiny()
    plain_head = model.head
    assert use_decode_weights(model, "auto", kernels) == {"int4": 1, "q8_0": 1}
    assert type(model.head) is Q8DecodeLinear and weights_label(model) == "int4 weights (head q8_0)"
    row = torch.randn(1, 1, 96)
    # exact weights and a float32 row: only the order of the sums differs from the fp32 product
    torch.testing.assert_close(model.head(row), plain_head(row), rtol=1e-5, atol=1e-6)
    restore_fp32_weights(model)
    assert use_decode_weights(model, "auto") == {"int4": 1, "bf16": 1}  # no kernels: bf16, as before
    restore_fp32_weights(model)
    model.head = nn.Linear(96, 80, bias=False)  # a head off the 8-bit grid keeps bf16 (q8 would round it)
    assert use_decode_weights(model, "auto", kernels) == {"int4": 1, "bf16": 1}


@torch.inference_mode()
def test_prefill_reads_a_q8_0_head_at_its_codes_once_and_the_layers_in_fp32(tiny_llama, kernels, monkeypatch):
    """The output head, which prefill runs for one row, stays at the file's Q8_0 codes (the same logits to float
    rounding, a quarter of fp32's bytes) and runs for the last chunk only; the layers, and so the K/V, stay fp32."""
    monkeypatch.setattr("infinigen_core.weights.MIN_COMPACT_WEIGHTS", 1)
    model = copy.deepcopy(tiny_llama[0])
    with torch.no_grad():  # the head's weights on a Q8_0 grid, as a GGUF file's Q8_0 head dequantised
        model.lm_head.weight.copy_(_q8_linear(out_features=model.lm_head.out_features, in_features=64).weight)
    reference = copy.deepcopy(model)
    use_decode_weights(model, "auto", kernels)
    head = model.lm_head
    assert type(head) is Q8DecodeLinear and head.exact
    head_rows = []
    one_row = Q8DecodeLinear._one_row
    monkeypatch.setattr(Q8DecodeLinear, "_one_row", lambda self, row: (head_rows.append(self is head),
                                                                        one_row(self, row))[1])
    prompt = random_tokens(60, seed=4)
    engines = [make_tiny_engine((m, tiny_llama[1]), kernels, policy="full", prefill_chunk=16) for m in (reference, model)]
    with engines[0] as plain, engines[1] as compact:
        first = [plain.prefill(prompt), compact.prefill(prompt)]
        assert head_rows == [True]  # four chunks, one head row: the last chunk's last token
        torch.testing.assert_close(first[1], first[0], rtol=1e-5, atol=1e-5)
        for layer in range(plain.adapter.num_layers):  # no layer other than the head left fp32
            assert torch.equal(plain.pool.keys(layer), compact.pool.keys(layer))
            assert torch.equal(plain.pool.values(layer), compact.pool.values(layer))
        compact.truncate(len(prompt) - 1)
        again = compact.prefill(prompt[-1:])  # a cached prompt's last token runs again: through the same head
        torch.testing.assert_close(again, first[1], atol=1e-4, rtol=0)
        assert head_rows == [True, True]
    assert type(model.lm_head) is Q8DecodeLinear and decode_weight_kinds(model)  # the compact layers are back


def test_with_the_cpu_kernels_the_layers_off_the_4_bit_grid_read_8_bit_groups_and_a_float32_row(kernels, monkeypatch):
    """Where int4 would round a weight (a Q5_0/Q6_K/Q8_0 file's layers, or any float checkpoint), the kernels' 8-bit
    codes in groups of 32 serve it, not ATen's int8 with one scale per output channel and a bf16 row: a Q8_0
    layer is the file's weights again, and any other layer is rounded less than per-channel int8 rounds it."""
    monkeypatch.setattr("infinigen_core.weights.MIN_COMPACT_WEIGHTS", 1)
    torch.manual_seed(0)

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.four_bit, self.eight_bit = _four_bit_linear(), _q8_linear(seed=1)
            self.plain, self.odd = nn.Linear(128, 96), nn.Linear(100, 96)
            with torch.no_grad():  # inputs of unequal sizes, as a model's are: one scale per row fits only the largest
                self.plain.weight[:, :32] *= 20

    model = Tiny()
    plain, eight_bit = model.plain, model.eight_bit
    assert use_decode_weights(model, "auto", kernels) == {"int4": 1, "q8_0": 2, "int8": 1}
    assert (type(model.four_bit), type(model.eight_bit), type(model.plain), type(model.odd)) == (
        Int4DecodeLinear, Q8DecodeLinear, Q8DecodeLinear, Int8DecodeLinear)  # 100 inputs: no groups of 32
    assert model.plain.row_dtype == torch.float32
    row = torch.randn(1, 1, 96)
    torch.testing.assert_close(model.eight_bit(row), eight_bit(row), rtol=1e-5, atol=1e-6)  # the file's codes
    row = torch.randn(1, 1, 128)
    exact = plain(row)
    grouped = (model.plain(row) - exact).norm() / exact.norm()
    per_channel = (Int8DecodeLinear(plain)(row) - exact).norm() / exact.norm()
    assert grouped < 0.005 and grouped < per_channel / 1.5  # here 0.34% against 0.70%
    restore_fp32_weights(model)
    assert use_decode_weights(model, "int8", kernels) == {"q8_0": 3, "int8": 1}  # int8 asked for: the same grid
    assert weights_label(model) == "q8_0/int8 weights"
    restore_fp32_weights(model)
    assert use_decode_weights(model, "auto") == {"int4": 1, "int8": 3}  # no kernels: ATen's int8, as before


def test_int4_layers_with_the_cpu_kernels_read_a_float32_row(kernels, monkeypatch):
    """With the kernels, a 4-bit layer's one-row product is the file's weights times the row as it is (float32
    scales, minima and sums): the fp32 product to float rounding, where ATen's int4 product rounds the row and
    its result to bf16."""
    monkeypatch.setattr("infinigen_core.weights.MIN_COMPACT_WEIGHTS", 1)
    linear = _four_bit_linear()
    row = torch.randn(1, 1, 128)
    through_kernels = Int4DecodeLinear(linear, kernels=kernels)
    torch.testing.assert_close(through_kernels(row), linear(row), rtol=1e-5, atol=1e-6)
    assert (Int4DecodeLinear(linear)(row) - linear(row)).abs().max() > 1e-4  # ATen's: bf16 rounding
    model = nn.Sequential(_four_bit_linear())
    assert use_decode_weights(model, "auto", kernels) == {"int4": 1} and model[0].row_dtype == torch.float32


@torch.inference_mode()
def test_decoding_after_rows_that_differ_by_rounding_moves_no_more_than_fp32_weights_do(tiny_llama, kernels,
                                                                                        monkeypatch):
    """Issue 31's resume gap: a conversation restored from rows that differ from the live ones by a rounding (what
    an int8 chunk, even a float16 one, gives back) must decode about as the uninterrupted one does. A decode step
    that rounds every activation row to bf16 re-rolls those roundings at the slightest difference, so the two
    conversations part by the bf16 step (2^-9) whatever the rows' difference; with float32 rows they part by
    what the difference itself does, as with fp32 weights."""
    monkeypatch.setattr("infinigen_core.weights.MIN_COMPACT_WEIGHTS", 1)
    model, skew = tiny_llama
    compact = copy.deepcopy(model)
    assert use_decode_weights(compact, "int4", kernels) == {"int4": 28, "bf16": 1}
    compact.lm_head = compact.lm_head.plain  # a bf16 head would round the logits' differences away
    prompt, following = random_tokens(48, seed=4), random_tokens(8, seed=5)
    generator = torch.Generator().manual_seed(6)

    def parting(weights) -> float:
        """The largest logit difference over `following` between the live conversation and one restored from
        its rows perturbed by 2^-16 of their size."""
        with make_tiny_engine((weights, skew), policy="full") as engine:
            engine.prefill(prompt)
            rows = engine.export_rows(0, len(prompt))
            live = engine.score(following)
            for name, tensor in rows.items():
                if name.startswith(("k.", "v.")):
                    rows[name] = tensor + tensor * torch.randn(tensor.shape, generator=generator) * 2.0**-16
            engine.reset()
            engine.import_rows([rows])
            return float((engine.score(following) - live).abs().max())

    by_fp32, by_compact = parting(model), parting(compact)
    assert 0 < by_compact < 10 * by_fp32 + 1e-6, (by_compact, by_fp32)
