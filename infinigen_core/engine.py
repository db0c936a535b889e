"""The engine: an unmodified transformers model whose attention reads from our KV pool.

One forward step, in order:
  1. the pool reserves slots for the new tokens (evicting now, if limited);
  2. the model runs its own forward; before each attention module a pre-hook hands that layer's input
     to the policy, which may speculate which slots a later layer needs and start fetching them;
  3. our registered attention function writes the layer's new K/V to the pool, then attends densely
     (prefill, dense layers, dense policies) or over the fetched rows plus the new token;
  4. per-layer statistics of the step are kept for the UI and the benchmarks.
Masks come from the pool's positions, not from transformers, so the mask registration returns None.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .arch import ModelAdapter
from .config import ConfigError, EngineConfig
from .fetch import Fetcher, PendingFetch
from .kv_pool import KVPool
from .policies import POLICIES, PolicyContext, Selection
from .stats import LayerStats, StepStats

ATTENTION_NAME = "infinigen"


class ContextOverflowError(ValueError):
    """The conversation would not fit in the model's context window."""


@dataclass
class _Step:
    engine: "InfiniGenEngine"
    first_position: int
    new_tokens: int
    slots: list[torch.Tensor]
    query_positions: torch.Tensor
    stats: StepStats
    prefetched: dict[int, tuple[PendingFetch, Selection]] = field(default_factory=dict)


def grouped_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """query [heads, n, dim] over keys/values [kv_heads, S, dim]; returns (out [heads, n, dim], probs [kv, group, n, S])."""
    kv_heads, n, dim = keys.shape[0], query.shape[1], query.shape[-1]
    # Fold each KV head's query group into rows of one batched product: keys are read in place, never
    # expanded per query head (a broadcast matmul would materialise a copy of them for every head).
    grouped = query.reshape(kv_heads, -1, dim)  # [kv, group*n, dim]
    logits = torch.bmm(grouped, keys.transpose(1, 2)).float().mul_(scale).view(kv_heads, -1, n, keys.shape[1])
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.bmm(probs.to(values.dtype).view(kv_heads, -1, keys.shape[1]), values).reshape(query.shape)
    return out, probs


