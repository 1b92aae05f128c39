"""The ``qwen3_moe`` family's config.json (``Qwen3MoeForCausalLM``) and tensors. A layer is
sparse when it is not in ``mlp_only_layers`` and ``(layer + 1) % decoder_sparse_step == 0``,
exactly as transformers decides it; the others have a dense MLP of ``intermediate_size``."""

from __future__ import annotations

from typing import Any

from kern.checkpoint.fields import Fields
from kern.models import shapes
from kern.models.config import (
    PER_HEAD,
    CommonDefaults,
    ModelConfig,
    common_fields,
    refuse_sliding_window,
)
from kern.models.routed import SparseSteps, read_experts, read_sparse_steps

__all__ = ["Qwen3MoeFields", "read_config", "tensor_shapes"]

Qwen3MoeFields = SparseSteps  # its own fields: which layers are sparse


def read_config(f: Fields, raw: dict[str, Any]) -> ModelConfig:
    """A qwen3_moe config (``f``: its fields, ``raw``: the whole file)."""
    common = common_fields(f, raw, "qwen3_moe", CommonDefaults(kv_heads=4, head_dim=PER_HEAD))
    refuse_sliding_window(f)
    n = common["num_hidden_layers"]
    experts = read_experts(f, norm_topk_prob=False)
    own = read_sparse_steps(f, n)
    return ModelConfig(
        **common,
        layer_types=("full_attention",) * n,
        mlp_layer_types=own.mlp_layer_types(n),
        experts=experts,
        family_fields=own,
    )


def tensor_shapes(c: ModelConfig) -> shapes.Shapes:
    return shapes.decoder(c, _layer)


def _layer(c: ModelConfig, i: int) -> shapes.Shapes:
    p = f"model.layers.{i}."
    out = shapes.norms(c, p)
    out.update(shapes.attention(c, p + "self_attn."))
    if c.is_sparse_layer(i):
        out.update(shapes.experts(c, p + "mlp."))
    else:
        out.update(shapes.mlp(c.hidden_size, c.intermediate_size, p + "mlp."))
    return out
