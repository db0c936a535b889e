"""InfiniGen: rehearse layer i+1's attention from layer i's input, fetch only the tokens it will need.

Per sparse layer a partial key cache [kv_heads, r, slots] stays on the compute device: the keys through
the layer's skew, keeping its r strongest channels. During decoding, the pre-hook of layer i projects
layer i's attention input with layer i+1's query weights (and RoPE at the current position), skews it,
and scores every past token against the partial keys. Each KV head takes the top-k slots by the *sum of
its query group's rehearsed softmax weights*, so a token that any head of the group cares about strongly
is kept, and fetching stays one uniform [kv_heads, k] gather.

Nothing is read back to the host: k is the budget (a length the host knows), the slots come out ranked,
and the paper's alpha rule (keep as many tokens as lie, on average over query heads, within alpha of a
head's top rehearsed logit) becomes a mask over the ranks that attention applies on the device.

Where the CPU kernels read the rows where they lie, the KV heads of a layer share one budget of
kv_heads x k rows (EngineConfig.budget_by_head): the (head, slot) pairs with the largest summed weights of
all the heads' best 2k, so a head whose group spreads its attention reads more rows and one that looks at a
few tokens fewer. The selection is then 2k wide, its mask one per head (the rows past a head's count masked
like those past the alpha count). On SmolLM2 at 4k this took perplexity over `full` from +1.05% to +0.79%
at the default budget (docs/BENCHMARKS.md).

On the CPU with the kernels built (cpu_kernels.py), the score product, the alpha count, the group sum and
the top-k are one `rehearse_select` call instead; its slots are partitioned rather than ranked (each head's
best `kept` first, which is all the mask needs), and the partial key cache holds int8 codes with a power-of-two
scale per slot (partial_codes.py), widened as they are read: a quarter of float32's bytes for the read that
dominates a selection at long contexts.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping

import torch

from ..budget_shares import spread_for
from ..huge_pages import advise_huge_pages
from . import partial_codes
from .base import KVPolicy, Selection

PARTIAL_ROW_PADDING_BYTES = 64  # one cache line between a channel's row of partial keys and the next
HEAD_SHARE_CAP = 2  # where the KV heads share a budget (budget_by_head), one head reads at most 2k rows


def padded_partial_key_cache(shape: tuple[int, int, int], capacity: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An unwritten partial key cache [*shape, capacity] ([sparse layers, kv_heads, r, slots]) whose channel rows
    lie a cache line more than `capacity` slots apart. A selection reads every channel's row at the same slots;
    rows a power of two of bytes apart (a capacity of 32,768 float16 slots: 64 KB) fall into the same few sets
    of the CPU's caches and evict each other, prefetched lines included, before they are read: Gemma 3's
    selection at 32k took 1.6x as long (docs/BENCHMARKS.md)."""
    storage = torch.empty(*shape, capacity + PARTIAL_ROW_PADDING_BYTES // dtype.itemsize, device=device, dtype=dtype)
    advise_huge_pages(storage)  # the selection reads every slot's partial key: fewer page walks
    return storage[..., :capacity]


class InfiniGenPolicy(KVPolicy):
    name = "infinigen"
    needs_skew = True

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        if ctx.skew_set is None:
            raise ValueError("the infinigen policy needs a skew set (calibrate the model first)")
        device, adapter = ctx.compute_device, ctx.adapter
        # float32 where the CPU computes; the model's own dtype on a GPU (half the memory and bandwidth)
        self.partial_dtype = torch.float32 if device.type == "cpu" else ctx.pool.dtype
        self.projections = [
            ctx.skew_set.partial_projection(layer, self.config.partial_ratio).to(device=device, dtype=torch.float32)
            for layer in range(adapter.num_layers)
        ]
        # what the partial key cache stores: int8 codes where every selection goes through the CPU kernels,
        # which read them as they lie (partial_codes.py: a quarter of the memory and of the bytes a selection
        # reads; each slot's exponent is one more channel row), else the above
        partial_channels = self.projections[0].shape[-1]
        kernels_always = (ctx.kernels is not None and device.type == "cpu" and adapter.softcap is None
                          and self.config.pool_limit_tokens is None
                          and ctx.kernels.fit(adapter.group_size, partial_channels))
        self.partial_store_dtype = torch.int8 if kernels_always else self.partial_dtype
        self.coded = self.partial_store_dtype == torch.int8
        # the query side also carries the attention scale, so rehearsed logits come out of one product
        self.query_projections = [(p * adapter.logit_scale).to(self.partial_dtype) for p in self.projections]
        self.key_projections = [p.to(self.partial_dtype) for p in self.projections]
        self.single_query_projections = self.query_projections
        self.rotary = [adapter.plain_rotary_query(layer) for layer in range(adapter.num_layers)]
        if any(self.rotary):
            self._init_rotary_rehearsal(device)
        self.sparse_layers = [layer for layer in range(adapter.num_layers) if self.is_sparse(layer)]
        # every sparse layer's key projection in one batch: a decode step's new partial keys are one product
        self._stacked_key_projections = (torch.cat([self.key_projections[layer] for layer in self.sparse_layers])
                                         if self.sparse_layers else None)
        # {sparse layer: multiple of the uniform budget} from the calibrated attention curves (a flat layer reads
        # more, a peaked one less, their mean at most 1); {} (uniform) for a token budget, `budget_by_layer` off, or
        # a skew set calibrated without curves
        self.budget_shares = spread_for(self.config, ctx.skew_set.attention_curves, self.sparse_layers)
        # the heads share a layer's budget only where the kernels read just the rows each head keeps where they lie:
        # a gather, a copy to a GPU or a pool that counts fetches would carry every head's widest selection
        self.heads_share_budget = (self.config.budget_by_head and adapter.num_kv_heads > 1 and kernels_always
                                   and ctx.pool.device == device and ctx.pool.dtype == torch.float32
                                   and ctx.kernels.fit(adapter.group_size, adapter.head_dim))
        self._digests = {layer: projection_digest(ctx.skew_set.partial_projection(layer, self.config.partial_ratio))
                         for layer in self.sparse_layers}
        self._partial_all: torch.Tensor | None = None  # [sparse layers, kv_heads, r, capacity]
        self.partial_keys_t: list[torch.Tensor | None] = [None] * adapter.num_layers  # views into it
        self.step_keys = StepPartialKeys(self)  # each decode step's new partial keys
        self._rank_thresholds = torch.empty(1, 0, dtype=torch.int64, device=device)
        self.rebuild()

    def budget_for(self, layer: int, past_len: int) -> int:
        """The uniform budget (its floor included) times the layer's share, rounded down (so the layers together
        never fetch more than the uniform budget would), at least 1 and at most the past."""
        rows = self.config.budget_tokens_for(past_len)
        share = self.budget_shares.get(layer)
        return rows if share is None else max(1, min(past_len, int(share * rows + 1e-9)))

    def width_of(self, rows: int, past_len: int) -> int:
        """k rows per head, or where the heads share the budget up to HEAD_SHARE_CAP x k slots named per head."""
        return min(past_len, HEAD_SHARE_CAP * rows) if self.heads_share_budget else rows

    # ---------------------------------------------------------------- partial key cache
    # Stored channel-major, [kv_heads, r, capacity]: the score product then reads a plain strided slice
    # [:, :, :size] without copying it, which at 8k tokens saves tens of MB of copies per decode step.
    def ensure_capacity(self, capacity: int) -> None:
        cache = self._partial_all
        if self.sparse_layers and (cache is None or cache.shape[3] < capacity):
            self._replace_cache(capacity, cache)
        if self._rank_thresholds.shape[1] < capacity + 1:
            # rank r of the selected rows (the new token is rank -1) is kept while r * heads < heads' total
            # count within alpha, i.e. r < the mean count: a compare against one device scalar
            heads = self.ctx.adapter.num_heads
            self._rank_thresholds = (torch.arange(-1, capacity, device=self.ctx.compute_device) * heads).view(1, -1)

    def release_capacity(self, capacity: int) -> None:
        """Copies of the slots kept (a slice would hold on to the whole old cache)."""
        self.step_keys.complete()
        cache = self._partial_all
        if cache is not None and cache.shape[3] > capacity:
            self._replace_cache(capacity, cache[..., :capacity])
        if self._rank_thresholds.shape[1] > capacity + 1:
            self._rank_thresholds = self._rank_thresholds[:, : capacity + 1].clone()

    def _replace_cache(self, capacity: int, kept: torch.Tensor | None) -> None:
        """A new cache of `capacity` slots holding `kept`'s first slots, zeros after them."""
        heads, _, r = self.key_projections[self.sparse_layers[0]].shape
        rows = r + 1 if self.coded else r  # int8 codes: each slot's exponent after its channels
        cache = padded_partial_key_cache((len(self.sparse_layers), heads, rows), capacity, self.partial_store_dtype,
                                         self.ctx.compute_device).zero_()
        if kept is not None:
            cache[..., : kept.shape[3]] = kept
        self._partial_all = cache
        for index, layer in enumerate(self.sparse_layers):
            self.partial_keys_t[layer] = cache[index]

    def rebuild(self, stored: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """Every slot's partial key again, from the pool's keys (a restore, a truncate that moved rows, a
        policy built over a pool that holds tokens), or, for the positions `stored` holds (a restore of chunks
        that carry them, base.KVPolicy.rebuild), the saved ones as they are. Written at once, never left for
        `finish_step`, which expects exactly one decode step's keys (a pool of one token would otherwise look
        like one)."""
        pool = self.ctx.pool
        self.ensure_capacity(pool.capacity)
        self.step_keys.forget()  # every slot is written below
        if not pool.size():
            return
        # the slots index the partial key cache, on the compute device (the pool may be in host memory)
        device = self.ctx.compute_device
        for layer in self.sparse_layers:
            saved = stored.get(layer) if stored else None
            missing = self._place_stored(layer, *saved) if saved is not None else None
            if missing is None:
                self._write_partial_keys(layer, torch.arange(pool.size(), device=device), pool.keys(layer))
            elif missing.numel():
                self._write_partial_keys(layer, missing.to(device), pool.keys(layer).index_select(1, missing))

    def _place_stored(self, layer: int, positions: torch.Tensor, partial: torch.Tensor) -> torch.Tensor | None:
        """Write saved partial keys [kv_heads, n, r] of `positions` [n] into the slots holding those positions;
        returns the slots (pool device) they do not cover, or None where they do not fit this layer."""
        pool, cache = self.ctx.pool, self.partial_keys_t[layer]
        heads, r = cache.shape[0], self.key_projections[layer].shape[2]
        if partial.dim() != 3 or partial.shape != (heads, positions.numel(), r) or not positions.numel():
            return None
        held = pool.positions(layer)
        positions, order = positions.to(held.device).sort()
        found = torch.searchsorted(positions, held).clamp_(max=positions.numel() - 1)
        hit = positions[found] == held
        slots = hit.nonzero().squeeze(1)
        device = self.ctx.compute_device
        keys = partial.to(device).index_select(1, order[found[slots]].to(device))
        self._store_partial(layer, slots.to(device), keys)
        return (~hit).nonzero().squeeze(1)

    def partial_key_digests(self) -> dict[int, str]:
        return dict(self._digests)

    def export_partial_keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor | None:
        self.step_keys.complete()
        cache = self.partial_keys_t[layer]
        if layer not in self._digests or cache is None:
            return None
        chosen = cache.index_select(2, slots.to(self.ctx.compute_device))
        if self.coded:  # their values exactly, in float16 (partial_codes.py): a restore encodes them back to the bit
            chosen = partial_codes.decode(chosen, channel_dim=1).half()
        return chosen.transpose(1, 2).cpu().contiguous()

    def on_write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        if not self.is_sparse(layer):
            return
        self.step_keys.complete()  # before this step's keys (the pool's rows are read as they are now)
        if keys.shape[1] == 1 and self.ctx.pool.last_reserved_contiguous:
            # one token in the same slot of every layer: kept for finish_step, which writes them all at once
            # (nothing reads this token's partial key before the next step)
            self.step_keys.keep(self._on_compute(keys), slots)
            return
        self._write_partial_keys(layer, slots, keys)

    def _on_compute(self, keys: torch.Tensor) -> torch.Tensor:
        device = self.ctx.compute_device
        if keys.dtype != self.partial_dtype or keys.device != device:
            keys = keys.to(device=device, dtype=self.partial_dtype)
        return keys

    def _write_partial_keys(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """keys [kv_heads, n, dim] (any device) of `slots` (compute device) into the layer's partial keys."""
        self._store_partial(layer, slots, torch.bmm(self._on_compute(keys), self.key_projections[layer]))

    def _store_partial(self, layer: int, slots: torch.Tensor, partial: torch.Tensor) -> None:
        """Partial keys [kv_heads, n, r] of `slots` (compute device) into the layer's cache, as `stored_partial` keeps
        them: int8 codes straight into the cache by the kernels' op (the same codes as partial_codes.encode)."""
        if self.coded:
            torch.ops.infinigen_cpu.encode_partial_keys(partial.float().contiguous(), self.partial_keys_t[layer], slots)
            return
        stored = stored_partial(partial, self.partial_store_dtype)
        self.partial_keys_t[layer].index_copy_(2, slots, stored.transpose(1, 2))

    def finish_step(self, completed: bool) -> None:
        # a captured step hands its RoPE factors back in the same buffer: never keep them past the step
        self._rope_source = self._rope_factors = None
        self.step_keys.finish(completed)

    def partial_keys(self, layer: int) -> torch.Tensor:
        """[kv_heads, slots, r]: the layer's skewed partial keys, slot by slot (a view; decoded values for int8)."""
        self.step_keys.complete()
        held = self.partial_keys_t[layer][:, :, : self.ctx.pool.size()]
        return (partial_codes.decode(held, channel_dim=1) if self.coded else held).transpose(1, 2)

    def device_bytes(self) -> int:
        cache = self._partial_all  # the sparse layers' caches are views into it, together all of it
        return 0 if cache is None else cache.numel() * cache.element_size()

    # ---------------------------------------------------------------- speculation
    def _init_rotary_rehearsal(self, device) -> None:
        """RoPE and the skew in two small products instead of a dozen ops per layer (`rotate_half_pairs`)."""
        pairs = rotate_half_pairs(self.ctx.adapter.head_dim)
        self._rotate_pairs = pairs.to(device=device, dtype=self.partial_dtype)
        self.query_projections = [torch.cat([p, p], dim=1) for p in self.query_projections]  # [kv, 2 dim, r]
        self._rope_source: torch.Tensor | None = None
        self._rope_factors: torch.Tensor | None = None

    def _rehearse(self, target: int, hidden_states, position_embeddings, positions) -> torch.Tensor:
        """Layer `target`'s partial, skewed, scaled query [kv_heads, group, r] from an attention input (the
        previous layer's, when speculating ahead)."""
        adapter = self.ctx.adapter
        attention = self.ctx.attention_modules[target]
        cos = position_embeddings[0] if position_embeddings is not None else None
        # the family's own recipe where it is not plain RoPE (query norms, fused projections, no RoPE, ...)
        if not self.rotary[target] or cos.shape[-1] != adapter.head_dim:
            return self._skewed(target, adapter.rehearse_query(attention, hidden_states, position_embeddings, positions))
        sin = position_embeddings[1]
        if cos is not self._rope_source:  # the same for every layer of a step: build it once per step
            self._rope_source = cos
            self._rope_factors = torch.cat([cos[0], sin[0]], dim=-1).to(self.partial_dtype)  # [1, 2 dim]
        # the module itself, not its weight: a bitsandbytes 8/4-bit layer stores packed weights
        query = attention.q_proj(hidden_states[0]).view(adapter.num_kv_heads, adapter.group_size, adapter.head_dim)
        if query.dtype != self.partial_dtype:
            query = query.to(self.partial_dtype)
        rotated = torch.matmul(query, self._rotate_pairs).mul_(self._rope_factors)
        return torch.bmm(rotated, self.query_projections[target])

    def speculate(self, layer, hidden_states, position_embeddings, positions, past_len, new_slots=None):
        return self._select(layer + 1, hidden_states, position_embeddings, positions, past_len, new_slots)

    def select_from_query(self, layer, query, past_len, new_slots=None):
        """The layer's own query, as its attention gets it (normed and rotated), through the partial skew: the
        true partial logits, with no projection computed again."""
        started = time.perf_counter()
        return self._select_partial(layer, self._skewed(layer, query), past_len, new_slots, started)

    def _skewed(self, layer: int, query: torch.Tensor) -> torch.Tensor:
        """A layer's query (normed and rotated as its attention computes it; heads in order) through the
        layer's partial skew and the attention scale (`logit_scale`, folded in): [kv_heads, group, r]."""
        adapter = self.ctx.adapter
        query = query.reshape(adapter.num_kv_heads, adapter.group_size, adapter.head_dim)
        if query.dtype != self.partial_dtype:
            query = query.to(self.partial_dtype)
        return torch.bmm(query, self.single_query_projections[layer])

    def _select(self, target, hidden_states, position_embeddings, positions, past_len, new_slots):
        """The top-k slots of `target` from an attention input (see `_rehearse`)."""
        started = time.perf_counter()
        partial_query = self._rehearse(target, hidden_states, position_embeddings, positions)
        return self._select_partial(target, partial_query, past_len, new_slots, started)

    def _select_partial(self, target, partial_query, past_len, new_slots, started: float) -> Selection:
        """The top-k slots of `target` for a partial, skewed, scaled query [kv_heads, group, r]."""
        self.step_keys.complete()
        kernels = self.ctx.kernels
        k = self.budget_for(target, past_len)
        width = self.width_of(k, past_len)
        if (kernels is not None and new_slots is None and self.ctx.adapter.softcap is None and k <= past_len
                and partial_query.dtype == torch.float32 and kernels.fit(partial_query.shape[1], 0)):
            # the CPU's one-pass kernel: the same logits, mask and top-k as below, without a dozen eager ops
            slots, scores, valid, alpha_total = kernels.rehearse_select(
                partial_query, self.partial_keys_t[target], past_len, k, self.config.alpha, width)
            selection = Selection(slots, scores=scores, valid=valid, alpha_total=alpha_total,
                                  per_head=k if width > k else None)
            selection.speculate_ms = (time.perf_counter() - started) * 1e3
            return selection
        # the new token's slot is the last one: the past is the slots before it; after eviction the new token
        # took a victim's slot, still holding the victim's partial key
        stored = self.partial_keys_t[target][:, :, : past_len + (0 if new_slots is None else 1)]
        if self.coded:  # int8 codes outside the kernels' reach (a k past the slots): the kernel's logits
            logits = partial_codes.logits(partial_query, stored)
        else:
            logits = torch.bmm(partial_query, stored.to(partial_query.dtype))
        if new_slots is not None:
            logits.index_fill_(2, new_slots, float("-inf"))
        if logits.dtype != torch.float32:
            logits = logits.float()
        softcap = self.ctx.adapter.softcap
        if softcap is not None:  # rehearse the family's soft-capping too (Gemma 2)
            logits = torch.tanh(logits / softcap) * softcap
        selection = self.choose(logits, k, new_slots, width)
        selection.speculate_ms = (time.perf_counter() - started) * 1e3
        return selection

    def choose(self, logits: torch.Tensor, k: int, new_slots: torch.Tensor | None = None,
               width: int | None = None) -> Selection:
        """Top-k slots per KV head, ranked, from rehearsed logits [kv_heads, group, slots] and a rank mask; with a
        `width` > k the heads' kv_heads x k best of their best `width` each (see `shared_selection`)."""
        peak = logits.amax(dim=-1, keepdim=True)
        alpha_total = (logits > peak - self.config.alpha).sum()  # over every query head
        weights = torch.softmax(logits, dim=-1).sum(dim=1)  # [kv_heads, slots]
        if new_slots is not None:  # weights that underflow to 0 must still never pick the slot being written
            weights.index_fill_(1, new_slots, -1.0)
        if width is not None and width > k:
            if self._rank_thresholds.shape[1] < width + 1:
                self.ensure_capacity(width)
            return shared_selection(weights, k, width, alpha_total, self._rank_thresholds, self.ctx.adapter.num_heads)
        # ranked: an unsorted top-k then a sort of its k values is several times cheaper than a sorted top-k
        top = weights.topk(k, dim=-1, sorted=False)
        scores, order = top.values.sort(dim=-1, descending=True)
        slots = top.indices.gather(1, order)
        if self._rank_thresholds.shape[1] < k + 1:
            self.ensure_capacity(k)
        valid = self._rank_thresholds[:, : k + 1] < alpha_total  # [1, k + 1]
        return Selection(slots, scores=scores, valid=valid, alpha_total=alpha_total)


class StepPartialKeys:
    """The partial keys of each decode step's new token, in every sparse layer of an InfiniGen policy.

    On the Python path a step's keys are kept as its layers write them and projected at its end, all at once. Where
    the CPU kernels are built that goes through the decode lane's own function (decode_lane.cpp, `project_key`),
    so that a step on this path and one in the lane leave the same bits. A lane step that is dense (a short
    chat's: nothing selects) leaves them out: read cold after the model's weights, the projections and the cache's
    lines cost such a step ~0.2 ms, and no selection reads them before a step that selects. `complete` makes them,
    from the pool's keys, before anything reads or writes the cache."""

    def __init__(self, policy: InfiniGenPolicy) -> None:
        self.policy = policy
        ctx = policy.ctx
        self.in_kernel = (ctx.kernels is not None and ctx.compute_device.type == "cpu"
                          and policy.partial_dtype == torch.float32
                          and hasattr(torch.ops.infinigen_cpu, "write_step_partial_keys"))
        self.pending: list[torch.Tensor] = []  # this step's new keys [kv_heads, 1, dim], one per sparse layer
        self.pending_slots: torch.Tensor | None = None
        self.unprojected: tuple[int, int] | None = None  # slots [first, end) dense lane steps left out

    def keep(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        self.pending.append(keys)
        self.pending_slots = slots

    def forget(self) -> None:
        """Every slot's partial key is about to be written again (a rebuild)."""
        self.pending, self.unprojected = [], None

    def finish(self, completed: bool) -> None:
        pending, self.pending = self.pending, []
        if not completed or not pending:
            return
        if len(pending) != len(self.policy.sparse_layers):  # not a whole step's worth: cannot happen, but stay exact
            raise RuntimeError("a decode step wrote the keys of only some sparse layers")
        self.write(torch.stack(pending), self.pending_slots)

    def write(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """One decode step's new keys of every sparse layer [sparse layers, kv_heads, 1, dim] through their
        projections, into the partial key cache at `slots` (one slot, the same in every layer: the pool's last)."""
        policy = self.policy
        if self.in_kernel:
            # the slot from the host's count, not from `slots` (on the compute device: reading it would wait there)
            torch.ops.infinigen_cpu.write_step_partial_keys(keys, policy._stacked_key_projections, policy._partial_all,
                                                            policy.ctx.pool.size() - 1)
            return
        layers, heads, _, dim = keys.shape
        partial = stored_partial(torch.bmm(keys.view(-1, 1, dim), policy._stacked_key_projections),
                                 policy.partial_store_dtype)
        policy._partial_all.index_copy_(3, slots, partial.view(layers, heads, -1, 1))

    def defer(self, slot: int) -> None:
        """A decode lane's dense step left out the partial keys of `slot` (of every sparse layer)."""
        first, end = self.unprojected or (slot, slot + 1)
        self.unprojected = (min(first, slot), max(end, slot + 1))

    def complete(self) -> None:
        """The partial keys dense lane steps left out, from the pool's keys through the lane's own function
        (decode_lane.cpp, `project_slots`): the bits each step would have written. Slots past the pool's tokens
        (after a truncate) hold nothing to keep."""
        if self.unprojected is None:
            return
        first, end = self.unprojected
        self.unprojected = None
        policy, pool = self.policy, self.policy.ctx.pool
        end = min(end, pool.size())
        if first < end:
            keys = [pool.keys(layer) for layer in policy.sparse_layers]
            torch.ops.infinigen_cpu.project_slots(keys, policy._stacked_key_projections, policy._partial_all, first, end)


def shared_selection(weights: torch.Tensor, k: int, width: int, alpha_total: torch.Tensor,
                     rank_thresholds: torch.Tensor, heads: int) -> Selection:
    """The KV heads' shared budget from their summed weights [kv_heads, slots]: each head's best `width` slots,
    ranked, and of all of them the kv_heads x k with the largest weights; a head reads those of its own, past the
    alpha rank masked as before. The mask is one per head [kv_heads, width + 1]: rank r is kept while r < the
    head's count and r x heads < the alpha total, i.e. r x heads < the smaller of the two (`rank_thresholds` [1,
    >= width + 1] holds r x heads from r = -1: the new token, always kept)."""
    kv_heads = weights.shape[0]
    top = weights.topk(width, dim=-1)  # sorted
    cut = top.values.reshape(-1).topk(kv_heads * k, sorted=False).values.min()
    counts = (top.values >= cut).sum(dim=1, keepdim=True)  # [kv_heads, 1], summing to kv_heads x k (ties aside)
    valid = rank_thresholds[:, : width + 1] < torch.minimum(counts * heads, alpha_total)  # [kv_heads, width + 1]
    return Selection(top.indices, scores=top.values, valid=valid, alpha_total=alpha_total, per_head=k)


def rotate_half_pairs(dim: int) -> torch.Tensor:
    """[I | R] [dim, 2 dim], R the signed permutation of rotate_half. RoPE is q * cos + rotate_half(q) * sin, so with
    q2 = q @ [I | R] and c = [cos | sin] the rotated, skewed query is (q2 * c) @ [A; A]: one product with this
    matrix, one multiply by the step's c, one product with the stacked skew, instead of a dozen ops per layer."""
    half = dim // 2
    rotate = torch.zeros(dim, dim)
    rotate[torch.arange(half) + half, torch.arange(half)] = -1.0  # out[c] = -q[c + half]   (c < half)
    rotate[torch.arange(half), torch.arange(half) + half] = 1.0  # out[c] = q[c - half]    (c >= half)
    return torch.cat([torch.eye(dim), rotate], dim=1)


def stored_partial(partial: torch.Tensor, store_dtype: torch.dtype) -> torch.Tensor:
    """Partial keys [..., r] as a cache of `store_dtype` holds them: int8 codes [..., r + 1] (partial_codes.py),
    else in that dtype (float16's range bounds them: no key turns into an infinity)."""
    if store_dtype == torch.int8:
        return partial_codes.encode(partial)
    if partial.dtype == store_dtype:
        return partial
    if store_dtype == torch.float16:
        partial = partial.clamp(-65504.0, 65504.0)
    return partial.to(store_dtype)


def projection_digest(projection: torch.Tensor) -> str:
    """A short digest of a layer's partial key projection [kv_heads, dim, r] (its skew and chosen channels):
    what a layer's partial keys depend on besides its keys."""
    projection = projection.detach().to("cpu", torch.float32).contiguous()
    digest = hashlib.sha256(str(tuple(projection.shape)).encode())
    digest.update(projection.numpy().tobytes())
    return digest.hexdigest()[:16]
