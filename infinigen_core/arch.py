"""What the engine needs to know about a model family, and nothing more.

An adapter finds the attention modules, reads the head geometry and the per-layer facts (sliding window
or global, RoPE or none), and rehearses a layer's query from an attention input exactly as that layer's
own attention computes it: the family's projection (separate or fused), its query norm (per head or over
the whole projection), its positional encoding (RoPE of the layer's own kind, partial rotary, or none),
returned in the convention the attention function receives (OPT pre-scales its query; the others pass
their scaling, e.g. Gemma's query_pre_attn_scalar or Granite's attention multiplier, to it).

Every fact here was read from the family's transformers 5.23 modeling code; `FAMILIES` is the one place
that says which families are supported.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Family:
    """How one `model_type` computes its attention query."""

    label: str  # what users call it, for error messages and the README
    query_norm: str = "none"  # "none" | "per_head" (Qwen3, Gemma 3: RMSNorm over head_dim) | "whole" (OLMo 2/3)
    fused_qkv: bool = False  # Phi-3/Phi-4: one qkv_proj, the query is its first heads*head_dim outputs
    window_from: str = "none"  # where a layer's sliding window comes from: "none" | "module" | "config"
    softcap: bool = False  # the attention call passes softcap=config.attn_logit_softcapping (Gemma 2)
    rope: bool = True  # OPT has learned absolute positions instead


FAMILIES: dict[str, Family] = {
    "llama": Family("Llama 2/3.x"),
    "mistral": Family("Mistral", window_from="config"),
    "ministral": Family("Ministral", window_from="module"),
    "qwen2": Family("Qwen2/Qwen2.5", window_from="module"),
    "qwen3": Family("Qwen3", query_norm="per_head", window_from="module"),
    "olmo2": Family("OLMo 2", query_norm="whole"),
    "olmo3": Family("OLMo 3", query_norm="whole", window_from="module"),
    "phi3": Family("Phi-3/Phi-4", fused_qkv=True, window_from="config"),
    "gemma2": Family("Gemma 2", window_from="module", softcap=True),
    "gemma3_text": Family("Gemma 3 (text)", query_norm="per_head", window_from="module"),
    # the 4B-27B checkpoints carry a vision tower: their language model is used, on text only
    "gemma3": Family("Gemma 3 (language model of the multimodal checkpoints)", query_norm="per_head",
                     window_from="module"),
    "smollm3": Family("SmolLM3", window_from="module"),
    "granite": Family("Granite"),
    "opt": Family("OPT", rope=False),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)


class UnsupportedModelError(ValueError):
    pass


def unsupported_message(model_type: str, where: str = "") -> str:
    families = ", ".join(f"{name} ({family.label})" for name, family in FAMILIES.items())
    return (f"model type {model_type!r}{where} is not supported; supported model types: {families}. "
            "Other multimodal checkpoints are not")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the first cos.shape[-1] channels (all of them, or Phi's partial rotary)."""
    rotary = cos.shape[-1]
    rotated, passed = x[..., :rotary], x[..., rotary:]
    half = rotary // 2
    turned = torch.cat((-rotated[..., half:], rotated[..., :half]), dim=-1)
    return torch.cat((rotated * cos + turned * sin, passed), dim=-1)


