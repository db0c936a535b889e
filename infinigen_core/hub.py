"""Hub ids such as `Qwen/Qwen3-8B`: found in huggingface_hub's local cache, or downloaded when online.

The cache is $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub, read when asked. Only when a
model is missing there, and HF_HUB_OFFLINE is not set, is it downloaded (config, tokenizer and safetensors
files; huggingface_hub's progress bars on the terminal, and the bytes through the caller's `progress`).
Nothing here imports torch or huggingface_hub at import time, so `app.py` can decide on HF_HUB_OFFLINE
from its flags before either library reads it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

Progress = Callable[[str], None]


class ModelLoadError(RuntimeError):
    """A model cannot be found or loaded; the message says what to do."""


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def names_a_hub_model(model: str | None) -> bool:
    """`model` is a hub id (`org/name`) and not an existing local path."""
    return bool(model) and not Path(model).expanduser().exists() and bool(HUB_ID.match(model))


def hub_cache_dir() -> Path:
    """huggingface_hub's cache, read from the environment when asked (not when the library was imported)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface")
    return Path(home) / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _has_weights(snapshot: Path) -> bool:
    """config.json and every safetensors shard (an interrupted download leaves some out)."""
    if not (snapshot / "config.json").exists():
        return False
    index = snapshot / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            return False
        return all((snapshot / shard).exists() for shard in shards)
    return any(snapshot.glob("*.safetensors"))


def resolve_hub_id(repo_id: str, progress: Progress = print) -> Path:
    """The local snapshot directory of a hub model: from the cache, else downloaded (unless offline)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    how = (f"download it first with `hf download {repo_id}` (from the huggingface_hub package) on a machine "
           f"that reaches huggingface.co, into {cache}, or pass --model with a local directory")
    try:
        snapshot = Path(snapshot_download(repo_id, cache_dir=str(cache), local_files_only=True))
        if _has_weights(snapshot):
            return snapshot
    except LocalEntryNotFoundError:
        pass
    if hub_offline():
        raise ModelLoadError(f"{repo_id} is neither a local path nor in the local Hugging Face cache ({cache}), and "
                             f"HF_HUB_OFFLINE is set, so nothing is downloaded: {how}")
    progress(f"Downloading {repo_id} from the Hugging Face Hub into {cache} (once)...")
    try:
        snapshot = Path(snapshot_download(repo_id, cache_dir=str(cache), allow_patterns=HUB_FILES,
                                          tqdm_class=reporting_tqdm(repo_id, progress)))
    except Exception as error:  # network, unknown id, gated model: huggingface_hub raises many kinds
        raise ModelLoadError(f"could not download {repo_id}: {error}; check the id and the network, or {how}") from error
    if not _has_weights(snapshot):
        raise ModelLoadError(f"{repo_id} has no config.json and safetensors weights to load: pick a "
                             "transformers checkpoint (or pass a .gguf file with --model)")
    return snapshot


def reporting_tqdm(repo_id: str, progress: Progress, every_s: float = 1.0):
    """huggingface_hub's progress bar (still drawn on the terminal) that also reports the bytes downloaded
    through `progress` at most once a second, so the app's status line shows the download too."""
    import time

    from huggingface_hub.utils import tqdm as hub_tqdm

    last_report = [0.0]

    class ReportingTqdm(hub_tqdm):
        def update(self, n=1):
            result = super().update(n)
            now = time.monotonic()
            if self.unit == "B" and self.total and now - last_report[0] >= every_s:
                last_report[0] = now
                progress(f"Downloading {repo_id}: {self.n / 1e9:.2f} of {self.total / 1e9:.2f} GB")
            return result

    return ReportingTqdm


def cached_hub_models() -> list[str]:
    """Hub ids of the supported text models already in the local Hugging Face cache (for the model picker)."""
    from .arch import FAMILIES  # torch: only when the app asks, long after start-up

    cache = hub_cache_dir()
    found = []
    for repo in sorted(cache.glob("models--*--*")):
        ref = repo / "refs" / "main"
        snapshot = repo / "snapshots" / (ref.read_text().strip() if ref.exists() else "")
        if not ref.exists() or not _has_weights(snapshot):
            continue
        try:
            model_type = json.loads((snapshot / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            continue
        if model_type in FAMILIES:
            found.append(repo.name[len("models--"):].replace("--", "/", 1))
    return found
