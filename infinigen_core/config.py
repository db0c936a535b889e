"""Engine and sampling settings: frozen dataclasses, validated in one place.

>>> EngineConfig(policy="infinigen", alpha=4.0, budget=0.2).budget_tokens_for(4000)
800
>>> EngineConfig(budget=0.2).budget_tokens_for(1000)  # the floor: never fewer than 256 tokens
256
>>> parse_pool_limit("512MiB")
('bytes', 536870912)
>>> config, applied = with_family_defaults(EngineConfig(), "gemma3_text", user_settings=["budget"])
>>> config.partial_ratio, config.budget, applied.kept
(1.0, 0.15, ('budget',))
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import dataclass, field, replace

from .policies import POLICIES

POLICY_NAMES = tuple(POLICIES)  # the registry's names, in its order


class ConfigError(ValueError):
    """A setting is out of range; the message says what to change."""


@dataclass(frozen=True)
class EngineConfig:
    """How the KV cache is kept and which past tokens each layer attends to.

    budget: the most past tokens a sparse layer may fetch per step, as a fraction of the context
        (0 < budget <= 1) or, with budget_is_tokens, as a token count.
    min_fetch_tokens: a fractional budget never allows fewer tokens than this, so a short chat (where
        fetching everything costs next to nothing) is not answered from a handful of tokens; 0 turns
        the floor off. A token budget is taken as given.
    alpha: InfiniGen keeps tokens whose rehearsed attention logit is within alpha of the maximum.
    partial_ratio: fraction of each head's channels kept in the partial query/key for speculation.
    The defaults (alpha 12, budget 0.15, partial ratio 0.5) come from the sweep in docs/BENCHMARKS.md: on
    SmolLM2's 64-channel heads the paper's alpha 5 / ratio 0.25 rehearse attention too coarsely.
    dense_layers: the first layers attend densely (their inputs differ too much to speculate from).
    dense_under_budget: while the budget (its floor included) covers every past token, the sparse layers
        attend densely and skip speculation, since a selection would keep every token anyway; False keeps
        the selecting path at any length (to measure or test it).
    pool_limit_tokens: optional cap on the host KV pool; beyond it entries are evicted by fetch rate,
        sparing `sink_tokens` attention sinks and the `recent_window` newest tokens.
    dense_layers_on_device: where the pool is in host memory (a GPU), a sparse policy's layers that read
        every row (the dense first layers, sliding-window layers) keep their K/V on the compute device as
        well, so a step moves only the sparse layers' selected rows (FlexGen fetches them whole each step).
    selected_rows_cache: where the pool is in host memory, each sparse layer keeps this many recently
        fetched rows per KV head on the compute device, and a row selected again is not fetched again
        (0: no cache).
    zero_copy_fetch: where the pool is in pinned host memory (a GPU), the compute device gathers a sparse
        layer's selected rows from it in place (zero_copy.py: no host gather, no host round trip) once a
        probe at load agreed with the staged path; False, or a failed probe, gathers them on the host and
        copies them up (the staged path). Layers under `selected_rows_cache` and a limited pool stay staged.
    selects_ahead: whether a selecting layer's rows are rehearsed one layer ahead, from the previous layer's
        input (InfiniGen's pipeline, which overlaps their fetch with that layer's work), or chosen with the
        layer's own query. None (the default): ahead only where the pool is apart from the compute device,
        since where they share memory nothing is fetched and the own query is the true one; True rehearses
        ahead on the CPU too (to compare it with the GPU path).
    budget_by_layer: InfiniGen spreads a fractional budget over its sparse layers by how flat each layer's
        attention was at calibration (budget_shares.py): a flat layer fetches more, a peaked one less, all of
        them together no more than the uniform budget; False gives every sparse layer the same budget.
    budget_by_head: InfiniGen's KV heads of a sparse layer draw their rows from one budget (kv_heads x k): the
        rows with the largest rehearsed weights across the layer's heads, at most `HEAD_SHARE_CAP` times k for
        one head, so a head whose query group spreads its attention reads more than one that looks at a few
        tokens. Only where the CPU kernels read the rows where they lie (float32 rows, no soft-capping, no pool
        limit); where rows are gathered or copied to the compute device every head's copy would carry its most
        rows, so there each head reads k. False: k rows in every head. Where InfiniGen's alpha rank cuts a
        selection, a head reads the smaller of its share and the alpha count.
    """

    policy: str = "infinigen"
    alpha: float = 12.0
    budget: float = 0.15
    budget_is_tokens: bool = False
    min_fetch_tokens: int = 256
    partial_ratio: float = 0.5
    dense_layers: int = 2
    dense_under_budget: bool = True
    pool_limit_tokens: int | None = None
    sink_tokens: int = 4
    recent_window: int = 64
    prefill_chunk: int = 512
    record_recall: bool = False
    history_steps: int = 64
    dense_layers_on_device: bool = True
    selected_rows_cache: int = 0
    zero_copy_fetch: bool = True
    selects_ahead: bool | None = None
    budget_by_layer: bool = True
    budget_by_head: bool = True

    def __post_init__(self) -> None:
        if self.selects_ahead not in (None, True, False):
            raise ConfigError(f"selects_ahead must be true, false or unset, got {self.selects_ahead!r}")
        if self.policy not in POLICY_NAMES:
            raise ConfigError(f"unknown policy {self.policy!r}: choose one of {', '.join(POLICY_NAMES)}")
        if not (self.alpha > 0) or math.isnan(self.alpha):
            raise ConfigError(f"alpha must be a positive number (default 12; the paper uses 4-5), got {self.alpha}")
        if self.budget_is_tokens:
            if self.budget < 1 or self.budget != int(self.budget):
                raise ConfigError(f"a token budget must be a whole number >= 1, got {self.budget}")
        elif not (0 < self.budget <= 1):
            raise ConfigError(
                f"budget must be a fraction of the context in (0, 1] or a token count >= 2, got {self.budget}"
            )
        if self.min_fetch_tokens < 0 or self.min_fetch_tokens != int(self.min_fetch_tokens):
            raise ConfigError(f"min_fetch_tokens must be a whole number >= 0 (0: no floor), got {self.min_fetch_tokens}")
        object.__setattr__(self, "min_fetch_tokens", int(self.min_fetch_tokens))  # 256.0 from a form is 256
        if not (0 < self.partial_ratio <= 1):
            raise ConfigError(f"partial ratio must be in (0, 1] (the paper uses 0.2-0.3), got {self.partial_ratio}")
        if self.dense_layers < 1:
            raise ConfigError("dense_layers must be at least 1: across devices the selection for layer i is "
                              "rehearsed from layer i-1's input, so layer 0 has none")
        if self.sink_tokens < 0 or self.recent_window < 1:
            raise ConfigError("sink_tokens must be >= 0 and recent_window >= 1")
        if self.prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be >= 1, got {self.prefill_chunk}")
        if self.pool_limit_tokens is not None:
            protected = self.sink_tokens + self.recent_window
            if self.pool_limit_tokens <= protected:
                raise ConfigError(
                    f"pool limit of {self.pool_limit_tokens} tokens is not larger than the protected window "
                    f"({self.sink_tokens} sink + {self.recent_window} recent tokens): raise the limit above "
                    f"{protected} or shrink the window"
                )
        if self.history_steps < 1:
            raise ConfigError("history_steps must be >= 1")
        if self.selected_rows_cache < 0 or self.selected_rows_cache != int(self.selected_rows_cache):
            raise ConfigError(f"selected_rows_cache must be a whole number of rows >= 0 (0: off), got "
                              f"{self.selected_rows_cache}")
        for name in ("budget_by_layer", "budget_by_head"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.zero_copy_fetch, bool):
            raise ConfigError(f"zero_copy_fetch must be True or False, got {self.zero_copy_fetch!r}")

    def budget_tokens_for(self, context_len: int) -> int:
        """The fetch cap for a layer whose past holds `context_len` tokens (at least 1)."""
        if self.budget_is_tokens:
            cap = int(self.budget)
        else:
            cap = max(int(math.ceil(self.budget * context_len - 1e-9)), self.min_fetch_tokens)
        return max(1, min(cap, context_len))

    def with_changes(self, **changes) -> "EngineConfig":
        return replace(self, **changes)


@dataclass(frozen=True)
class SamplingConfig:
    """Decoding settings; temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    max_new_tokens: int = 256
    stop_strings: tuple[str, ...] = field(default_factory=tuple)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0 or math.isnan(self.temperature):
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise ConfigError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


