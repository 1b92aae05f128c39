"""The ``qwen3`` family's config.json (``Qwen3ForCausalLM``): the common fields only, and its
tensors: GQA attention with q/k norms and a SwiGLU MLP in every layer."""

from __future__ import annotations

from typing import Any

from kern.checkpoint.fields import Fields
from kern.models import shapes
from kern.models.config import CommonDefaults, ModelConfig, common_fields, refuse_sliding_window

__all__ = ["read_config", "tensor_shapes"]


def read_config(f: Fields, raw: dict[str, Any]) -> ModelConfig:
    """A qwen3 config (``f``: its fields, ``raw``: the whole file)."""
    common = common_fields(f, raw, "qwen3", CommonDefaults(kv_heads=None, head_dim=128))
    refuse_sliding_window(f)
    n = common["num_hidden_layers"]
    return ModelConfig(
        **common, layer_types=("full_attention",) * n, mlp_layer_types=("dense",) * n
    )


def tensor_shapes(c: ModelConfig) -> shapes.Shapes:
    return shapes.decoder(c, _layer)


def _layer(c: ModelConfig, i: int) -> shapes.Shapes:
    p = f"model.layers.{i}."
    out = shapes.norms(c, p)
    out.update(shapes.attention(c, p + "self_attn."))
    out.update(shapes.mlp(c.hidden_size, c.intermediate_size, p + "mlp."))
    return out
