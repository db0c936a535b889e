"""The decode lane: where the pool and the compute share the CPU, a one-token step's attention runs from layer to
layer in C++ (kernels/decode_lane.cpp, built with the CPU kernels), with no Python between the layers.

    lane = DecodeLane.for_work(work)   # None where the lane cannot serve this engine (why: lane_refusal(work))
    if lane is not None and lane.begin(step):   # False: this step takes the Python path (step.py)
        ... the forward: each layer's attention op runs in the lane ...
        lane.end(step)                          # the step's statistics, as the Python path records them
    lane.abort()                                # a step that raised

The lane does what `LayerWork.attend` does for such a step, with the same kernels and ATen ops on the same
inputs, so the logits are the same to the bit (tests/test_decode_lane.py): the new K/V into the pool, InfiniGen's
selection (`rehearse_select`) and attention over the selected rows where they lie (`attend_rows`),
`attend_span` over every other layer's slots, and the new key's partial key into InfiniGen's cache (the function
the Python path's `StepPartialKeys.write` calls too, so the caches agree to the bit; a dense step leaves it to
the policy, which makes it with the same function when the cache is next read or written). The statistics
are the Python path's (fetched rows, selections, alpha counts, bytes fetched), except the timings: the lane
times its selection and its attention in C++. What it covers: the full, offload and infinigen policies on
float32 rows, no eviction, each selecting layer choosing from its own query (nothing crosses devices, so nothing
is speculated a layer ahead), no soft-capping, no recall measurement. Anything else takes the Python path, which
stays the reference. In the compiled step (compiled.py) the lane's op is in the graph, so that inductor's C++
wrapper calls it without Python; with no lane open the op hands the layer to the Python path.
"""

from __future__ import annotations

import torch

from . import devices
from .fetch import DirectFetcher
from .stats import LayerStats

LANE_POLICIES = ("full", "offload", "infinigen")


def lane_op_loaded() -> bool:
    """Whether this process registered the lane's op (the CPU kernels were built or loaded here)."""
    return hasattr(torch.ops.infinigen_cpu, "attend_layer")


def lane_refusal(work) -> str | None:
    """Why `work`'s (step.LayerWork) one-token steps cannot take the lane; None where they can."""
    attention, policy, adapter, config, pool = work.attention, work.policy, work.adapter, work.config, work.pool
    kernels = attention.kernels
    reasons = [
        (kernels is None or not lane_op_loaded(), "no CPU kernels"),
        (attention.device.type != "cpu" or devices.is_emulated(attention.device) or pool.device != attention.device
         or not isinstance(work.fetcher, DirectFetcher), "the pool is not in the compute device's memory"),
        (devices.active_mode() is not None, "the separate-devices checks must see every op"),
        (pool.dtype != torch.float32, "the pool's rows are not float32"),
        (policy.name not in LANE_POLICIES or policy.needs_attention_weights, f"the {policy.name} policy"),
        (adapter.softcap is not None, "soft-capped attention"),
        (kernels is not None and not kernels.fit(adapter.group_size, adapter.head_dim), "the kernels' head sizes"),
        (config.pool_limit_tokens is not None, "a pool that evicts"),
        (config.record_recall, "recall is measured"),
        (work.rehearses_ahead, "selections are speculated a layer ahead"),
        (getattr(policy, "partial_dtype", torch.float32) != torch.float32, "the partial keys' query side"),
    ]
    return next((reason for refused, reason in reasons if refused), None)