# ------------------------------------------------------------------------------------ per-family defaults
# EngineConfig's defaults were tuned on SmolLM2 (64-channel heads). A family measured to want others gets them
# here, and only here: load_engine applies them to every setting the user did not choose (a CLI flag, the
# app's settings), and says so (the model summary, `AppliedDefaults.describe`).
TUNABLE_SETTINGS = ("alpha", "budget", "min_fetch_tokens", "partial_ratio", "dense_layers")  # budget: its kind too
SETTING_LABELS = {"alpha": "alpha", "budget": "budget", "min_fetch_tokens": "fetch at least",
                  "partial_ratio": "partial ratio", "dense_layers": "dense layers"}


@dataclass(frozen=True)
class FamilyDefaults:
    """The settings one family's checkpoints take instead of EngineConfig's, and the measurement behind them.

    model_types: the `model_type` values of the family's configs (read from the loaded model, never its path).
    settings: (name, value) pairs, names from TUNABLE_SETTINGS, values EngineConfig accepts (checked here).
    spreads_budget: False where the family reads its budget uniformly (EngineConfig.budget_by_layer off).
    """

    label: str
    model_types: tuple[str, ...]
    settings: tuple[tuple[str, float], ...]
    evidence: str
    spreads_budget: bool = True

    def __post_init__(self) -> None:
        if not self.model_types:
            raise ConfigError(f"{self.label}: a family's defaults need at least one model_type")
        unknown = [name for name, _ in self.settings if name not in TUNABLE_SETTINGS]
        if unknown or not self.settings:
            raise ConfigError(f"{self.label}: settings must be some of {', '.join(TUNABLE_SETTINGS)}, got "
                              f"{', '.join(unknown) or 'none'}")
        EngineConfig().with_changes(**self.values())  # a value out of range fails here, at import, with EngineConfig's message

    def values(self) -> dict[str, float]:
        return dict(self.settings)


