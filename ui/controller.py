"""Everything the app does, without Gradio: the engine, the open session, settings, a stop flag.

The app is a local, single-user program: one controller per process holds the engine and the session
that is open. Turns run one at a time (a second request while one runs gets a clear "busy" error), so
two browser tabs can never interleave writes; another process gets the session lock's "open elsewhere".
Every user-facing failure is raised as `UserError` with a message meant to be shown as it is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from infinigen_core.config import ConfigError, EngineConfig, SamplingConfig, parse_budget, pool_limit_tokens
from infinigen_core.engine import ContextOverflowError
from infinigen_core.generation import GenerationEvent
from sessions import ChatSession, SessionError, SessionLockedError, SessionStore, StorageConfig, format_size, parse_size
from sessions.budget import enforce_disk_limit
from sessions.prefix import PrefixFinder


BUSY = "A reply is being generated: press Stop or wait for it to finish."


def _free_memory() -> None:
    """Let an unloaded model's weights go before the next one loads (on a GPU, give the memory back too)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class UserError(Exception):
    """A problem to show the user; nothing was lost."""


class QueueFull(UserError):
    """Too many API requests are already waiting for their turn."""


class Abandoned(UserError):
    """The API client went away before its turn came."""


class _EitherSet:
    """A cancel flag that is set when any of its events is: the API client going away, the page's Stop button."""

    def __init__(self, *events: threading.Event) -> None:
        self._events = events

    def is_set(self) -> bool:
        return any(event.is_set() for event in self._events)


@dataclass
class ApiTurn:
    """What an API request ran as: filled in while its turn runs, read by the API for headers and usage."""

    session_id: str = ""
    continued: bool = False  # True: it extended a stored API conversation; False: a new session
    prefilled_tokens: int = 0  # tokens of the prompt that the model actually read


@dataclass
class TurnProgress:
    """What the UI shows while a turn runs."""

    phase: str = "idle"  # idle | restore | prefill | generating
    done: int = 0
    total: int = 0
    started: float = 0.0
    tokens: int = 0
    first_token_at: float | None = None

    def tokens_per_second(self) -> float:
        if self.first_token_at is None or self.tokens < 2:
            return 0.0
        return (self.tokens - 1) / max(time.perf_counter() - self.first_token_at, 1e-9)


@dataclass
class Settings:
    """The engine and sampling settings as the user typed them (validated by `apply`)."""

    policy: str = EngineConfig.policy
    alpha: float = EngineConfig.alpha
    budget: str = str(EngineConfig.budget)
    partial_ratio: float = EngineConfig.partial_ratio
    pool_limit: str = ""
    inspect: bool = False  # recording the true attention costs a dense pass per layer
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(max_new_tokens=256))
    min_fetch_tokens: int = EngineConfig.min_fetch_tokens