class DecodeLane:
    """One engine's lane under its current settings (step.LayerWork builds it with the work)."""

    def __init__(self, work) -> None:
        self.work = work
        policy, adapter = work.policy, work.adapter
        layers = range(adapter.num_layers)
        # of the lane's policies only InfiniGen has sparse layers, each with a partial-key cache and its projection
        self.sparse = [policy.is_sparse(layer) for layer in layers]
        self.windows = [adapter.sliding_window(layer) for layer in layers]
        self._window_sizes = [window or 0 for window in self.windows]
        self._query_projections = [policy.single_query_projections[layer] if sparse else None
                                   for layer, sparse in enumerate(self.sparse)]
        self._key_projections = [policy.key_projections[layer] if sparse else None
                                 for layer, sparse in enumerate(self.sparse)]
        self._budgets: list[int] = []  # the running step's, per layer (0: it attends to every slot)

    @staticmethod
    def for_work(work) -> DecodeLane | None:
        return DecodeLane(work) if lane_refusal(work) is None else None

    def begin(self, step) -> bool:
        """Open the lane for `step` on this thread; False (nothing opened) where the step needs the Python path."""
        work, pool, policy = self.work, self.work.pool, self.work.policy
        if not step.is_decode or not pool.last_reserved_contiguous or not pool.slots_are_positions:
            return False
        if devices.active_mode() is not None:  # the checks entered after this engine's first step must see every op
            return False
        past = step.past_len
        budgets = self._budgets_for(step, past)
        if any(budget > past for budget in budgets) or (past == 0 and any(budgets)):
            return False  # a budget past the rows held: the Python path's eager selection
        # a step that selects reads the partial keys of every past slot: those a dense step left out are made first
        projects_keys = any(budgets)
        if projects_keys:
            policy.step_keys.complete()
        storage = pool.storage.layers
        torch.ops.infinigen_cpu.lane_begin(
            [store.keys for store in storage], [store.values for store in storage],
            [policy.partial_keys_t[layer] if is_sparse else None for layer, is_sparse in enumerate(self.sparse)],
            self._query_projections, self._key_projections, self._window_sizes, past, budgets,
            [policy.width_of(budget, past) if budget else 0 for budget in budgets] if projects_keys else budgets,
            work.config.alpha, projects_keys)
        self._budgets = budgets
        step.lane = self
        return True

    def _budgets_for(self, step, past: int) -> list[int]:
        """Rows each layer selects this step (0: it attends to every slot); a dense step's at once, with no call
        per layer (a short chat's every step is one)."""
        if step.dense_reason is not None or not any(self.sparse):
            return [0] * len(self.sparse)
        policy = self.work.policy
        return [policy.budget_for(layer, past) if step.selects(layer) else 0 for layer in range(len(self.sparse))]

    def end(self, step) -> None:
        """Close the lane: the layers' statistics into the step (what LayerWork.attend records). The sparse layers'
        new partial keys are in the policy's cache already (written by each layer in C++), or, after a dense step,
        left for the policy to make when something reads the cache."""
        slots, scores, totals, times, read = torch.ops.infinigen_cpu.lane_end()
        past, budgets = step.past_len, self._budgets
        if any(self.sparse) and not any(budgets):  # a dense step: its partial keys are made when next read
            self.work.policy.step_keys.defer(past)
        selected = iter(zip(slots, scores, totals, read))
        layers = step.stats.layers
        for layer, ((select_ns, attend_ns), window) in enumerate(zip(times.tolist(), self.windows)):
            stats = LayerStats(layer=layer, context_len=past, fetched=past if window is None else min(past, window - 1),
                               sparse=False, window=window, compute_ms=attend_ns / 1e6)
            if step.dense_reason is not None and self.sparse[layer]:
                stats.dense_reason = step.dense_reason
            if budgets[layer]:
                stats.selected_positions, stats.selected_scores, total, stats.selected_read = next(selected)
                stats.sparse, stats.fetched, stats.speculate_ms = True, budgets[layer], select_ns / 1e6
                stats.deferred_from = step.stats
                step.device_values.append((stats, total))
                self.work.fetcher.count_rows((budgets[layer] + 1) * self.work.adapter.num_kv_heads)  # new token too
            layers.append(stats)

    @staticmethod
    def abort() -> None:
        torch.ops.infinigen_cpu.lane_abort()
