"""The model this process serves: loading it (in the background at start-up), switching to another, its
device and memory, and what the page says about it.

    host = ModelHost(model=None, device="auto")
    host.load(lambda: engine_config(settings), progress=print)
    host.require_engine()                       # UserError while starting or after a failed load
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from infinigen_core import EngineConfig
from sessions import ChatSession, SessionStore

from .errors import UserError

if TYPE_CHECKING:
    from infinigen_core import InfiniGenEngine

    from .backend_client import TurnFigures

Report = Callable[[str], None]


def _free_memory() -> None:
    """Let an unloaded model's weights go before the next one loads (on a GPU, give the memory back too)."""
    import torch

    gc.unfreeze()  # what `_settle_heap` set aside: the old model's own cycles must be found now
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _settle_heap() -> None:
    """A model just loaded: every object the interpreter tracks now (its modules and parameters, the tokenizer, the
    libraries: ~580k with the default model) set aside from the cyclic collector, whose full passes otherwise walk
    all of them (0.3-0.4 s measured, a reply stalled that long) whenever enough new objects have lived a while,
    mid-reply. Objects made later are collected as before; `_free_memory` takes them back before an unload."""
    gc.collect()
    gc.freeze()


class ModelHost:
    """The local engine. RemoteHost (remote_host.py) stands in for it when replies come from a remote server."""

    DEFAULT_CHOICE = "default"
    remote = False
    settles_heap = False  # the app's process sets it (app.py): a test process's heap is not the host's to freeze

    def __init__(self, model: str | None = None, device: str = "auto", quantize: str | None = None,
                 loader: Callable | None = None, weights: str | None = None,
                 compile_decode: bool | None = None) -> None:
        self.model_path, self.device, self.quantize = model, device, quantize
        self.weights = weights  # auto | fp32 | int8 | int4 | None (load_engine's default: auto on the CPU)
        self.compile_decode = compile_decode  # None: load_engine's default (compiled on the CPU)
        self.cpu_kernels: bool | None = None  # None: load_engine's default (built on the CPU)
        self.engine: InfiniGenEngine | None = None
        self.status = "Starting..."
        self.load_error: str | None = None
        self.ready = threading.Event()
        self.loaded_at = 0.0
        self._loader = loader

    def _reporter(self, progress: Report) -> Report:
        def report(message: str) -> None:
            self.status = message
            progress(message)

        return report

    def _load(self, model: str | None, config: EngineConfig, report: Report):
        from infinigen_core.loading import load_engine

        loader = self._loader or load_engine
        # test loaders need not know these options
        kwargs: dict[str, Any] = {"weights": self.weights} if self.weights else {}
        if self.compile_decode is not None:
            kwargs["compile_decode"] = self.compile_decode
        if self.cpu_kernels is not None:
            kwargs["cpu_kernels"] = self.cpu_kernels
        engine = loader(model, device=self.device, config=config, quantize=self.quantize, progress=report, **kwargs)
        if self.settles_heap:
            _settle_heap()
        return engine

    # ------------------------------------------------------------------ start-up
    def load(self, config: Callable[[], EngineConfig], progress: Report = print,
             then: Callable[[], None] = lambda: None) -> None:
        """Load the model (download, convert and calibrate on first use), then run `then` (open a session);
        a failure of either is kept in `load_error` and shown instead of a frozen page."""
        report = self._reporter(progress)
        try:
            report("Loading the model (the first start downloads and converts it, then calibrates once)...")
            self.engine = self._load(self.model_path, config(), report)
            self.loaded_at = time.time()
            then()
            report(self.ready_line())
        except Exception as error:  # shown in the UI instead of a frozen page
            self.load_error = f"Could not start: {error}"
            report(self.load_error)
        finally:
            self.ready.set()

    def require_engine(self) -> InfiniGenEngine:
        """The engine, once start-up is over (UserError while starting or after a failed load)."""
        if not self.ready.is_set():
            raise UserError(f"Still starting: {self.status}")
        return self.require_engine_loaded()

    def require_engine_loaded(self) -> InfiniGenEngine:
        """The engine as soon as it is loaded (start-up may still be opening the latest session)."""
        if self.engine is None:
            raise UserError(self.load_error or f"Still starting: {self.status}")
        return self.engine

    def require_ready(self) -> None:
        """UserError unless start-up is over and replies can be generated."""
        self.require_engine()

    def require_loaded(self) -> None:
        """UserError until a session can be opened (start-up may still be opening the latest one)."""
        self.require_engine_loaded()

    def is_ready(self) -> bool:
        return self.engine is not None and self.ready.is_set()

    def fingerprint(self) -> str:
        return self.engine.fingerprint if self.engine is not None else ""

    def open_chat(self, store: SessionStore, session_id: str, progress: Callable[[int, int], None] | None = None):
        """A stored session bound to what generates its replies (here: the engine, its KV restored into it)."""
        return ChatSession.open(store, self.engine, session_id, progress)

    def turn_figures(self) -> TurnFigures | None:
        """What a remote engine told about the latest reply (None: the local engine's panels say it)."""
        return None

    # ------------------------------------------------------------------ switching
    def wanted(self, choice: str | None) -> str | None:
        """The model a picker's choice names: None for the default."""
        return None if not choice or choice == self.DEFAULT_CHOICE else str(choice).strip()

    def swap(self, wanted: str | None, config: Callable[[], EngineConfig], progress: Report = print) -> str | None:
        """Unload the model (two 8B models rarely fit one GPU) and load `wanted`; if it fails, load the old one
        again and return why. No session may hold the engine. Raises UserError when no model is left."""
        report = self._reporter(progress)
        previous = self.model_path
        previous_name = self.engine.model_name if self.engine is not None else None
        if self.engine is not None:
            self.engine.close()
            self.engine = None
            _free_memory()
        try:
            report(f"Loading {wanted or 'the default model'}...")
            self.engine = self._load(wanted, config(), report)
            self.model_path, self.load_error = wanted, None
            return None
        except Exception as error:  # a bad path, an unsupported family, no memory: go back
            if previous_name is None:  # the model given at start failed too: nothing to go back to
                self.load_error = f"Could not load {wanted or 'the default model'}: {error}"
                report(self.load_error)
                raise UserError(self.load_error) from None
            failure = f"Could not load {wanted}: {error}. Back on {previous_name}."
            report(f"Loading {previous_name} again...")
            try:
                self.engine = self._load(previous, config(), report)
            except Exception as again:
                self.load_error = f"Could not load {wanted} ({error}) nor {previous_name} again ({again})"
                report(self.load_error)
                raise UserError(self.load_error) from None
            return failure

    # ------------------------------------------------------------------ what the page shows
    def model_choices(self) -> list[tuple[str, str]]:
        """(label, value) for the model picker: the default, the supported models in the local hub cache,
        and the model now loaded when it is a local path."""
        from infinigen_core.hub import cached_hub_models
        from infinigen_core.loading import DEFAULT_MODEL_NAME
        from infinigen_core.packaged import cached_packaged_models, packaged_model

        choices = [(f"{DEFAULT_MODEL_NAME} (default)", self.DEFAULT_CHOICE)]
        choices += [(model.picker_label(cached=True), model.name) for model in cached_packaged_models()]
        choices += [(repo_id, repo_id) for repo_id in cached_hub_models()]
        if self.model_path and all(value != self.model_path for _, value in choices):
            packaged = packaged_model(self.model_path)
            choices.append((packaged.picker_label() if packaged else self.model_path, self.model_path))
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
        weights = engine.weights
        decode = engine.decode_step.label
        if engine.kernels is not None:
            decode += f" · {engine.kernels.label}"
        summary = (f"{engine.model_name} · {adapter.family.label} · {kinds} layers · {dtype} on {engine.device} · "
                   f"{weights} · {decode}")
        defaults = getattr(engine, "family_defaults", None)  # set by SettingsKeeper.settle (config.FAMILY_DEFAULTS)
        return f"{summary} · {defaults.describe()}" if defaults is not None else summary

    def ready_line(self) -> str:
        """'Ready: gemma-3-270m on cpu · 32,768-token window · a base model: ...': the window, and for a model
        that continues text rather than answering, that its chat answers will be weak."""
        engine = self.require_engine_loaded()
        line = f"Ready: {engine.model_name} on {engine.device} · {engine.max_context:,}-token window"
        if getattr(engine, "base_model", False):  # set by load_engine; a test's own loader may leave it out
            line += " · a base model: it continues text, so its chat answers will be weak"
        return line
