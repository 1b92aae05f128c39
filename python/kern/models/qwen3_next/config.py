"""The ``qwen3_next`` family's config.json (``Qwen3NextForCausalLM``) and tensors: Qwen3.5's
layer pattern and DeltaNet sizes (``kern.models.hybrid``), Qwen3-MoE's sparse layers
(``decoder_sparse_step``, ``mlp_only_layers``: ``kern.models.routed``) with a gated shared
expert, and the DeltaNet's grouped ``in_proj_qkvz`` / ``in_proj_ba``. ``head_dim`` defaults
to 256, ``num_key_value_heads`` to 2 and ``partial_rotary_factor`` to 0.25, as transformers
5.23 gives them."""

from __future__ import annotations

from typing import Any

from kern.checkpoint.fields import Fields
from kern.models import shapes
from kern.models.config import CommonDefaults, ModelConfig, common_fields, read_rope
from kern.models.hybrid import layer_shapes, read_delta, read_layer_types, refuse_quantization
from kern.models.routed import read_experts, read_sparse_steps

__all__ = ["read_config", "tensor_shapes"]


def read_config(f: Fields, raw: dict[str, Any]) -> ModelConfig:
    """A qwen3_next config (``f``: its fields, ``raw``: the whole file)."""
    defaults = CommonDefaults(kv_heads=2, head_dim=256)
    common = common_fields(f, raw, "qwen3_next", defaults, lambda f: read_rope(f, partial=0.25))
    refuse_quantization(f, raw)
    n = common["num_hidden_layers"]
    layer_types = read_layer_types(f, n)
    delta = read_delta(f)
    experts = read_experts(f, norm_topk_prob=True, shared=True)
    own = read_sparse_steps(f, n)
    return ModelConfig(
        **common,
        layer_types=layer_types,
        mlp_layer_types=own.mlp_layer_types(n),
        delta=delta,
        experts=experts,
        family_fields=own,
    )


def tensor_shapes(c: ModelConfig) -> shapes.Shapes:
    return shapes.decoder(c, lambda c, i: layer_shapes(c, i, _mlp, fused=True))


def _mlp(c: ModelConfig, i: int, p: str) -> shapes.Shapes:
    if c.is_sparse_layer(i):
        return shapes.gated_shared(c, p)
    return shapes.mlp(c.hidden_size, c.intermediate_size, p)
