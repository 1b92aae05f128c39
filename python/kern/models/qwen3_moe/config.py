"""The ``qwen3_moe`` family's config.json (``Qwen3MoeForCausalLM``) and tensors. A layer is
sparse when it is not in ``mlp_only_layers`` and ``(layer + 1) % decoder_sparse_step == 0``,
exactly as transformers decides it; the others have a dense MLP of ``intermediate_size``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kern.checkpoint.errors import ConfigFieldError
from kern.checkpoint.fields import Fields
from kern.models import shapes
from kern.models.config import (
    PER_HEAD,
    CommonDefaults,
    Experts,
    ModelConfig,
    common_fields,
    refuse_sliding_window,
)

__all__ = ["Qwen3MoeFields", "read_config", "tensor_shapes"]


@dataclass(frozen=True)
class Qwen3MoeFields:
    """Which layers are sparse, as the file says it (``mlp_layer_types`` holds the result)."""

    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]


def read_config(f: Fields, raw: dict[str, Any]) -> ModelConfig:
    """A qwen3_moe config (``f``: its fields, ``raw``: the whole file)."""
    common = common_fields(f, raw, "qwen3_moe", CommonDefaults(kv_heads=4, head_dim=PER_HEAD))
    refuse_sliding_window(f)
    n = common["num_hidden_layers"]
    where = f.where
    # transformers 5 writes num_experts as num_local_experts (an attribute_map alias).
    key = "num_experts" if "num_experts" in f.raw else "num_local_experts"
    num_experts = f.pos_int(key)
    top_k = f.pos_int("num_experts_per_tok")
    if top_k > num_experts:
        raise ConfigFieldError(
            f"{where}: num_experts_per_tok ({top_k}) exceeds {key} ({num_experts})"
        )
    mlp_only = f.raw.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in mlp_only
    ):
        raise ConfigFieldError(
            f"{where}: mlp_only_layers must be a list of layer indices below {n}"
        )
    experts = Experts(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=f.pos_int("moe_intermediate_size"),
        norm_topk_prob=f.flag("norm_topk_prob", default=False),
    )
    own = Qwen3MoeFields(
        decoder_sparse_step=f.pos_int("decoder_sparse_step", default=1),
        mlp_only_layers=tuple(sorted(set(mlp_only))),
    )
    sparse = [
        i not in own.mlp_only_layers and (i + 1) % own.decoder_sparse_step == 0 for i in range(n)
    ]
    return ModelConfig(
        **common,
        layer_types=("full_attention",) * n,
        mlp_layer_types=tuple("sparse" if s else "dense" for s in sparse),
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
