"""Per layer, the share of the true (dense) attention mass that the selected tokens carry.

    python -m bench recall --text essays/ --context 2048 --policies infinigen,h2o,streaming

With `record_recall` the engine runs a dense attention pass beside each sparse layer's real one and
measures how much of its probability mass falls on the fetched rows (the new token always counts).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from infinigen_core import EngineConfig
from .common import decode_tokens, load_prefix


def attention_recall(engine, prefix: Sequence[int], tokens: Sequence[int], configs: dict[str, EngineConfig],
                     progress=None) -> dict[str, dict]:
    """Per config: mean recall over sparse layers, recall per layer ({layer: value}), fetched_ratio."""
    results = {}
    for name, config in configs.items():
        if progress:
            progress(f"{name}: {len(tokens)} decode steps with recall recorded")
        load_prefix(engine, config.with_changes(record_recall=True), list(prefix))
        run = decode_tokens(engine, tokens)
        per_layer = {layer: statistics.fmean(values) for layer, values in sorted(run.layer_recall.items())}
        results[name] = {
            "recall": statistics.fmean(per_layer.values()) if per_layer else 1.0,
            "per_layer": per_layer,
            "fetched_ratio": run.fetched_ratio,
            "sparse_fetched_ratio": run.sparse_fetched_ratio,
        }
    engine.reset()
    return results
