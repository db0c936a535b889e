"""The engine and sampling settings as the user typed them, checked, and applied from the next turn on;
the KV storage settings, applied at once.

    keeper = SettingsKeeper()
    keeper.apply(engine, SettingsForm(policy="h2o", alpha=12, budget="0.3"))   # UserError if bad
    keeper.apply_pending(engine, store, session_id)                            # before the next turn
    keeper.settle(engine)                      # after a load: the model family's defaults where the user chose none

A tunable engine setting (config.TUNABLE_SETTINGS) is the user's once they set it to something other than
what the page showed; until then it follows the loaded model: its family's defaults (config.FAMILY_DEFAULTS),
else EngineConfig's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from infinigen_core import ConfigError, EngineConfig, SamplingConfig
from infinigen_core.config import AppliedDefaults, parse_budget, pool_limit_tokens, with_family_defaults
from sessions import SessionStore, StorageConfig, format_size, parse_size
from sessions.budget import enforce_disk_limit
from sessions.overflow import DEFAULT_OVERFLOW, OVERFLOW_POLICIES, check_overflow

from .errors import UserError


@dataclass
class Settings:
    """The engine and sampling settings as the user typed them (validated by `SettingsKeeper.apply`)."""

    policy: str = EngineConfig.policy
    alpha: float = EngineConfig.alpha
    budget: str = str(EngineConfig.budget)
    partial_ratio: float = EngineConfig.partial_ratio
    pool_limit: str = ""
    inspect: bool = False  # recording the true attention costs a dense pass per layer
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(max_new_tokens=256))
    min_fetch_tokens: int = EngineConfig.min_fetch_tokens
    overflow: str = DEFAULT_OVERFLOW  # when the chat outgrows the window (sessions/overflow.py): a page setting
    chosen: tuple[str, ...] = ()  # the tunable settings the user set; the others follow the model (settle)


# the tunable settings the page shows, and how a value of each is compared (a budget is text: "0.10" is "0.1")
_GENERAL = EngineConfig()
_SHOWN: dict[str, Callable[[Any], object]] = {"alpha": float, "budget": parse_budget, "partial_ratio": float,
                                               "min_fetch_tokens": int}


@dataclass(frozen=True)
class SettingsForm:
    """The settings as the page's named inputs (or a script) give them, not yet checked: numbers may be floats
    where whole numbers are wanted, a budget is text. `SettingsKeeper.apply` checks them in one place."""

    policy: str = EngineConfig.policy
    alpha: float = EngineConfig.alpha
    budget: str = str(EngineConfig.budget)  # a fraction of the context or a number of tokens
    partial_ratio: float = EngineConfig.partial_ratio
    pool_limit: str = ""  # tokens or a size such as 64MiB; empty: no limit
    inspect: bool = False  # record the true attention for the inspector
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: float = 0
    repetition_penalty: float = 1.0
    max_new_tokens: float = 256
    min_fetch_tokens: float = EngineConfig.min_fetch_tokens
    overflow: str = DEFAULT_OVERFLOW  # a key or label of OVERFLOW_POLICIES


def engine_config(settings: Settings, engine=None) -> EngineConfig:
    """The EngineConfig of `settings` (a pool limit in bytes is counted in `engine`'s bytes per token): the
    tunable settings the user chose, and for the rest `engine`'s family defaults, else EngineConfig's."""
    budget, is_tokens = parse_budget(settings.budget)
    limit = None
    if settings.pool_limit.strip():
        per_token = engine.pool.bytes_per_token() if engine is not None else 1
        limit = pool_limit_tokens(settings.pool_limit.strip(), per_token)
    config = EngineConfig(policy=settings.policy, alpha=float(settings.alpha), budget=budget,
                          budget_is_tokens=is_tokens, partial_ratio=float(settings.partial_ratio),
                          min_fetch_tokens=settings.min_fetch_tokens, pool_limit_tokens=limit,
                          record_recall=settings.inspect)
    unchosen = {name: getattr(_GENERAL, name) for name in _SHOWN if name not in settings.chosen}
    if "budget" in unchosen:
        unchosen["budget_is_tokens"] = _GENERAL.budget_is_tokens
    config = config.with_changes(**unchosen)  # what the page shows for them followed the last model: not theirs
    if engine is None:
        return config
    return _with_family_defaults(config, engine, settings.chosen)[0]


def _with_family_defaults(config: EngineConfig, engine, chosen) -> tuple[EngineConfig, AppliedDefaults | None]:
    """`config` with the defaults of the family `engine`'s model belongs to (its config's model_type)."""
    return with_family_defaults(config, getattr(engine.model.config, "model_type", None), chosen)


def _chosen(current: Settings, candidate: Settings) -> tuple[str, ...]:
    """The settings the user chose: those chosen before, and those `candidate` changes from what was shown."""
    changed = {name for name, same in _SHOWN.items()
               if same(getattr(candidate, name)) != same(getattr(current, name))}
    return tuple(name for name in _SHOWN if name in changed or name in current.chosen)


class SettingsKeeper:
    """The settings the next turn runs with, and the engine configuration waiting to be applied."""

    def __init__(self) -> None:
        self.current = Settings()
        self._pending: EngineConfig | None = None

    def apply(self, engine, form: SettingsForm) -> str:
        """Validate and store new settings; they take effect on the next turn. Raises UserError."""
        try:
            sampling = SamplingConfig(temperature=float(form.temperature), top_p=float(form.top_p),
                                      top_k=int(form.top_k), repetition_penalty=float(form.repetition_penalty),
                                      max_new_tokens=int(form.max_new_tokens))
            candidate = Settings(form.policy, float(form.alpha), str(form.budget).strip(), float(form.partial_ratio),
                                 str(form.pool_limit or ""), bool(form.inspect), sampling,
                                 float(form.min_fetch_tokens),  # type: ignore[arg-type]  # checked just below
                                 check_overflow(form.overflow))
            candidate.min_fetch_tokens = EngineConfig(min_fetch_tokens=candidate.min_fetch_tokens).min_fetch_tokens
            candidate.chosen = _chosen(self.current, candidate)
            config = engine_config(candidate, engine)  # validates every engine setting, the floor included
        except (ConfigError, ValueError, TypeError) as error:
            raise UserError(f"Settings not applied: {error}") from None
        self.current = candidate
        self._pending = config
        return (f"Settings saved: {config.policy}, alpha {config.alpha:g}, budget {candidate.budget}, "
                f"at least {config.min_fetch_tokens} tokens, partial ratio {config.partial_ratio:g}; when the chat "
                f"outgrows the window: {OVERFLOW_POLICIES[candidate.overflow].lower()}; they apply from the next "
                "message.")

    def apply_pending(self, engine, store: SessionStore, session_id: str) -> None:
        """Before a turn: configure the engine with settings applied since the last one, and record them."""
        if self._pending is None:
            return
        if engine is not None and self._pending != engine.config:  # None: a remote server generates
            engine.configure(self._pending)
        store.update(session_id, settings=self.record())  # sampling-only changes count too
        self._pending = None

    def settle(self, engine) -> None:
        """After a model loads: its family's defaults in every tunable setting the user did not choose (load_engine
        was given the app's whole configuration), said on the engine (`family_defaults`, the model summary), and
        the shown settings follow what it now runs with."""
        wanted = engine_config(self.current, engine)
        engine.family_defaults = _with_family_defaults(wanted, engine, self.current.chosen)[1]
        # only the tunable settings the user did not choose move; the policy and the rest stay as loaded
        follows = [name for name in _SHOWN if name not in self.current.chosen]
        follows += ["budget_is_tokens", "budget_by_layer"] if "budget" in follows else []  # how it is read too
        config = engine.config.with_changes(**{name: getattr(wanted, name) for name in follows})
        if config != engine.config:
            engine.configure(config)
        follow = {name: getattr(config, name) for name in _SHOWN if name not in self.current.chosen}
        if "budget" in follow:
            follow["budget"] = f"{config.budget:g}"
        self.current = replace(self.current, **follow)

    def record(self) -> dict:
        """The engine and sampling settings a session's turns ran with, as stored beside it."""
        record = asdict(self.current)
        record.update(record.pop("sampling"))  # one flat record: temperature beside policy
        return record


def apply_storage(store: SessionStore, kv_format: str, disk_limit: str) -> str:
    """The format of new KV chunks and the disk limit of all of them; over the limit, the least recently
    used sessions' chunks go at once (never an open session's). Raises UserError."""
    try:
        limit = parse_size(disk_limit) if str(disk_limit or "").strip() else None
        storage = StorageConfig(kv_format=kv_format, kv_disk_limit=limit)
    except ValueError as error:
        raise UserError(f"KV storage not changed: {error}") from None
    store.storage = storage
    dropped = enforce_disk_limit(store)
    used = format_size(store.kv_bytes())
    freed = f"; dropped the KV cache of {len(dropped)} least recently used session(s)" if dropped else ""
    return f"Saved: {storage.describe()}. KV chunks now take {used}{freed} (their text stays)."
