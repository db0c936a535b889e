"""The engine and sampling settings as the user typed them, checked, and applied from the next turn on;
the KV storage settings, applied at once.

    keeper = SettingsKeeper()
    keeper.apply(engine, SettingsForm(policy="h2o", alpha=12, budget="0.3"))   # UserError if bad
    keeper.apply_pending(engine, store, session_id)                            # before the next turn
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from infinigen_core import ConfigError, EngineConfig, SamplingConfig
from infinigen_core.config import parse_budget, pool_limit_tokens
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
    """The EngineConfig of `settings` (a pool limit in bytes is counted in `engine`'s bytes per token)."""
    budget, is_tokens = parse_budget(settings.budget)
    limit = None
    if settings.pool_limit.strip():
        per_token = engine.pool.bytes_per_token() if engine is not None else 1
        limit = pool_limit_tokens(settings.pool_limit.strip(), per_token)
    return EngineConfig(policy=settings.policy, alpha=float(settings.alpha), budget=budget,
                        budget_is_tokens=is_tokens, partial_ratio=float(settings.partial_ratio),
                        min_fetch_tokens=settings.min_fetch_tokens, pool_limit_tokens=limit,
                        record_recall=settings.inspect)


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
            config = engine_config(candidate, engine)  # validates every engine setting, the floor included
            candidate.min_fetch_tokens = config.min_fetch_tokens
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
