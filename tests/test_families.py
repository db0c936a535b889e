"""Every supported model family, as a tiny random-weight model built here from its transformers config.

Each family's own modeling code is the reference: the rehearsed query must be the query its attention
receives, the engine's dense attention must give the model's own logits (sliding windows and soft-capping
included), InfiniGen at a 100% budget must equal `full`, and at the defaults it must really leave tokens out,
on global layers only. A CLI run loads one from a directory, and a hub id resolves from a fake hub cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import eager_mask

from infinigen_core.arch import FAMILIES, ModelAdapter, UnsupportedModelError
from infinigen_core.calibration import calibrate
from infinigen_core.config import EngineConfig
from infinigen_core.engine import InfiniGenEngine
from infinigen_core.skew import is_orthogonal

from conftest import random_tokens

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 128
WINDOW = 24  # shorter than the test prompts, so a sliding layer that ignored it would give other logits
SLIDING, GLOBAL = "sliding_attention", "full_attention"
PROMPT, CONTINUATION = random_tokens(80, seed=3), random_tokens(10, seed=4)


def family_config(model_type: str):
    """A 6-layer config of the family with GQA (4 query heads, 2 KV heads) and its distinctive features."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    interleaved = dict(sliding_window=WINDOW, layer_types=[SLIDING, SLIDING, GLOBAL] * 2)
    configs = {
        "llama": lambda: transformers.LlamaConfig(**common),
        "mistral": lambda: transformers.MistralConfig(**common, sliding_window=None),
        "ministral": lambda: transformers.MinistralConfig(**common, head_dim=16, **interleaved),
        "qwen2": lambda: transformers.Qwen2Config(**common),
        "qwen3": lambda: transformers.Qwen3Config(**common, head_dim=16),
        "olmo2": lambda: transformers.Olmo2Config(**common),
        "olmo3": lambda: transformers.Olmo3Config(**common, **interleaved),
        # Phi-4-mini rotates only part of each head
        "phi3": lambda: transformers.Phi3Config(**common, partial_rotary_factor=0.5),
        "gemma2": lambda: transformers.Gemma2Config(**common, head_dim=16, sliding_window=WINDOW,
                                                     query_pre_attn_scalar=24, attn_logit_softcapping=5.0),
        "gemma3_text": lambda: transformers.Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=24,
                                                             **interleaved),
        "gemma3": lambda: transformers.Gemma3Config(  # a multimodal checkpoint: its language model, on text
            text_config=transformers.Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=24,
                                                      **interleaved).to_dict(),
            vision_config=transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                          num_attention_heads=2, image_size=32,
                                                          patch_size=8).to_dict(),
            mm_tokens_per_image=4, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
            image_token_index=VOCAB - 1),
        "smollm3": lambda: transformers.SmolLM3Config(**common, no_rope_layers=[1, 1, 1, 0, 1, 0]),
        "granite": lambda: transformers.GraniteConfig(**common, attention_multiplier=0.3, residual_multiplier=0.5,
                                                      embedding_multiplier=2.0, logits_scaling=4.0),
        "opt": lambda: transformers.OPTConfig(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=6,
                                              num_attention_heads=4, max_position_embeddings=1024,
                                              word_embed_proj_dim=64, pad_token_id=0),
    }
    return configs[model_type]()


