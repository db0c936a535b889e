"""Model loading (local checkpoints, bad paths, foreign architectures) and the command line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from infinigen_core.arch import UnsupportedModelError
from infinigen_core.config import ConfigError, EngineConfig, pool_limit_tokens
from infinigen_core.loading import ModelLoadError, load_engine, model_fingerprint

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "infinigen_core", "generate", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("settings,message", [
    ({"alpha": -1}, "alpha"), ({"budget": 1.5}, "budget"), ({"budget": 0}, "budget"),
    ({"partial_ratio": 0}, "partial ratio"), ({"policy": "magic"}, "unknown policy"),
    ({"budget": 2.5, "budget_is_tokens": True}, "whole number"), ({"min_fetch_tokens": -1}, "min_fetch_tokens"),
])
def test_invalid_settings_say_what_to_change(settings, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**settings)


def test_a_fractional_budget_has_a_floor_and_a_token_budget_does_not():
    floored = EngineConfig(budget=0.15, min_fetch_tokens=256)
    assert [floored.budget_tokens_for(n) for n in (100, 1000, 4000)] == [100, 256, 600]
    assert EngineConfig(budget=0.15, min_fetch_tokens=0).budget_tokens_for(1000) == 150
    assert EngineConfig(budget=64, budget_is_tokens=True, min_fetch_tokens=256).budget_tokens_for(1000) == 64


def test_pool_limits_in_bytes_and_tokens():
    assert pool_limit_tokens("8192", 100) == 8192
    assert pool_limit_tokens("1MiB", 1024) == 1024
    assert pool_limit_tokens(None, 1024) is None
    for bad in ("lots", "12 parsecs", "10B"):
        with pytest.raises(ConfigError):
            pool_limit_tokens(bad, 1024)


def test_missing_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_engine(str(tmp_path / "nope"), device="cpu", cache_dir=tmp_path, progress=lambda m: None)
    (tmp_path / "weights.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_engine(str(tmp_path / "weights.bin"), device="cpu", cache_dir=tmp_path, progress=lambda m: None)
    (tmp_path / "broken.gguf").write_bytes(b"GGUF-but-not-really")
    with pytest.raises(ModelLoadError, match="could not read GGUF"):
        load_engine(str(tmp_path / "broken.gguf"), device="cpu", cache_dir=tmp_path, progress=lambda m: None)


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(UnsupportedModelError, match=r"llama \(Llama 2/3.x\), mistral.*qwen3 \(Qwen3\)"):
        load_engine(str(tmp_path / "gpt2"), device="cpu", cache_dir=tmp_path, progress=lambda m: None)


def load(checkpoint: Path, cache: Path, messages: list[str]):
    """The checkpoint's engine, eager and without the CPU kernels: in a fresh cache each would be built first
    (about a minute on 2 cores), and both have their own tests."""
    return load_engine(str(checkpoint), device="cpu", cache_dir=cache, compile_decode=False, cpu_kernels=False,
                       progress=messages.append)


def test_a_local_llama_checkpoint_loads_calibrates_once_and_generates(tmp_path, real_engine):
    torch.manual_seed(0)
    checkpoint = tmp_path / "tiny-llama"
    config = LlamaConfig(vocab_size=len(real_engine.tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                         max_position_embeddings=4096)
    LlamaForCausalLM(config).save_pretrained(checkpoint)
    real_engine.tokenizer.save_pretrained(checkpoint)
    messages = []
    with load(checkpoint, tmp_path / "cache", messages) as engine:
        assert any("Calibrating" in m for m in messages)
        assert engine.model_name == "tiny-llama" and engine.adapter.num_kv_heads == 1
        engine.prefill(engine.tokenizer("hello there")["input_ids"])
        engine.decode(5)
    messages.clear()
    load(checkpoint, tmp_path / "cache", messages).close()
    assert not any("Calibrating" in m for m in messages)  # the skew cache was reused
    # a skew an earlier version cached under the model's older fingerprint is found and renamed, not redone
    (skew_file,) = (tmp_path / "cache" / "skew").iterdir()
    legacy_name = skew_file.name.replace(engine.fingerprint, engine.legacy_fingerprints[0])
    skew_file.rename(skew_file.with_name(legacy_name))
    load(checkpoint, tmp_path / "cache", messages).close()
    assert not any("Calibrating" in m for m in messages)
    assert [f.name for f in (tmp_path / "cache" / "skew").iterdir()] == [skew_file.name]


def test_the_fingerprint_follows_the_weights_not_the_path_or_how_they_were_read(tmp_path, tiny_llama):
    # A GGUF is read from its file the first time and from its dequantised copy afterwards; saved sessions
    # are keyed by the fingerprint, so both readings (and a moved checkpoint) must agree.
    model, _ = tiny_llama
    model.save_pretrained(tmp_path / "here")
    model.save_pretrained(tmp_path / "moved")
    here, moved = (LlamaForCausalLM.from_pretrained(tmp_path / name) for name in ("here", "moved"))
    assert model_fingerprint(here) == model_fingerprint(moved) == model_fingerprint(model)
    moved.config.quantization_config = {"quant_method": "gguf", "gguf_file": "x.gguf", "dequantize": False}
    assert model_fingerprint(moved) == model_fingerprint(here)
    with torch.no_grad():
        moved.model.layers[-1].self_attn.k_proj.weight[0, 0] += 1e-3
    assert model_fingerprint(moved) != model_fingerprint(here)
    moved.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    assert model_fingerprint(moved) != model_fingerprint(here)


@pytest.mark.parametrize("args, message", [
    (["--prompt", "hi", "--alpha", "-2"], "alpha must be a positive number"),
    (["--prompt", "hi", "--pool-limit", "huge"], "pool limit"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "cannot read the prompt file"),
    (["--prompt", "hi", "--model", "/nonexistent/model"], "does not exist"),
    (["--prompt", "hi", "--device", "cpu", "--quantize", "8bit"], "need a CUDA device"),
])
def test_cli_rejects_bad_input_before_loading_anything(args, message, capsys, monkeypatch):
    """The command's own entry point, in this process (test_cli_generates_and_reports_json runs it as a
    process): exit status 2 and the reason, and no model read."""
    from infinigen_core import cli, loading

    for reader in ("ensure_packaged_gguf", "_load_gguf", "_load_checkpoint"):
        monkeypatch.setattr(loading, reader, lambda *a, **k: pytest.fail("a model was read"))
    assert cli.main(["generate", *args]) == 2
    assert message in capsys.readouterr().err


def test_rehearsed_query_is_the_layers_own_query(tiny_llama):
    """Speculation calls the projection module (so 8/4-bit bitsandbytes layers work) and matches its output."""
    from infinigen_core.arch import ModelAdapter

    model, _ = tiny_llama
    adapter = ModelAdapter.for_model(model)
    attention = adapter.attention_modules(model)[1]
    hidden = torch.randn(1, 3, model.config.hidden_size)
    positions = torch.arange(5, 8).unsqueeze(0)
    cos, sin = model.model.rotary_emb(hidden, positions)
    calls = []
    handle = attention.q_proj.register_forward_hook(lambda module, args, output: calls.append(output.shape))
    try:
        query = adapter.rehearse_query(attention, hidden, (cos, sin))
    finally:
        handle.remove()
    assert calls, "the q projection module was bypassed"
    raw = attention.q_proj(hidden[0]).view(3, adapter.num_heads, adapter.head_dim).transpose(0, 1)
    half = adapter.head_dim // 2
    rotated = torch.cat((-raw[..., half:], raw[..., :half]), dim=-1)
    expected = raw * cos[0] + rotated * sin[0]
    torch.testing.assert_close(query, expected)


def test_cli_generates_and_reports_json():
    result = run_cli("--chat", "--prompt", "What is the capital of France?", "--max-new-tokens", "12",
                     "--device", "cpu", "--json", "--pool-limit", "4MiB", "--no-compile")  # compiling: 20-60 s
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert "Paris" in report["text"] and report["text"] in result.stdout  # streamed, then reported
    assert report["policy"] == "infinigen" and report["new_tokens"] >= 1
    assert report["prompt_tokens"] > 10 and 0 < report["fetched_ratio"] <= 1 and report["ms_per_token"] > 0
    assert report["settings"]["pool_limit_tokens"] == 4 * 2**20 // (30 * 2 * 3 * 64 * 4)