def _attention_entry(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    step = kwargs.pop("infinigen_step", None)
    if step is None:  # the model used outside the engine: plain causal attention
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    return step.engine._attend(module.layer_idx, query, key, value, scaling, step)


def _masks_come_from_the_pool(*args, **kwargs):
    return None


AttentionInterface.register(ATTENTION_NAME, _attention_entry)
AttentionMaskInterface.register(ATTENTION_NAME, _masks_come_from_the_pool)


class InfiniGenEngine:
    """Holds one conversation's KV cache for one model and runs forward steps over it.

    >>> engine.prefill(tokenizer("Hello")["input_ids"])      # doctest: +SKIP
    >>> logits = engine.decode(next_token_id)                # doctest: +SKIP
    """

    def __init__(self, model, tokenizer, config: EngineConfig, *, skew_set=None, device: str | torch.device = "cpu",
                 fingerprint: str = "unknown") -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.adapter = ModelAdapter.for_model(model)
        self.device = torch.device(device)
        self.dtype = next(model.parameters()).dtype
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            self.dtype = torch.float16
        self.skew_set = skew_set
        self.fingerprint = fingerprint
        self.token_ids: list[int] = []
        self.history: deque[StepStats] = deque(maxlen=config.history_steps)
        self.steps_run = 0
        self._attention_modules = self.adapter.attention_modules(model)
        model.set_attn_implementation(ATTENTION_NAME)
        self._hooks = [
            module.register_forward_pre_hook(self._before_attention, with_kwargs=True)
            for module in self._attention_modules
        ]
        self.pool: KVPool | None = None
        self.configure(config)

    # ------------------------------------------------------------------ settings
    @torch.inference_mode()
    def configure(self, config: EngineConfig) -> None:
        """Apply new settings; the conversation's cache is kept (and moved or trimmed if needed)."""
        policy_class = POLICIES[config.policy]
        if policy_class.needs_skew and self.skew_set is None:
            raise ConfigError(f"the {config.policy} policy needs the model's skew matrices: calibrate it first")
        pool_device = self.device if policy_class.keeps_pool_on_device else torch.device("cpu")
        old_pool = self.pool
        self.pool = KVPool(
            num_layers=self.adapter.num_layers,
            num_kv_heads=self.adapter.num_kv_heads,
            head_dim=self.adapter.head_dim,
            dtype=self.dtype,
            device=pool_device,
            pin_memory=self.device.type == "cuda",
            limit_tokens=config.pool_limit_tokens,
            sink_tokens=config.sink_tokens,
            recent_window=config.recent_window,
        )
        if old_pool is not None:
            self.pool.copy_from(old_pool)
        self.config = config
        self.history = deque(self.history, maxlen=config.history_steps)
        context = PolicyContext(self.pool, config, self.adapter, self._attention_modules, self.device, self.skew_set)
        self.policy = policy_class(context)
        if getattr(self, "fetcher", None) is not None:
            self.fetcher.close()
        self.fetcher = Fetcher(self.pool, self.device)

    def close(self) -> None:
        """Detach from the model (its hooks) and stop the fetch worker; the engine is unusable after."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.fetcher.close()

    # ------------------------------------------------------------------ conversation
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def max_context(self) -> int:
        return self.adapter.max_context

    @torch.inference_mode()
    def prefill(self, token_ids: Iterable[int], progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
        """Append tokens in chunks of `prefill_chunk`; returns the logits [vocab] after the last one."""
        token_ids = list(token_ids)
        if not token_ids:
            raise ValueError("prefill needs at least one token")
        self._check_fits(len(token_ids))
        logits = None
        for start in range(0, len(token_ids), self.config.prefill_chunk):
            logits = self._forward(token_ids[start : start + self.config.prefill_chunk])[-1]
            if progress is not None:
                progress(min(start + self.config.prefill_chunk, len(token_ids)), len(token_ids))
        return logits

    @torch.inference_mode()
    def decode(self, token_id: int) -> torch.Tensor:
        """Append one token; returns the logits [vocab] for the next."""
        self._check_fits(1)
        return self._forward([token_id])[-1]

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Append tokens one decode step at a time; returns logits [n, vocab] (the same path chat uses)."""
        return torch.stack([self.decode(token) for token in token_ids])

    @torch.inference_mode()
    def truncate(self, n_tokens: int) -> None:
        """Keep the first n_tokens of the conversation (edit, regenerate)."""
        self.pool.truncate(n_tokens)
        del self.token_ids[n_tokens:]
        self.policy.rebuild()

    @torch.inference_mode()
    def reset(self) -> None:
        self.truncate(0)
        self.history.clear()

    @torch.inference_mode()
    def sync_to(self, token_ids: list[int], progress: Callable[[int, int], None] | None = None) -> torch.Tensor | None:
        """Make the cache hold exactly `token_ids`, reusing the longest common prefix; logits after the last.

        Returns None when nothing new had to be run (the cache already held them all).
        """
        common = 0
        for cached, wanted in zip(self.token_ids, token_ids):
            if cached != wanted:
                break
            common += 1
        if common < len(self.token_ids):
            self.truncate(common)
        if common == len(token_ids):
            return None
        return self.prefill(token_ids[common:], progress)

    def recent_decode_steps(self) -> list[StepStats]:
        """The recent decode steps that ran layers, oldest first: a copy, safe to read from another thread
        while this engine keeps decoding (the UI's panels and inspector do)."""
        return [step for step in list(self.history) if step.is_decode and step.layers]

    def _check_fits(self, n_new: int) -> None:
        if self.pool.total_tokens + n_new > self.max_context:
            raise ContextOverflowError(
                f"{self.pool.total_tokens + n_new} tokens would exceed the model's context window of "
                f"{self.max_context}: start a new session or drop the oldest turns"
            )

    # ------------------------------------------------------------------ restore / export (sessions)
    @torch.inference_mode()
    def export_rows(self, start: int, end: int) -> dict[str, torch.Tensor]:
        """K/V rows of positions [start, end) per layer, plus their token ids, as CPU tensors."""
        tensors = {"token_ids": torch.tensor(self.token_ids[start:end], dtype=torch.int64)}
        for layer in range(self.adapter.num_layers):
            positions = self.pool.positions(layer)
            rows = ((positions >= start) & (positions < end)).nonzero().squeeze(1)
            rows = rows[torch.argsort(positions[rows])]
            tensors[f"k.{layer}"] = self.pool.keys(layer)[:, rows].cpu().contiguous()
            tensors[f"v.{layer}"] = self.pool.values(layer)[:, rows].cpu().contiguous()
            tensors[f"pos.{layer}"] = positions[rows].cpu().contiguous()
        return tensors

    @torch.inference_mode()
    def import_rows(self, chunks: Iterable[dict[str, torch.Tensor]]) -> int:
        """Restore exported chunks (in order) after the current tokens, rebuilding partial keys; no model run.

        A chunk's K/V are in any dtype, or int8 codes with `k_scale.L` / `v_scale.L` [kv_heads, rows] beside
        them (row = codes * scale); either way they are written straight into the pool's slots.
        """
        restored = 0
        for chunk in chunks:
            ids = chunk["token_ids"].tolist()
            start = len(self.token_ids)
            for layer in range(self.adapter.num_layers):
                positions = chunk[f"pos.{layer}"]
                if positions.numel() and int(positions.min()) < start:
                    raise ValueError("chunk positions overlap the tokens already cached")
                # int8 chunks carry per-row scales; the pool widens the codes as it copies them in
                self.pool.append_rows(layer, chunk[f"k.{layer}"], chunk[f"v.{layer}"], positions,
                                      chunk.get(f"k_scale.{layer}"), chunk.get(f"v_scale.{layer}"))
            self.token_ids.extend(ids)
            self.pool.set_total_tokens(len(self.token_ids))
            restored += len(ids)
        self.policy.rebuild()
        return restored

    def kv_signature(self) -> dict[str, str]:
        """What a saved pool must match to be reused."""
        skew = self.skew_set.fingerprint() if self.skew_set is not None else "none"
        return {
            "model_fingerprint": self.fingerprint,
            "dtype": str(self.dtype).replace("torch.", ""),
            "num_layers": str(self.adapter.num_layers),
            "num_kv_heads": str(self.adapter.num_kv_heads),
            "head_dim": str(self.adapter.head_dim),
            "skew": skew,
        }

    # ------------------------------------------------------------------ one forward step
    @torch.inference_mode()
    def _forward(self, token_ids: list[int]) -> torch.Tensor:
        n, first = len(token_ids), self.pool.total_tokens
        stats = StepStats(step=self.steps_run, position=first, new_tokens=n)
        step = _Step(
            engine=self,
            first_position=first,
            new_tokens=n,
            slots=self.pool.reserve(n),
            query_positions=torch.arange(first, first + n),
            stats=stats,
        )
        started = time.perf_counter()
        try:
            output = self.model(
                input_ids=torch.tensor([token_ids], device=self.device),
                position_ids=step.query_positions.unsqueeze(0).to(self.device),
                use_cache=False,
                logits_to_keep=1 if n > 1 else 0,
                infinigen_step=step,
            )
        except BaseException:
            self.pool.truncate(first)
            self.policy.rebuild()
            raise
        self.token_ids.extend(token_ids)
        self.steps_run += 1
        stats.total_ms = (time.perf_counter() - started) * 1e3
        stats.pool_bytes = self.pool.bytes_allocated()
        stats.device_bytes = self.device_bytes()
        self.history.append(stats)
        return output.logits[0].float()

    def device_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        partial = getattr(self.policy, "device_bytes", lambda: 0)()
        on_device = self.pool.bytes_allocated() if self.policy.keeps_pool_on_device else 0
        return partial + on_device

    def _before_attention(self, module, args, kwargs):
        step = kwargs.get("infinigen_step")
        # Several engines may wrap one model (tests, the eval tools); each handles only its own steps.
        if step is None or step.engine is not self or step.new_tokens != 1:
            return None
        speculated = self.policy.speculate(
            module.layer_idx, kwargs["hidden_states"], kwargs.get("position_embeddings"), step.first_position
        )
        if speculated is not None:
            target, selection = speculated
            step.prefetched[target] = (self.fetcher.start(target, selection.slots), selection)
        return None

    def _attend(self, layer: int, query, key, value, scaling: float, step: _Step):
        started = time.perf_counter()
        slots = step.slots[layer]
        self.pool.write(layer, slots, key[0], value[0])
        self.policy.on_write(layer, slots, key[0])
        past_len = self.pool.size(layer) - step.new_tokens
        stats = LayerStats(layer=layer, context_len=past_len, fetched=past_len, sparse=False)
        selection = None
        if step.new_tokens == 1 and self.policy.is_sparse(layer):
            if layer in step.prefetched:
                pending, selection = step.prefetched.pop(layer)
            else:
                selection = self.policy.select(layer, past_len, step.first_position)
                pending = self.fetcher.start(layer, selection.slots) if selection is not None else None
        if selection is None:
            out = self._attend_dense(layer, query, scaling, step, slots)
        else:
            out = self._attend_sparse(layer, query, key, value, scaling, pending, selection, stats, slots)
        stats.compute_ms = (time.perf_counter() - started) * 1e3 - stats.fetch_wait_ms
        step.stats.layers.append(stats)
        return out.transpose(0, 1).unsqueeze(0), None  # [1, n, heads, dim]

    def _attend_dense(self, layer, query, scaling, step, new_slots) -> torch.Tensor:
        keys = self.pool.keys(layer).to(self.device, non_blocking=True)
        values = self.pool.values(layer).to(self.device, non_blocking=True)
        positions = self.pool.positions(layer).to(self.device)
        query_positions = step.query_positions.to(self.device)
        mask = positions.unsqueeze(0) <= query_positions.unsqueeze(1)  # [n, S]
        if self.policy.needs_attention_weights:
            out, probs = grouped_attention(query[0], keys, values, scaling, mask)
            self.policy.on_attention(layer, None, probs, new_slots)
            return out
        out = F.scaled_dot_product_attention(
            query, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=scaling, enable_gqa=True
        )
        return out[0]

    def _attend_sparse(self, layer, query, key, value, scaling, pending, selection, stats, new_slots):
        fetched = pending.wait()
        stats.fetch_wait_ms = fetched.wait_ms
        keys = torch.cat([fetched.keys, key[0].to(fetched.keys.dtype)], dim=1)
        values = torch.cat([fetched.values, value[0].to(fetched.values.dtype)], dim=1)
        out, probs = grouped_attention(query[0], keys, values, scaling)
        self.policy.on_attention(layer, selection.slots, probs, new_slots)
        stats.sparse = True
        stats.fetched = selection.slots.shape[1]
        stats.alpha_count = selection.alpha_count
        stats.speculate_ms = selection.speculate_ms
        stats.selected_positions = self.pool.positions(layer)[selection.slots.to(self.pool.device)].cpu()
        stats.selected_scores = selection.scores.cpu() if selection.scores is not None else None
        if self.config.record_recall:
            self._measure_recall(layer, query, key, scaling, selection, stats)
        return out

    def _measure_recall(self, layer, query, key, scaling, selection, stats) -> None:
        """How much of the true (dense) attention mass the fetched rows carry; costs a dense pass."""
        past = self.pool.keys(layer).to(self.device)[:, : self.pool.size(layer)]
        is_past = self.pool.positions(layer).to(self.device) < stats_position(self.pool, layer)
        keys = past[:, is_past]
        slot_of_row = is_past.nonzero().squeeze(1)
        _, probs = grouped_attention(query[0], torch.cat([keys, key[0]], dim=1), torch.cat([keys, key[0]], dim=1), scaling)
        probs = probs[:, :, 0, :]  # [kv, group, rows+1]
        chosen = torch.zeros(probs.shape[0], probs.shape[-1], dtype=torch.bool, device=probs.device)
        row_index = torch.full((self.pool.size(layer),), -1, dtype=torch.long, device=probs.device)
        row_index[slot_of_row] = torch.arange(slot_of_row.numel(), device=probs.device)
        chosen.scatter_(1, row_index[selection.slots.to(probs.device)], True)
        chosen[:, -1] = True  # the new token is always attended
        covered = (probs * chosen.unsqueeze(1)).sum(-1)
        stats.attention_recall = float(covered.mean())
        sorted_probs = probs.sort(dim=-1, descending=True).values.cumsum(-1)
        needed = (sorted_probs < 0.9).sum(-1).float() + 1
        stats.tokens_for_90 = int(needed.mean().round())
        # Kept for the prefetch inspector: the dense attention of this step, averaged over heads.
        stats.true_attention = probs[:, :, :-1].mean(dim=(0, 1)).cpu()
        stats.true_attention_positions = self.pool.positions(layer)[slot_of_row.to(self.pool.device)].cpu()


def stats_position(pool: KVPool, layer: int) -> int:
    """Position of the token being decoded (the newest in the pool)."""
    return int(pool.positions(layer).max())