def build(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(family_config(model_type)).eval()
    # random weights are small; larger q/k make attention peaked like a trained model's, so selection matters.
    # Families with q/k norms undo a projection's scale: there the norm's gain is raised (Gemma's is 1 + w).
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                parameter.mul_(16.0)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.add_(3.0) if model.config.model_type.startswith("gemma") else parameter.mul_(4.0)
    return model


def test_every_supported_family_is_tested_here():
    families = {"llama", "mistral", "ministral", "qwen2", "qwen3", "olmo2", "olmo3", "phi3", "gemma2",
                "gemma3_text", "gemma3", "smollm3", "granite", "opt"}
    assert set(FAMILIES) == families


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    """(model_type, model, skew_set) with the skew calibrated on 200 random tokens."""
    model = build(request.param)
    return request.param, model, calibrate(model, random_tokens(200, seed=1, vocab=VOCAB))


# ------------------------------------------------------------------------------------ what the model does
_seen: dict[int, dict] = {}


def _recording(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    _seen[module.layer_idx] = {"query": query[0].clone(), "scaling": scaling, "sliding_window":
                               kwargs.get("sliding_window"), "softcap": kwargs.get("softcap")}
    attention = sdpa_attention_forward
    if kwargs.get("softcap") is not None:
        attention = sys.modules[type(module).__module__].eager_attention_forward
    return attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


AttentionInterface.register("test_recording", _recording)
AttentionMaskInterface.register("test_recording", eager_mask)


@torch.inference_mode()
def run_recorded(model, token_ids, first_position=0):
    """The model's own forward (transformers' masks); returns (logits, per-layer inputs, per-layer calls)."""
    adapter = ModelAdapter.for_model(model)
    inputs = {}
    hooks = [module.register_forward_pre_hook(
        lambda module, args, kwargs: inputs.__setitem__(module.layer_idx, kwargs), with_kwargs=True)
        for module in adapter.attention_modules(model)]
    previous = model.config._attn_implementation
    model.set_attn_implementation("test_recording")
    _seen.clear()
    try:
        positions = torch.arange(first_position, first_position + len(token_ids)).unsqueeze(0)
        logits = model(input_ids=torch.tensor([token_ids]), position_ids=positions, use_cache=False).logits[0]
    finally:
        model.set_attn_implementation(previous)
        for hook in hooks:
            hook.remove()
    return logits, inputs, dict(_seen)


def test_rehearsal_is_the_next_layers_own_query(family):
    """Speculation's query for layer i+1, made from layer i+1's input and the position embeddings that layer i
    received (all the pre-hook of layer i has), is exactly the query layer i+1's attention is called with."""
    model_type, model, _ = family
    adapter = ModelAdapter.for_model(model)
    positions = torch.arange(30, 45)
    _, inputs, calls = run_recorded(model, random_tokens(15, seed=7), first_position=30)
    for layer in range(1, adapter.num_layers):
        source = inputs[layer - 1].get("position_embeddings")
        with torch.inference_mode():
            query = adapter.rehearse_query(adapter.attention_modules(model)[layer], inputs[layer]["hidden_states"],
                                           source, positions)
        torch.testing.assert_close(query, calls[layer]["query"], rtol=0, atol=1e-6, msg=f"{model_type} layer {layer}")


def test_the_adapters_layer_facts_are_what_the_family_passes_to_attention(family):
    model_type, model, _ = family
    adapter = ModelAdapter.for_model(model)
    _, _, calls = run_recorded(model, random_tokens(8, seed=2))
    for layer, call in calls.items():
        assert adapter.logit_scale == pytest.approx(call["scaling"])
        assert adapter.softcap == call["softcap"]
        passed = call["sliding_window"]
        assert adapter.sliding_window(layer) == (passed if passed and passed < adapter.max_context else None)
    kinds = [adapter.layer_kind(layer) for layer in range(adapter.num_layers)]
    if model_type in ("ministral", "olmo3", "gemma3_text", "gemma3"):
        assert kinds[:3] == [f"sliding {WINDOW}", f"sliding {WINDOW}", "global"]
    elif model_type == "gemma2":
        assert kinds[:2] == [f"sliding {WINDOW}", "global"]
    elif model_type == "smollm3":
        assert kinds[3] == kinds[5] == "global, no RoPE" and kinds[2] == "global"
    else:
        assert set(kinds) == {"global"}


# ------------------------------------------------------------------------------------ the engine
def engine_for(family, **settings) -> InfiniGenEngine:
    _, model, skew = family
    return InfiniGenEngine(model, None, EngineConfig(**settings), skew_set=skew, fingerprint="tiny")


def teacher_forced(engine) -> torch.Tensor:
    first = engine.prefill(PROMPT)
    return torch.cat([first.unsqueeze(0), engine.score(CONTINUATION)])


def test_the_full_policy_gives_the_models_own_logits(family):
    """Sliding windows, soft-capping, NoPE layers and scalings as the family's own attention applies them."""
    _, model, _ = family
    expected, _, _ = run_recorded(model, PROMPT + CONTINUATION)
    with engine_for(family, policy="full", prefill_chunk=32) as engine:
        actual = teacher_forced(engine)
    torch.testing.assert_close(actual, expected[len(PROMPT) - 1 :].float(), rtol=0, atol=2e-4)


def test_infinigen_at_full_budget_equals_full(family):
    model_type, model, _ = family
    adapter = ModelAdapter.for_model(model)
    dense = engine_for(family, policy="full", prefill_chunk=32)
    # a budget covering the context attends densely (tests/test_decode_step.py); here the selecting path itself
    # must be exact when it selects every row
    sparse = engine_for(family, policy="infinigen", budget=1.0, alpha=1e9, min_fetch_tokens=0, prefill_chunk=32,
                        dense_under_budget=False)
    try:
        expected, actual = teacher_forced(dense), teacher_forced(sparse)
        step = [s for s in sparse.history if s.is_decode][-1]
    finally:
        dense.close(), sparse.close()
    sparse_layers = {layer.layer for layer in step.layers if layer.sparse}
    assert sparse_layers == {l for l in range(2, adapter.num_layers) if adapter.is_global(l)}, model_type
    assert all(layer.fetched == layer.context_len for layer in step.layers if layer.sparse)
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_at_the_defaults_infinigen_really_selects_on_global_layers(family):
    """Default settings, except the fetch floor (256 tokens would cover this short context whole). The
    rehearsal must pick tokens that matter: their share of the true attention beats their share of the
    context, which is what a blind pick of the same size would get on average."""
    model_type, model, _ = family
    adapter = ModelAdapter.for_model(model)
    with engine_for(family, min_fetch_tokens=0, record_recall=True) as engine:
        teacher_forced(engine)
        steps = [s for s in engine.history if s.is_decode]
    sparse = [layer for s in steps for layer in s.layers if layer.sparse]
    assert sparse and all(adapter.is_global(layer.layer) for layer in sparse)
    assert all(layer.fetched < layer.context_len for layer in sparse), model_type
    recall = sum(layer.attention_recall for layer in sparse) / len(sparse)
    fetched = sum(layer.fetched_ratio for layer in sparse) / len(sparse)
    assert recall > fetched + 0.1, (model_type, recall, fetched)


def test_calibration_completes_with_orthogonal_skews(family):
    model_type, model, skew = family
    adapter = ModelAdapter.for_model(model)
    assert len(skew.skews) == adapter.num_layers
    for matrix in skew.skews:
        assert matrix.shape == (adapter.num_kv_heads, adapter.head_dim, adapter.head_dim)
        assert torch.isfinite(matrix).all() and is_orthogonal(matrix), model_type


def test_a_nope_layer_is_calibrated_without_rope():
    """SmolLM3's layer 3 has no RoPE: the same tokens at other positions give the same skew there, while a
    RoPE layer's changes."""
    model = build("smollm3")
    tokens = random_tokens(64, seed=5, vocab=VOCAB)
    at_zero = calibrate(model, tokens)
    shifted = _calibrate_at(model, tokens, first_position=300)
    torch.testing.assert_close(shifted.skews[3].abs(), at_zero.skews[3].abs(), atol=1e-3, rtol=0)
    assert not torch.allclose(shifted.skews[2].abs(), at_zero.skews[2].abs(), atol=1e-3)


def _calibrate_at(model, tokens, first_position):
    forward = model.forward

    def shifted(*args, position_ids, **kwargs):  # calibration numbers positions from 0: shift them for this call
        return forward(*args, position_ids=position_ids + first_position, **kwargs)

    model.forward = shifted
    try:
        return calibrate(model, tokens)
    finally:
        del model.forward


def test_an_unknown_family_is_refused_with_the_supported_list():
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError) as error:
        ModelAdapter.for_model(model)
    assert "'gpt2'" in str(error.value)
    for name in ("qwen3 (Qwen3)", "phi3 (Phi-3/Phi-4)", "gemma3_text (Gemma 3 (text))", "smollm3", "granite"):
        assert name in str(error.value)


def test_the_panels_and_the_inspector_say_which_layers_slide():
    from ui import inspector, panels

    model = build("gemma3_text")
    with InfiniGenEngine(model, None, EngineConfig(min_fetch_tokens=0),
                         skew_set=calibrate(model, random_tokens(100, seed=1, vocab=VOCAB)), fingerprint="tiny") as engine:
        teacher_forced(engine)
        data = panels.collect(engine)
        assert data.sliding_layers() == [0, 1, 3, 4]
        assert data.latest_ratio[2] < 1 and data.latest_ratio[5] < 1  # the global layers selected
        caption = panels.fetch_table(data)[1]
        assert "global layers 2, 5: a selection" in caption and "sliding-window layers 0, 1, 3, 4: read their last " \
            f"{WINDOW} tokens" in caption
        page = inspector.render(engine, 0, 3)
        assert "sliding-window layer" in page and f"last {WINDOW} tokens" in page and "global layer: 2, 5" in page


# ------------------------------------------------------------------------------------ loading by name
def save_tiny_checkpoint(model_type: str, directory: Path) -> Path:
    """A tiny random model of the family plus a word-level tokenizer built here (nothing from a hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 4)]
    core = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", pad_token="<pad>",
                                        bos_token="<s>", eos_token="</s>")
    build(model_type).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def run_cli(*args, env=None):
    """`python -m infinigen_core generate ARGS`, eager and without the CPU kernels: in a fresh cache directory
    each would be built first (about a minute on 2 cores), and both have their own tests."""
    command = [sys.executable, "-m", "infinigen_core", "generate", "--no-compile", "--no-cpu-kernels", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


PROMPT_TEXT = " ".join(f"w{i % 90}" for i in range(60))


def test_the_cli_runs_a_gemma3_checkpoint_directory(tmp_path):
    checkpoint = save_tiny_checkpoint("gemma3_text", tmp_path / "tiny-gemma3")
    result = run_cli("--model", str(checkpoint), "--prompt", PROMPT_TEXT, "--max-new-tokens", "6", "--device", "cpu",
                     "--min-fetch-tokens", "0", "--json", "--cache-dir", str(tmp_path / "cache"))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["model"] == "tiny-gemma3" and report["new_tokens"] == 6 and report["prompt_tokens"] == 60
    assert 0 < report["fetched_ratio"] < 1  # global layers 2 and 5 selected, the sliding ones did not count
    assert report["layer_kinds"] == [f"sliding {WINDOW}", f"sliding {WINDOW}", "global"] * 2
    assert report["dtype"] == "float32"
    assert "Calibrating" in result.stderr


def fake_hub_cache(root: Path, repo_id: str, model_type: str) -> Path:
    """huggingface_hub's cache layout: models--ORG--NAME/{refs/main, snapshots/REV/...}."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = root / f"models--{repo_id.replace('/', '--')}"
    save_tiny_checkpoint(model_type, repo / "snapshots" / revision)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    return root


def test_a_hub_id_resolves_from_the_local_hub_cache_offline(tmp_path):
    hub = fake_hub_cache(tmp_path / "hub", "tiny-org/Tiny-Qwen3", "qwen3")
    env = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    result = run_cli("--model", "tiny-org/Tiny-Qwen3", "--prompt", PROMPT_TEXT, "--max-new-tokens", "3",
                     "--device", "cpu", "--json", "--cache-dir", str(tmp_path / "cache"), env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["model"] == "tiny-org/Tiny-Qwen3"
    missing = run_cli("--model", "Qwen/Qwen3-8B", "--prompt", "hi", "--device", "cpu", env=env)
    assert missing.returncode == 2
    assert "Qwen/Qwen3-8B is neither a local path nor in the local Hugging Face cache" in missing.stderr
    assert "hf download Qwen/Qwen3-8B" in missing.stderr and str(hub) in missing.stderr


def test_the_model_picker_lists_supported_models_in_the_hub_cache(tmp_path, monkeypatch):
    from infinigen_core.hub import cached_hub_models

    hub = fake_hub_cache(tmp_path / "hub", "tiny-org/Tiny-Phi", "phi3")
    fake_hub_cache(hub, "tiny-org/Tiny-Olmo2", "olmo2")
    (hub / "models--someone--gpt2-thing" / "refs").mkdir(parents=True)  # an incomplete download: not listed
    sharded = fake_hub_cache(hub, "tiny-org/Tiny-Sharded", "llama") / "models--tiny-org--Tiny-Sharded"
    snapshot = next((sharded / "snapshots").iterdir())
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}))  # a shard is missing
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert cached_hub_models() == ["tiny-org/Tiny-Olmo2", "tiny-org/Tiny-Phi"]