FAMILY_DEFAULTS: tuple[FamilyDefaults, ...] = (
    FamilyDefaults(
        "Gemma 3", ("gemma3_text", "gemma3"), (("partial_ratio", 1.0), ("budget", 0.1)),
        "on gemma-3-270m, 0.1% from full's perplexity at 4k tokens, +2.75% at the general defaults; at 16k "
        "+0.79% with the budget uniform over its global layers, +1.09% spread (docs/BENCHMARKS.md, Gemma 3 270M)",
        spreads_budget=False),
)


def check_family_table(table: tuple[FamilyDefaults, ...]) -> None:
    seen: dict[str, str] = {}
    for family in table:
        for model_type in family.model_types:
            if model_type in seen:
                raise ConfigError(f"model_type {model_type!r} has defaults twice: {seen[model_type]} and {family.label}")
            seen[model_type] = family.label


check_family_table(FAMILY_DEFAULTS)


def family_defaults(model_type: str | None) -> FamilyDefaults | None:
    """The defaults of the family whose configs carry `model_type` (None: EngineConfig's own)."""
    return next((family for family in FAMILY_DEFAULTS if model_type in family.model_types), None)


@dataclass(frozen=True)
class AppliedDefaults:
    """What a family's defaults did to one configuration: the settings they gave, and those the user chose."""

    family: FamilyDefaults
    applied: tuple[tuple[str, float], ...]
    kept: tuple[str, ...]  # the family's settings the user had chosen: theirs won
    uniform_budget: bool = False  # the family's budget read uniformly over the layers (FamilyDefaults.spreads_budget)

    def describe(self) -> str:
        """'Gemma 3 defaults: partial ratio 1, budget 0.1 (why)'; the user's choices that won are named."""
        given = ", ".join([f"{SETTING_LABELS[name]} {value:g}" for name, value in self.applied]
                          + (["the budget uniform over the layers"] if self.uniform_budget else []))
        kept = ", ".join(SETTING_LABELS[name] for name in self.kept)
        text = f"{self.family.label} defaults: {given or 'none applied'}"
        text += f"; yours kept: {kept}" if kept else ""
        return f"{text} ({self.family.evidence})"


