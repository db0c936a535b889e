"""InfiniGen's KV cache under an unmodified transformers model: the engine's public face.

    from infinigen_core import EngineConfig, SamplingConfig, chat_token_ids, generate, load_engine

    engine = load_engine(device="cpu", config=EngineConfig(policy="infinigen", budget=0.15))
    ids = chat_token_ids(engine.tokenizer, [{"role": "user", "content": "Hello"}])
    for event in generate(engine, ids, SamplingConfig(max_new_tokens=32)):
        print(event.text, end="")

The names resolve on first use: `import infinigen_core.hub` (which app.py reads before deciding
HF_HUB_OFFLINE) must not import torch or transformers through this package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # type checkers and editors see the names; at run time they load on first use (below)
    from .config import ConfigError, EngineConfig, SamplingConfig
    from .engine import ContextOverflowError, InfiniGenEngine
    from .generation import GenerationEvent, chat_token_ids, generate
    from .hub import ModelLoadError
    from .loading import load_engine

_HOMES = {
    "ConfigError": "config",
    "EngineConfig": "config",
    "SamplingConfig": "config",
    "ContextOverflowError": "engine",
    "InfiniGenEngine": "engine",
    "GenerationEvent": "generation",
    "chat_token_ids": "generation",
    "generate": "generation",
    "ModelLoadError": "hub",
    "load_engine": "loading",
}

__all__ = [  # written out, as the TYPE_CHECKING imports above are, so linters and type checkers read it
    "ConfigError", "ContextOverflowError", "EngineConfig", "GenerationEvent", "InfiniGenEngine", "ModelLoadError",
    "SamplingConfig", "chat_token_ids", "generate", "load_engine",
]
assert sorted(__all__) == sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