@pytest.mark.parametrize("stored,device,model_type,expected", [
    ("bfloat16", "cuda", "llama", torch.bfloat16), (torch.bfloat16, "cuda", "llama", torch.bfloat16),
    ("float16", "cuda", "llama", torch.float16), ("float32", "cuda", "llama", torch.float16),
    ("bfloat16", "cpu", "llama", torch.float32), ("float16", "cpu", "llama", torch.float32),
    # Gemma overflows fp16: a dequantised GGUF (float32) or an fp16 checkpoint computes in bf16 on a GPU
    ("float32", "cuda", "gemma3_text", torch.bfloat16), ("float16", "cuda", "gemma2", torch.bfloat16),
    ("float32", "cpu", "gemma3_text", torch.float32),
])
def test_precision_follows_the_checkpoint(monkeypatch, stored, device, model_type, expected):
    from infinigen_core.loading import compute_dtype, quantization_settings

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    dtype = compute_dtype(stored, torch.device(device), model_type)
    assert dtype == expected
    assert quantization_settings("4bit", dtype).bnb_4bit_compute_dtype == dtype


def test_gemma_falls_back_to_fp16_on_a_gpu_without_bf16(monkeypatch):
    from infinigen_core.loading import compute_dtype

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    assert compute_dtype("float32", torch.device("cuda"), "gemma3_text") == torch.float16


def test_a_download_reports_its_bytes_to_the_status_line():
    from infinigen_core.hub import reporting_tqdm

    messages = []
    bar_class = reporting_tqdm("Qwen/Qwen3-8B", messages.append, every_s=0.0)
    with bar_class(total=2_000_000_000, unit="B", disable=False) as bar:
        bar.update(500_000_000)
    with bar_class(total=3, desc="Fetching 3 files") as files:  # not a byte count: not reported
        files.update(1)
    assert messages == ["Downloading Qwen/Qwen3-8B: 0.50 of 2.00 GB"]
