"""What the engine needs to know about a model family, and nothing more.

An adapter finds the attention modules, reads the head geometry, and rehearses a layer's query from an
attention input: the same projection (and RoPE, for Llama-style models) the layer itself would apply,
returned in the convention the attention function receives (OPT pre-scales its query; Llama does not).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LLAMA_LIKE = ("llama", "mistral", "qwen2")
SUPPORTED_MODEL_TYPES = LLAMA_LIKE + ("opt",)


class UnsupportedModelError(ValueError):
    pass


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(frozen=True)
class ModelAdapter:
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    logit_scale: float  # multiplies q.k in the attention function to give attention logits
    max_context: int

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @staticmethod
    def for_model(model: torch.nn.Module) -> "ModelAdapter":
        config = model.config
        model_type = getattr(config, "model_type", "?")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)} "
                "(Llama-family models with grouped-query attention included)"
            )
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        scale = 1.0 if model_type == "opt" else head_dim**-0.5
        return ModelAdapter(
            model_type=model_type,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            logit_scale=scale,
            max_context=int(getattr(config, "max_position_embeddings", 2048)),
        )

    def decoder_layers(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        if self.model_type == "opt":
            return list(model.model.decoder.layers)
        return list(model.model.layers)

    def attention_modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        return [layer.self_attn for layer in self.decoder_layers(model)]

    def rehearse_query(
        self,
        attention: torch.nn.Module,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """Query [heads, n, head_dim] that `attention` would compute from `hidden_states` [1, n, hidden]."""
        # the module itself, not F.linear on its weight: a bitsandbytes 8/4-bit layer stores packed weights
        query = attention.q_proj(hidden_states[0])  # [n, heads*dim]
        query = query.view(-1, self.num_heads, self.head_dim).transpose(0, 1)
        if self.model_type == "opt":
            return query * attention.scaling
        cos, sin = position_embeddings
        cos, sin = cos[0].unsqueeze(0), sin[0].unsqueeze(0)  # [1, n, dim]
        return query * cos + _rotate_half(query) * sin