def with_family_defaults(config: EngineConfig, model_type: str | None,
                         user_settings: Collection[str] = ()) -> tuple[EngineConfig, AppliedDefaults | None]:
    """`config` with the defaults of `model_type`'s family in every tunable setting not in `user_settings` (the
    names the user chose); (config, None) for a family without defaults of its own."""
    family = family_defaults(model_type)
    if family is None:
        return config, None
    unknown = set(user_settings) - set(TUNABLE_SETTINGS)
    if unknown:
        raise ConfigError(f"not a tunable setting: {', '.join(sorted(unknown))}; use {', '.join(TUNABLE_SETTINGS)}")
    applied = tuple((name, value) for name, value in family.settings if name not in user_settings)
    changes: dict = dict(applied)
    if "budget" in changes:
        changes["budget_is_tokens"] = False  # a family's budget is a fraction
    uniform = not family.spreads_budget and "budget" not in user_settings  # with the family's budget, not yours
    if uniform:
        changes["budget_by_layer"] = False
    kept = tuple(name for name, _ in family.settings if name in user_settings)
    return config.with_changes(**changes), AppliedDefaults(family, applied, kept, uniform)


BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
              "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30, "gib": 2**30, "t": 2**40, "tib": 2**40}
_TOKEN_UNITS = ("", "t", "tok", "tokens")  # in a pool limit, a bare number or these mean tokens


def split_size(text: str) -> tuple[float, str] | None:
    """'512 MiB' -> (512.0, 'mib'); None when `text` is not a number with an optional unit."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    return (float(match.group(1)), match.group(2).lower()) if match else None


def parse_pool_limit(text: str | int | None) -> tuple[str, int] | None:
    """'8192' or '8192t' -> ('tokens', 8192); '512MiB', '2GB' -> ('bytes', n); None/'' -> None."""
    if text is None or text == "":
        return None
    if isinstance(text, int):
        return ("tokens", text)
    parsed = split_size(text)
    if parsed is None:
        raise ConfigError(f"pool limit {text!r} is not a size: use a token count like 8192 or bytes like 512MiB")
    number, unit = parsed
    if unit in _TOKEN_UNITS:
        return ("tokens", int(number))
    if unit not in BYTE_UNITS:
        raise ConfigError(f"unknown size unit {unit!r} in pool limit {text!r}: use tokens, KiB, MiB, GiB, KB, MB or GB")
    return ("bytes", int(number * BYTE_UNITS[unit]))


def pool_limit_tokens(text: str | int | None, bytes_per_token: int) -> int | None:
    """A pool limit as a token count: '8192' -> 8192; '64MiB' -> 64 MiB // bytes per token of the model."""
    parsed = parse_pool_limit(text)
    if parsed is None:
        return None
    kind, amount = parsed
    if kind == "tokens":
        return amount
    tokens = amount // bytes_per_token
    if tokens < 1:
        raise ConfigError(f"pool limit {text!r} holds no token at all ({bytes_per_token} bytes each): raise it")
    return tokens


def parse_budget(text: str | float) -> tuple[float, bool]:
    """'0.2' -> (0.2, False) a fraction; '256' -> (256.0, True) a token count."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ConfigError(f"budget {text!r} is not a number: use a fraction like 0.2 or a token count like 256")
    if value > 1:
        return value, True
    return value, False