class ChatController:
    def __init__(self, data_dir: Path | str | None = None, model: str | None = None, device: str = "auto",
                 loader: Callable | None = None, quantize: str | None = None,
                 storage: StorageConfig | None = None) -> None:
        self.store = SessionStore(data_dir, storage)
        self.model_path, self.device, self.quantize = model, device, quantize
        self.engine = None
        self.chat: ChatSession | None = None
        self.settings = Settings()
        self.status = "Starting..."
        self.load_error: str | None = None
        self.ready = threading.Event()
        self.cancel = threading.Event()
        self.progress = TurnProgress()
        self.restore_message = ""
        self._turn_lock = threading.Lock()
        self._loader = loader
        self._holder: ChatSession | None = None  # the session whose KV the engine holds now
        self.api_chat: ChatSession | None = None  # the API's latest conversation, kept open for the next request
        self.api_turns = 0  # API turns run, so the page knows to refresh its session list
        self._waiting = 0  # API requests waiting for their turn
        self._waiting_lock = threading.Lock()
        self.prefixes = PrefixFinder(self.store)
        self.loaded_at = 0.0

    # ------------------------------------------------------------------ start-up
    def load(self, progress: Callable[[str], None] = print) -> None:
        """Load the model (download, convert and calibrate on first use), then open the latest session."""
        from infinigen_core.loading import load_engine

        def report(message: str) -> None:
            self.status = message
            progress(message)

        try:
            report("Loading the model (the first start downloads and converts it, then calibrates once)...")
            loader = self._loader or load_engine
            self.engine = loader(self.model_path, device=self.device, config=self._engine_config(self.settings),
                                 quantize=self.quantize, progress=report)
            self.loaded_at = time.time()
            self._open_latest_free_session()
            enforce_disk_limit(self.store)  # a lower limit than last time takes effect at once
            report(f"Ready: {self.engine.model_name} on {self.engine.device}")
        except Exception as error:  # shown in the UI instead of a frozen page
            self.load_error = f"Could not start: {error}"
            report(self.load_error)
        finally:
            self.ready.set()

    def load_in_background(self, progress: Callable[[str], None] = print) -> threading.Thread:
        thread = threading.Thread(target=self.load, args=(progress,), daemon=True, name="model-loader")
        thread.start()
        return thread

    def _open_latest_free_session(self) -> None:
        """The most recent page session that no other window or process holds; a new one when all are taken.
        API sessions are left to their clients (the page opens one only when asked)."""
        for summary in self.store.list():
            if summary.origin == "api":
                continue
            try:
                self.open_session(summary.id)
                return
            except UserError:  # open in another app process: leave it to that one
                continue
        self.new_session()

    # ------------------------------------------------------------------ models
    DEFAULT_CHOICE = "default"

    def model_choices(self) -> list[tuple[str, str]]:
        """(label, value) for the model picker: the default, the supported models in the local hub cache,
        and the model now loaded when it is a local path."""
        from infinigen_core.hub import cached_hub_models
        from infinigen_core.loading import DEFAULT_MODEL_NAME

        choices = [(f"{DEFAULT_MODEL_NAME} (default)", self.DEFAULT_CHOICE)]
        choices += [(repo_id, repo_id) for repo_id in cached_hub_models()]
        if self.model_path and all(value != self.model_path for _, value in choices):
            choices.append((self.model_path, self.model_path))
        return choices

    def model_summary(self) -> str:
        engine = self.engine
        if engine is None:
            return ""
        adapter = engine.adapter
        sliding = sum(1 for layer in range(adapter.num_layers) if not adapter.is_global(layer))
        nope = sum(1 for layer in range(adapter.num_layers) if not adapter.uses_rope(layer))
        kinds = f"{adapter.num_layers - sliding} global" + (f", {sliding} sliding-window" if sliding else "")
        kinds += f" ({nope} without RoPE)" if nope and adapter.family.rope else ""
        dtype = str(engine.dtype).replace("torch.", "")
        return f"{engine.model_name} · {adapter.family.label} · {kinds} layers · {dtype} on {engine.device}"

    def switch_model(self, choice: str | None, progress: Callable[[str], None] = print) -> str:
        """Load another model (default, hub id or path) and reopen the open session under it.

        The old model is unloaded first (two 8B models rarely fit one GPU); if the new one fails to load, the
        old one is loaded again and the error says why. Each model's KV chunks of a session are kept, so
        switching back restores the session from disk. Raises UserError."""
        from infinigen_core.loading import load_engine

        wanted = None if not choice or choice == self.DEFAULT_CHOICE else str(choice).strip()
        if not self.ready.is_set():
            raise UserError(f"Still starting: {self.status}")
        if self.engine is not None and wanted == self.model_path:
            return f"{self.engine.model_name} is already loaded."

        def report(message: str) -> None:
            self.status = message
            progress(message)

        def load(model: str | None):
            return loader(model, device=self.device, config=self._engine_config(self.settings),
                          quantize=self.quantize, progress=report)

        loader = self._loader or load_engine
        failure = None
        with self._turn():
            session_id = self.chat.id if self.chat is not None else None
            # every open session holds the old engine: close them all (the API's too), the new one starts empty
            for chat in {id(chat): chat for chat in (self.chat, self.api_chat) if chat is not None}.values():
                chat.close()
            self.chat = self.api_chat = self._holder = None
            previous = self.model_path
            previous_name = self.engine.model_name if self.engine is not None else None
            if self.engine is not None:
                self.engine.close()
                self.engine = None
                _free_memory()
            try:
                report(f"Loading {wanted or 'the default model'}...")
                self.engine = load(wanted)
                self.model_path, self.load_error = wanted, None
            except Exception as error:  # a bad path, an unsupported family, no memory: go back
                if previous_name is None:  # the model given at start failed too: nothing to go back to
                    self.load_error = f"Could not load {wanted or 'the default model'}: {error}"
                    report(self.load_error)
                    raise UserError(self.load_error) from None
                failure = f"Could not load {wanted}: {error}. Back on {previous_name}."
                report(f"Loading {previous_name} again...")
                try:
                    self.engine = load(previous)
                except Exception as again:
                    self.load_error = f"Could not load {wanted} ({error}) nor {previous_name} again ({again})"
                    report(self.load_error)
                    raise UserError(self.load_error) from None
        if session_id is not None:
            self.open_session(session_id)
        else:
            self._open_latest_free_session()
        self.status = f"Ready: {self.engine.model_name} on {self.engine.device}"
        if failure:
            raise UserError(failure)
        return f"Switched to {self.model_summary()}. {self.restore_message}"

    def _require_engine(self) -> None:
        if not self.ready.is_set():
            raise UserError(f"Still starting: {self.status}")
        if self.engine is None:
            raise UserError(self.load_error or "the model is not loaded")

    # ------------------------------------------------------------------ settings
    def _engine_config(self, settings: Settings) -> EngineConfig:
        budget, is_tokens = parse_budget(settings.budget)
        limit = None
        if settings.pool_limit.strip():
            per_token = self.engine.pool.bytes_per_token() if self.engine is not None else 1
            limit = pool_limit_tokens(settings.pool_limit.strip(), per_token)
        return EngineConfig(policy=settings.policy, alpha=float(settings.alpha), budget=budget,
                            budget_is_tokens=is_tokens, partial_ratio=float(settings.partial_ratio),
                            min_fetch_tokens=settings.min_fetch_tokens, pool_limit_tokens=limit,
                            record_recall=settings.inspect)

    def apply_settings(self, policy: str, alpha, budget, partial_ratio, pool_limit: str, inspect: bool,
                       temperature, top_p, top_k, repetition_penalty, max_new_tokens,
                       min_fetch_tokens=EngineConfig.min_fetch_tokens) -> str:
        """Validate and store new settings; they take effect on the next turn. Raises UserError."""
        try:
            sampling = SamplingConfig(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
                                      repetition_penalty=float(repetition_penalty),
                                      max_new_tokens=int(max_new_tokens))
            candidate = Settings(policy, float(alpha), str(budget).strip(), float(partial_ratio),
                                 str(pool_limit or ""), bool(inspect), sampling, float(min_fetch_tokens))
            config = self._engine_config(candidate)  # validates every engine setting, the floor included
            candidate.min_fetch_tokens = config.min_fetch_tokens
        except (ConfigError, ValueError, TypeError) as error:
            raise UserError(f"Settings not applied: {error}") from None
        self.settings = candidate
        self._pending_config = config
        return (f"Settings saved: {config.policy}, alpha {config.alpha:g}, budget {candidate.budget}, "
                f"at least {config.min_fetch_tokens} tokens, partial ratio {config.partial_ratio:g}; they apply "
                "from the next message.")

    def apply_storage(self, kv_format: str, disk_limit: str) -> str:
        """The format of new KV chunks and the disk limit of all of them; over the limit, the least recently
        used sessions' chunks go at once (never the open session's). Raises UserError."""
        try:
            limit = parse_size(disk_limit) if str(disk_limit or "").strip() else None
            storage = StorageConfig(kv_format=kv_format, kv_disk_limit=limit)
        except ValueError as error:
            raise UserError(f"KV storage not changed: {error}") from None
        self.store.storage = storage
        dropped = enforce_disk_limit(self.store)
        used = format_size(self.store.kv_bytes())
        freed = f"; dropped the KV cache of {len(dropped)} least recently used session(s)" if dropped else ""
        return f"Saved: {storage.describe()}. KV chunks now take {used}{freed} (their text stays)."

    def _apply_pending_config(self, chat: ChatSession) -> None:
        config = getattr(self, "_pending_config", None)
        if config is None:
            return
        if config != self.engine.config:
            self.engine.configure(config)
        self.store.update(chat.id, settings=self._settings_record())  # sampling-only changes count too
        self._pending_config = None

    def _settings_record(self) -> dict:
        """The engine and sampling settings a session's turns ran with, as stored beside it."""
        record = asdict(self.settings)
        record.update(record.pop("sampling"))  # one flat record: temperature beside policy
        return record

    # ------------------------------------------------------------------ sessions
    def new_session(self, system_prompt: str = "") -> str:
        fingerprint = self.engine.fingerprint if self.engine is not None else ""
        session_id = self.store.create("New chat", system_prompt, self._settings_record(), fingerprint)
        if self.engine is not None:
            self.open_session(session_id)
        return session_id

    def open_session(self, session_id: str, progress: Callable[[int, int], None] | None = None) -> str:
        self._require_engine_loaded()
        with self._turn():
            if self.chat is not None and self.chat.id == session_id:
                return self.restore_message
            previous, self.chat = self.chat, None
            self._release(previous)
            self.progress = TurnProgress(phase="restore", started=time.perf_counter())

            def on_restore(done: int, total: int) -> None:
                self.progress.done, self.progress.total = done, total
                if progress is not None:
                    progress(done, total)

            try:
                if self.api_chat is not None and self.api_chat.id == session_id:  # the API has it open: share it
                    self.chat = self.api_chat
                    self._hold(self.chat, on_restore)
                else:
                    self.chat = self._open(session_id, on_restore)
            except SessionError as error:
                if previous is not None:  # stay where we were
                    self.chat = previous if previous is self.api_chat else self._open(previous.id)
                raise UserError(str(error)) from None
            finally:
                self.progress.phase = "idle"
            report = self.chat.restore
            if report.rebuilt:
                self.restore_message = (f"The saved KV cache could not be used ({report.reason}); rebuilt it by "
                                        f"re-reading {report.tokens_prefilled} tokens in {report.seconds:.1f} s. "
                                        "No message was lost.")
            elif report.tokens_restored and report.tokens_prefilled:
                self.restore_message = (f"Restored {report.tokens_restored} tokens of this model's saved KV cache "
                                        f"from disk and read the {report.tokens_prefilled} tokens it did not hold "
                                        f"(said under another model since) in {report.seconds:.2f} s.")
            elif report.tokens_restored:
                self.restore_message = (f"Restored {report.tokens_restored} tokens from disk in "
                                        f"{report.seconds:.2f} s (no recomputation).")
            else:
                self.restore_message = "New conversation."
            return self.restore_message

    def _open(self, session_id: str, progress: Callable[[int, int], None] | None = None) -> ChatSession:
        """Open a session, which restores its KV into the engine (whatever the engine held is gone)."""
        self._holder = None
        chat = ChatSession.open(self.store, self.engine, session_id, progress)
        self._holder = chat
        return chat

    def _hold(self, chat: ChatSession, progress: Callable[[int, int], None] | None = None) -> None:
        """Make the engine hold `chat`'s KV: read it back from disk if another session used the engine since."""
        if self._holder is not chat:
            self._holder = None
            chat.reload(progress)
            self._holder = chat

    def _release(self, chat: ChatSession | None) -> None:
        """Close a session that neither the page nor the API has open any more."""
        if chat is not None and chat is not self.chat and chat is not self.api_chat:
            if self._holder is chat:
                self._holder = None
            chat.close()

    def _require_engine_loaded(self) -> None:
        if self.engine is None:
            raise UserError(self.load_error or f"Still starting: {self.status}")

    def rename_session(self, title: str) -> None:
        self._require_chat()
        try:
            self.store.rename(self.chat.id, title)
        except ValueError as error:
            raise UserError(str(error)) from None

    def delete_session(self) -> None:
        self._require_chat()
        with self._turn():
            doomed, self.chat = self.chat, None
            if self.api_chat is doomed:
                self.api_chat = None
            self._release(doomed)
            self.store.delete(doomed.id)
        self._open_latest_free_session()

    def export_session(self, folder: Path) -> Path:
        self._require_chat()
        title = "".join(c if c.isalnum() else "-" for c in self.store.get(self.chat.id).title)[:40] or "chat"
        return self.store.export(self.chat.id, Path(folder) / f"{title}.igchat")

    def import_session(self, path: str | Path) -> str:
        self._refuse_while_generating()
        try:
            session_id = self.store.import_file(path)
        except SessionError as error:
            raise UserError(str(error)) from None
        self.open_session(session_id)
        return session_id

    def branch_from(self, message_index: int) -> str:
        self._require_chat()
        messages = self.chat.messages
        if not 0 <= message_index < len(messages):
            raise UserError(f"there is no message {message_index + 1} to branch from")
        self._refuse_while_generating()
        branch_id = self.store.branch(self.chat.id, messages[message_index].id)
        self.open_session(branch_id)
        return branch_id

    def set_system_prompt(self, text: str) -> None:
        self._require_chat()
        if text != self.chat.system_prompt:
            self.chat.set_system_prompt(text)

    def _require_chat(self) -> None:
        self._require_engine_loaded()
        if self.chat is None:
            raise UserError("no session is open")

    # ------------------------------------------------------------------ turns
    def _refuse_while_generating(self) -> None:
        """For actions that create something before opening it: refuse up front rather than half-way."""
        if self._turn_lock.locked():
            raise UserError(BUSY)

    def _turn(self):
        controller = self

        class _Guard:
            def __enter__(self):
                if not controller._turn_lock.acquire(blocking=False):
                    raise UserError(BUSY)

            def __exit__(self, *exc):
                controller._turn_lock.release()

        return _Guard()

    def chat_history(self) -> list[dict]:
        if self.chat is None:
            return []
        return [{"role": m.role, "content": m.content} for m in self.chat.messages]

    def send(self, text: str) -> Iterator[list[dict]]:
        if not text or not text.strip():
            raise UserError("The message is empty: type something first.")
        self._require_chat()
        check = self.chat.check_window(text)
        if not check.fits:
            raise UserError(
                f"This message would bring the conversation to {check.needed_tokens} tokens, beyond the model's "
                f"window of {check.window}. Start a new session, or press 'Drop oldest turns' "
                f"({check.droppable_turns} can go; the system prompt stays). Nothing was sent."
            )
        if not self.chat.messages and self.store.get(self.chat.id).title == "New chat":
            self.store.rename(self.chat.id, text.strip().splitlines()[0][:60])  # a title worth listing
        yield from self._run(lambda progress: self.chat.send(text, self.settings.sampling, self.cancel, progress))

    def regenerate(self) -> Iterator[list[dict]]:
        self._require_chat()
        yield from self._run(lambda progress: self.chat.regenerate(self.settings.sampling, self.cancel, progress))

    def edit_last(self, text: str) -> Iterator[list[dict]]:
        if not text or not text.strip():
            raise UserError("The edited message is empty: type something first.")
        self._require_chat()
        yield from self._run(lambda progress: self.chat.edit_last_user(text, self.settings.sampling, self.cancel,
                                                                      progress))

    def drop_oldest_turns(self, text: str) -> str:
        self._require_chat()
        with self._turn():
            try:
                dropped = self.chat.drop_oldest_turns(text or "")
            except SessionError as error:
                raise UserError(str(error)) from None
        return f"Dropped the {dropped} oldest turn(s); the system prompt was kept."

    def stop(self) -> None:
        self.cancel.set()

    def _run(self, start_turn) -> Iterator[list[dict]]:
        with self._turn():
            self.cancel.clear()
            self.restore_message = ""  # said once, after opening the session
            self._hold_with_progress(self.chat)
            self._apply_pending_config(self.chat)
            self.progress = TurnProgress(phase="prefill", started=time.perf_counter())

            def on_prefill(done: int, total: int) -> None:
                self.progress.done, self.progress.total = done, total

            try:
                events = start_turn(on_prefill)
                history = None
                for event in events:
                    if history is None:  # the turn's first step stores or removes messages: read them after it
                        history = self.chat_history()
                    if self.progress.first_token_at is None:
                        self.progress.first_token_at = time.perf_counter()
                        self.progress.phase = "generating"
                    self.progress.tokens += 1 if event.finish_reason is None else 0
                    yield history + [{"role": "assistant", "content": event.full_text}]
            except (SessionError, ContextOverflowError, ConfigError) as error:
                raise UserError(str(error)) from None
            finally:
                self.progress.phase = "idle"
        yield self.chat_history()

    def _hold_with_progress(self, chat: ChatSession) -> None:
        self.progress = TurnProgress(phase="restore", started=time.perf_counter())

        def on_restore(done: int, total: int) -> None:
            self.progress.done, self.progress.total = done, total

        self._hold(chat, on_restore)

    # ------------------------------------------------------------------ the OpenAI-compatible API
    def answer_api(self, system: str, turns: list[tuple[str, str]], prompt_ids: list[int],
                   sampling: SamplingConfig, cancel: threading.Event, turn: ApiTurn,
                   max_waiting: int) -> Iterator[GenerationEvent]:
        """Answer an API request's conversation (system prompt, then (role, content) turns, templated into
        `prompt_ids`), one turn at a time with the page. It extends the stored API conversation it continues,
        or starts a new API session that shares the longest stored token prefix's chunks. Raises QueueFull
        when `max_waiting` requests already wait, Abandoned when `cancel` is set before the turn comes."""
        self._require_engine()
        self._wait_for_turn(cancel, max_waiting)  # only this client going away ends the wait
        try:
            self.cancel.clear()  # a Stop pressed before this turn is not meant for it
            cancel = _EitherSet(cancel, self.cancel)  # from now on the page's Stop button stops it too
            chat, new_turns = self._api_session(system, turns, prompt_ids, turn)
            self._apply_pending_config(chat)
            self.progress = TurnProgress(phase="prefill", started=time.perf_counter())

            def on_prefill(done: int, total: int) -> None:
                self.progress.done, self.progress.total = done, total
                turn.prefilled_tokens = total

            for event in chat.extend(new_turns, sampling, cancel, on_prefill):
                if self.progress.first_token_at is None:
                    self.progress.first_token_at = time.perf_counter()
                    self.progress.phase = "generating"
                self.progress.tokens += 1 if event.finish_reason is None else 0
                yield event
        except (SessionError, ContextOverflowError, ConfigError) as error:
            raise UserError(str(error)) from None
        finally:
            self.progress.phase = "idle"
            self.api_turns += 1
            self._turn_lock.release()

    def _wait_for_turn(self, cancel: threading.Event, max_waiting: int) -> None:
        with self._waiting_lock:
            if self._turn_lock.locked() and self._waiting >= max_waiting:
                raise QueueFull(f"{self._waiting} requests are already waiting for the model: retry later")
            self._waiting += 1
        try:
            while not self._turn_lock.acquire(timeout=0.2):
                if cancel.is_set():
                    raise Abandoned("the client went away while waiting")
        finally:
            with self._waiting_lock:
                self._waiting -= 1

    def _api_session(self, system: str, turns: list[tuple[str, str]], prompt_ids: list[int],
                     turn: ApiTurn) -> tuple[ChatSession, list[tuple[str, str]]]:
        """The session to answer in (its KV in the engine) and the turns it does not hold yet."""
        for summary in self.store.list():  # most recent first
            if summary.origin != "api" or summary.system_prompt != system or summary.message_count > len(turns):
                continue
            stored = [(m.role, m.content) for m in self.store.messages(summary.id)]
            if stored != turns[: len(stored)]:
                continue
            try:
                chat = self._api_chat(summary.id)
            except SessionLockedError:  # another app process has it open: start a new one beside it
                continue
            turn.session_id, turn.continued = chat.id, True
            return chat, turns[len(stored):]
        match = self.prefixes.longest(self.engine.kv_signature(), prompt_ids)
        title = next((content for role, content in turns if role == "user" and content.strip()), "API chat")
        session_id = self.store.create(title.strip().splitlines()[0][:60], system, self._settings_record(),
                                       self.engine.fingerprint, origin="api")
        try:
            shared = self.store.share_chunks(match.session_id, session_id, match.tokens) if match.tokens else 0
            chat = self._api_chat(session_id)
        except BaseException:
            self.store.delete(session_id)  # nothing half-made is left in the sidebar
            raise
        rest = [record for record in match.chunks if record.end > shared]
        # reading a chunk is far cheaper per token than computing it, but not free: only for a good share of it
        worth_reading = rest and (match.tokens - rest[0].start) * 4 >= rest[0].end - rest[0].start
        if worth_reading:
            chat.import_prefix(rest[0], match.tokens)
        turn.session_id, turn.continued = chat.id, False
        return chat, turns

    def _api_chat(self, session_id: str) -> ChatSession:
        """`session_id` open for the API, its KV in the engine."""
        for chat in (self.api_chat, self.chat):
            if chat is not None and chat.id == session_id:
                break
        else:
            chat = self._open(session_id)
        previous, self.api_chat = self.api_chat, chat
        self._release(previous)
        self._hold(chat)
        return chat
