"""The prefetch inspector: which past tokens one layer fetched for one generated token, beside the
layer's true attention, as highlighted text.

Fetched tokens are shaded by their rehearsed score (the sum of the KV head's query-group softmax weights,
the quantity InfiniGen ranks by); the true attention (recorded when the "inspect" setting is on) is
shaded by its weight. The recall is the share of the true attention mass that the fetched set carries.
"""

from __future__ import annotations

import html

import torch

from infinigen_core.engine import KEEP_SELECTIONS_STEPS

MAX_SHOWN_TOKENS = 1500


def step_labels(engine) -> list[str]:
    labels = []
    for index, step in enumerate(engine.recent_decode_steps()):
        following = engine.token_ids[step.position + 1] if step.position + 1 < len(engine.token_ids) else None
        token = engine.tokenizer.decode([following]) if following is not None else "(next)"
        labels.append(f"{index}: token {step.position + 1} {token!r}")
    return labels


def _shaded_text(pieces: list[str], first_position: int, weights: dict[int, float], rgb: str,
                 floor: float) -> str:
    """`floor` keeps every marked token visible; 0 lets tiny weights fade out."""
    peak = max(weights.values(), default=0.0) or 1.0
    spans = []
    for offset, piece in enumerate(pieces):
        position = first_position + offset
        text = html.escape(piece).replace("\n", "⏎<br>")
        weight = weights.get(position)
        if weight is None:
            spans.append(f"<span>{text}</span>")
        else:
            alpha = floor + (1 - floor) * min(weight / peak, 1.0)
            spans.append(f'<span class="ig-hit" style="background: rgba({rgb},{alpha:.2f})" '
                         f'title="position {position}: {weight:.4f}">{text}</span>')
    return "".join(spans)


def read_positions(stats) -> dict[int, float]:
    """The past positions a sparse layer's attention read at a step (in any KV head), each with its highest
    rehearsed score: the selection's slots less those masked (InfiniGen's alpha rank, and where the heads share a
    budget each head's own count)."""
    positions = stats.selected_positions
    scores = stats.selected_scores if stats.selected_scores is not None else torch.ones_like(positions, dtype=torch.float32)
    read = (torch.ones_like(positions, dtype=torch.bool) if stats.selected_read is None
            else stats.selected_read.expand_as(positions))
    fetched: dict[int, float] = {}
    for position, score, used in zip(positions.flatten().tolist(), scores.flatten().tolist(), read.flatten().tolist()):
        if used:
            fetched[position] = max(fetched.get(position, 0.0), float(score))
    return fetched


def _global_layers(engine) -> str:
    adapter = engine.adapter
    return ", ".join(str(layer) for layer in range(adapter.num_layers) if adapter.is_global(layer))


def render(engine, step_index: int, layer: int) -> str:
    """HTML for one decode step and layer (or a sentence saying why there is nothing to show)."""
    steps = engine.recent_decode_steps()
    if not steps:
        return "<p>Generate a reply first: the inspector shows the decode steps of the recent replies.</p>"
    step = steps[max(0, min(step_index, len(steps) - 1))]
    by_layer = {stats.layer: stats for stats in step.layers}
    stats = by_layer.get(layer)
    if stats is None:
        return f"<p>Layer {layer} does not exist in this model.</p>"
    window = engine.adapter.sliding_window(layer)
    if window is not None:
        return (f"<p>Layer {layer} is a sliding-window layer ({engine.adapter.layer_kind(layer)}): it attends to the "
                f"last {window} tokens only, so InfiniGen does not select on it. Pick a global layer: "
                f"{_global_layers(engine)}.</p>")
    if stats.dense_reason:
        return (f"<p>Layer {layer} attended densely at this step ({stats.dense_reason}: all {stats.context_len} "
                f"past tokens fit in the fetch budget, so nothing was speculated or selected).</p>")
    if not stats.sparse:
        return (f"<p>Layer {layer} attended densely at this step (all {stats.context_len} past tokens): the first "
                f"layers and the full and offload policies do not select.</p>")
    if stats.selected_positions is None:
        return (f"<p>Layer {layer} fetched {stats.fetched} of {stats.context_len} past tokens at this step; which "
                f"ones is kept for the last {KEEP_SELECTIONS_STEPS} decode steps only. Pick a newer step.</p>")
    fetched = read_positions(stats)
    true: dict[int, float] = {}
    if stats.true_attention is not None:
        true = dict(zip(stats.true_attention_positions.tolist(), stats.true_attention.tolist()))
    first = max(0, step.position - MAX_SHOWN_TOKENS)
    ids = engine.token_ids[first: step.position]
    pieces = engine.tokenizer.batch_decode([[i] for i in ids]) if ids else []
    hidden = f"<p><i>{first} earlier tokens not shown.</i></p>" if first else ""
    recall = (f"recall of the fetched set: <b>{stats.attention_recall:.1%}</b> of the true attention mass; "
              f"{stats.tokens_for_90} tokens would carry 90%" if stats.attention_recall is not None
              else "turn on 'Record true attention for the inspector' in the settings to compare with the true attention")
    summary = (f"<p>Step at position {step.position}, layer {layer}: fetched {stats.fetched} of "
               f"{stats.context_len} past tokens ({stats.fetched_ratio:.1%}) per KV head; {recall}.</p>")
    true_column = (_shaded_text(pieces, first, true, "76,120,168", floor=0.0) if true
                   else "<p>No true attention recorded for this step.</p>")
    return (
        f"{summary}{hidden}<div class='ig-inspector' style='display:flex; gap:1em'>"
        f"<div style='flex:1; white-space:pre-wrap'><h4>Fetched by InfiniGen (shade: rehearsed score)</h4>"
        f"{_shaded_text(pieces, first, fetched, '245,133,24', floor=0.15)}</div>"
        f"<div style='flex:1; white-space:pre-wrap'><h4>True attention of layer {layer} (shade: weight)</h4>"
        f"{true_column}</div></div>"
    )
