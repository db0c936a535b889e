"""What every benchmark shares: reading text, running tokens through the decode path, tables and JSON.

    ids = load_token_ids(engine.tokenizer, "essays/", 4096)   # a file, or every .txt under a directory
    run = decode_tokens(engine, ids[2048:])                     # the chat decode path, one token a step
    print(format_table([{"policy": "full", "ppl": 12.3}], ["policy", "ppl"]))
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from infinigen_core import EngineConfig
from infinigen_core.calibration import calibration_text
from infinigen_core.policies import POLICIES


class EvalError(ValueError):
    """Bad input to a benchmark (missing text, too short, unknown policy); the message says what to change."""


# ---------------------------------------------------------------------------------------------- text
def read_text(path: str | Path) -> str:
    """A UTF-8 file, or every *.txt file under a directory (sorted by name) joined by blank lines."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise EvalError(f"no .txt files under {path}")
        return "\n\n".join(p.read_text(encoding="utf-8") for p in files)
    if not path.is_file():
        raise EvalError(f"text {path} does not exist: pass a UTF-8 file or a directory of .txt files")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise EvalError(f"{path} is not UTF-8 text ({error})") from None


def load_token_ids(tokenizer, text: str, needed: int, source: str | Path = "the text") -> list[int]:
    """The text's token ids; at least `needed` of them, or an error that says how many there are."""
    ids = tokenizer(text)["input_ids"]
    if len(ids) < needed:
        raise EvalError(f"{source} holds {len(ids)} tokens but {needed} are needed: pass a longer text or a smaller context")
    return list(ids)


def repeated_token_ids(tokenizer, text: str | None, needed: int) -> list[int]:
    """The token ids of `text` (default: the shipped calibration text), repeated until at least `needed`."""
    text = text or calibration_text()
    ids = tokenizer(text)["input_ids"]
    while len(ids) < needed:  # the shipped calibration text is short: repeat it
        text += "\n\n" + text
        ids = tokenizer(text)["input_ids"]
    return list(ids)


def windows(ids: Sequence[int], length: int, count: int) -> list[list[int]]:
    """Up to `count` non-overlapping slices of `length` tokens, spread evenly over the text."""
    available = len(ids) // length
    if available < 1:
        raise EvalError(f"the text holds {len(ids)} tokens, fewer than one window of {length}")
    count = min(count, available)
    stride = len(ids) // count
    return [list(ids[i * stride : i * stride + length]) for i in range(count)]


# ---------------------------------------------------------------------------------------------- policies
def parse_policies(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in POLICIES]
    if not names or unknown:
        raise EvalError(f"unknown policy {', '.join(unknown) or '(none given)'}: choose from {', '.join(POLICIES)}")
    return names


def parse_numbers(text: str, kind: type = float) -> list:
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise EvalError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values:
        raise EvalError("an empty list of numbers")
    return values


def needs_prefill_state(policy: str) -> bool:
    """H2O scores tokens by the attention they received during prefill, so it must run its own prefill."""
    return POLICIES[policy].needs_attention_weights


def load_prefix(engine, config: EngineConfig, prefix: list[int], progress=None) -> float:
    """Make the engine hold exactly `prefix` under `config`; returns the prefill seconds (0 when reused).

    Prefill is dense under every policy, so the cached K/V of a prefix can be shared between policies;
    only a policy that learns from the prefill's attention (H2O) gets a fresh one.
    """
    fresh = needs_prefill_state(config.policy) or needs_prefill_state(engine.config.policy)
    if fresh:
        engine.reset()
    engine.configure(config)
    started = time.perf_counter()
    ran = engine.sync_to(prefix, progress)
    return time.perf_counter() - started if ran is not None else 0.0


# ---------------------------------------------------------------------------------------------- decoding
@dataclass
class DecodeRun:
    """What feeding tokens one decode step at a time produced."""

    logits: torch.Tensor  # [n, vocab]: logits[i] predicts the token after tokens[i]
    step_ms: list[float] = field(default_factory=list)
    fetched_ratios: list[float] = field(default_factory=list)  # over all layers (dense layers count 1.0)
    sparse_fetched_ratios: list[float] = field(default_factory=list)  # over the sparse layers only
    layer_recall: dict[int, list[float]] = field(default_factory=dict)

    @property
    def ms_per_token(self) -> float:
        return statistics.fmean(self.step_ms) if self.step_ms else float("nan")

    @property
    def fetched_ratio(self) -> float:
        return statistics.fmean(self.fetched_ratios) if self.fetched_ratios else float("nan")

    @property
    def sparse_fetched_ratio(self) -> float:
        return statistics.fmean(self.sparse_fetched_ratios) if self.sparse_fetched_ratios else float("nan")


def all_layer_fetched_ratio(step) -> float:
    """KV rows read over KV rows cached, averaged over every layer: what a step really had to touch."""
    ratios = [layer.fetched_ratio for layer in step.layers]
    return sum(ratios) / len(ratios) if ratios else 1.0


def synchronize(device: torch.device) -> None:
    """Wait for the device, so a timed step ends when its work does (a GPU runs behind the host)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_tokens(engine, tokens: Sequence[int]) -> DecodeRun:
    """Append `tokens` one decode step each (exactly what `engine.score` does) and keep each step's stats."""
    logits, run = [], DecodeRun(logits=torch.empty(0))
    for token in tokens:
        started = time.perf_counter()
        logits.append(engine.decode(int(token)))
        synchronize(engine.device)
        run.step_ms.append((time.perf_counter() - started) * 1e3)
        step = engine.history[-1]
        run.fetched_ratios.append(all_layer_fetched_ratio(step))
        run.sparse_fetched_ratios.append(step.fetched_ratio())
        for layer in step.layers:
            if layer.attention_recall is not None:
                run.layer_recall.setdefault(layer.layer, []).append(layer.attention_recall)
    run.logits = torch.stack(logits) if logits else torch.empty(0)
    return run


def mean_nll(logits: torch.Tensor, targets: Sequence[int]) -> tuple[float, int]:
    """(sum of negative log-likelihoods, count) of `targets` under `logits` [n, vocab]."""
    target = torch.tensor(list(targets), dtype=torch.long)
    nll = torch.nn.functional.cross_entropy(logits.float(), target, reduction="sum")
    return float(nll), len(targets)


# ---------------------------------------------------------------------------------------------- output
def _cell(value) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.4g}" if abs(value) < 10 else f"{value:.2f}"
    return "-" if value is None else str(value)


def format_table(rows: list[dict], columns: list[str]) -> str:
    """Rows of dicts as an aligned plain-text table (also valid Markdown)."""
    cells = [[_cell(row.get(column)) for column in columns] for row in rows]
    widths = [max([len(column)] + [len(line[i]) for line in cells]) for i, column in enumerate(columns)]
    header = "| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |" for line in cells]
    return "\n".join([header, rule, *body])


def to_json(result: dict) -> str:
    """One JSON line; NaN becomes null so any JSON reader accepts it."""
    def clean(value):
        if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
            return None
        if isinstance(value, dict):
            return {str(k): clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean(result))


def machine_description() -> dict:
    """Where a benchmark ran: CPU model and cores, torch version, CUDA device if any."""
    import platform

    import psutil

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": psutil.cpu_count(logical=True),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "torch": torch.__version__,
        "cuda_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