@dataclass(frozen=True)
class ModelAdapter:
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    logit_scale: float  # multiplies q.k in the attention function to give attention logits
    max_context: int
    windows: tuple[int | None, ...] = ()  # per layer: its sliding window in tokens, None for a global layer
    rope_layers: tuple[bool, ...] = ()  # per layer: does it rotate its queries and keys (SmolLM3: not all)
    softcap: float | None = None  # attention logits become softcap * tanh(logits / softcap)
    family: Family = field(default_factory=lambda: FAMILIES["llama"])
    # Gemma 3 / OLMo 3 rotate sliding and global layers with different RoPE bases: the model's rotary
    # module and each layer's type let a rehearsal use the target layer's own (cos, sin).
    rotary: torch.nn.Module | None = field(default=None, compare=False, repr=False)
    layer_types: tuple[str, ...] = ()

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    # ---------------------------------------------------------------- per-layer facts
    def sliding_window(self, layer: int) -> int | None:
        """The layer's sliding window (it attends to the last `window` positions, itself included), or None."""
        return self.windows[layer] if self.windows else None

    def uses_rope(self, layer: int) -> bool:
        return self.rope_layers[layer] if self.rope_layers else self.family.rope

    def plain_rotary_query(self, layer: int) -> bool:
        """The layer's query is q_proj(x) rotated by the cos/sin the model passes, over every channel (the
        Llama recipe): InfiniGen can then fold RoPE into two small products (see policies/infinigen.py)."""
        family = self.family
        return (family.rope and family.query_norm == "none" and not family.fused_qkv and self.rotary is None
                and self.uses_rope(layer))

    def is_global(self, layer: int) -> bool:
        """A layer that attends over the whole context: the only kind InfiniGen selects on."""
        return self.sliding_window(layer) is None

    def layer_kind(self, layer: int) -> str:
        """'global', 'sliding N' or 'global, no RoPE': what the panels and statistics call the layer."""
        window = self.sliding_window(layer)
        kind = "global" if window is None else f"sliding {window}"
        return kind if self.uses_rope(layer) or not self.family.rope else f"{kind}, no RoPE"

    # ---------------------------------------------------------------- construction
    @staticmethod
    def for_model(model: torch.nn.Module) -> "ModelAdapter":
        model_type = getattr(model.config, "model_type", "?")
        if model_type not in FAMILIES:
            raise UnsupportedModelError(unsupported_message(model_type))
        family = FAMILIES[model_type]
        config = model.config.get_text_config()  # the model's own config, or a multimodal one's language part
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        max_context = int(getattr(config, "max_position_embeddings", 2048))
        attention = _decoder_layers(model, model_type)
        modules = [layer.self_attn for layer in attention]
        # The scaling each attention module passes to its attention call (head_dim**-0.5, Gemma's
        # query_pre_attn_scalar**-0.5, Granite's attention_multiplier); OPT folds it into its query.
        scale = 1.0 if model_type == "opt" else float(modules[-1].scaling)
        windows = tuple(_window(family, config, module, max_context) for module in modules)
        rope_layers = tuple(bool(getattr(module, "use_rope", family.rope)) for module in modules)
        softcap = getattr(config, "attn_logit_softcapping", None) if family.softcap else None
        rotary = getattr(_language_model(model), "rotary_emb", None)
        per_type = rotary is not None and hasattr(rotary, "layer_types") and getattr(config, "layer_types", None)
        return ModelAdapter(
            model_type=model_type,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            logit_scale=scale,
            max_context=max_context,
            windows=windows,
            rope_layers=rope_layers,
            softcap=float(softcap) if softcap else None,
            family=family,
            rotary=rotary if per_type else None,
            layer_types=tuple(config.layer_types) if per_type else (),
        )

    def decoder_layers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return _decoder_layers(model, self.model_type)

    def attention_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [layer.self_attn for layer in self.decoder_layers(model)]

    def query_key_weights(self, attention: torch.nn.Module) -> list[torch.Tensor]:
        """The weights that make a layer's queries and keys (for fingerprinting a model)."""
        if self.family.fused_qkv:
            return [attention.qkv_proj.weight]
        return [attention.q_proj.weight, attention.k_proj.weight]

    # ---------------------------------------------------------------- rehearsal
    def rehearse_query(
        self,
        attention: torch.nn.Module,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Query [heads, n, head_dim] that `attention` would compute from `hidden_states` [1, n, hidden].

        `position_embeddings` are the (cos, sin) the model passed to the layer whose input this is; a family
        whose layers rotate differently by type (Gemma 3) recomputes them for `attention`'s own layer from
        `positions` [n].
        """
        layer = attention.layer_idx
        # the modules themselves, not F.linear on their weights: bitsandbytes 8/4-bit layers store packed weights
        if self.family.fused_qkv:
            query = attention.qkv_proj(hidden_states[0])[:, : self.num_heads * self.head_dim]
        else:
            query = attention.q_proj(hidden_states[0])  # [n, heads*dim]
        if self.family.query_norm == "whole":
            query = attention.q_norm(query)
        query = query.view(-1, self.num_heads, self.head_dim)
        if self.family.query_norm == "per_head":
            query = attention.q_norm(query)
        query = query.transpose(0, 1)  # [heads, n, dim]
        if self.model_type == "opt":
            return query * attention.scaling
        if not self.uses_rope(layer):
            return query
        if self.rotary is not None:
            if positions is None:
                raise ValueError(f"{self.family.label} rotates each layer type differently: pass the positions")
            position_ids = positions.to(hidden_states.device).view(1, -1)
            position_embeddings = self.rotary(hidden_states, position_ids, self.layer_types[layer])
        cos, sin = position_embeddings
        return apply_rope(query, cos[0].unsqueeze(0), sin[0].unsqueeze(0))  # cos [1, n, rotary]


def _language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module holding the decoder layers and the rotary embedding."""
    return getattr(model.model, "language_model", model.model)


def _decoder_layers(model: torch.nn.Module, model_type: str) -> list[torch.nn.Module]:
    if model_type == "opt":
        return list(model.model.decoder.layers)
    return list(_language_model(model).layers)


def _window(family: Family, config, attention: torch.nn.Module, max_context: int) -> int | None:
    """The layer's effective sliding window: None when global, or when the window spans the whole context
    (Phi-3.5 and Phi-4-mini set a 262144-token window on a 131072-token model)."""
    if family.window_from == "module":
        window = getattr(attention, "sliding_window", None)
    elif family.window_from == "config":
        window = getattr(config, "sliding_window", None)
    else:
        window = None
    return int(window) if window and window < max_context else None
