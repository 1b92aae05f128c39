"""The ``qwen3_5_moe`` family's config.json and tensors (``Qwen3_5MoeForCausalLM``): published
as the multimodal ``qwen3_5_moe`` (text fields under ``text_config``, the language model under
``model.language_model.``, a vision tower and an MTP head kern skips unread) or as the
text-only ``qwen3_5_moe_text``. Every layer is sparse, with a gated shared expert; the top-k
weights are always renormalised (transformers 5.23 has no ``norm_topk_prob``,
``decoder_sparse_step`` nor ``mlp_only_layers`` for it: a file that sets them otherwise is
refused by name). ``head_dim`` defaults to 256, ``num_key_value_heads`` to 2 and
``partial_rotary_factor`` to 0.25, as transformers gives them.

Routed experts come in two layouts: per expert (``mlp.experts.3.gate_proj.weight``, what
transformers' ``save_pretrained`` writes) or fused, as the Qwen3.5 releases store them
(``mlp.experts.gate_up_proj`` [E, 2 * I, H], gate rows first, and ``mlp.experts.down_proj``
[E, H, I]); a fused tensor is read as its per-expert pieces (:func:`split_stored`)."""

from __future__ import annotations

from typing import Any

from kern.checkpoint.errors import UnsupportedModelError
from kern.checkpoint.fields import Fields
from kern.models import shapes
from kern.models.config import CommonDefaults, ModelConfig, common_fields, read_rope
from kern.models.hybrid import (
    layer_shapes,
    multimodal_name,
    read_delta,
    read_layer_types,
    refuse_quantization,
)
from kern.models.routed import read_experts

__all__ = ["canonical_name", "read_config", "split_stored", "tensor_shapes"]

# Fields transformers' Qwen3.5-MoE does not have, with the only value it behaves as.
_FIXED = {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}


def read_config(f: Fields, raw: dict[str, Any]) -> ModelConfig:
    """A qwen3_5_moe config (``f``: the text model's fields, ``raw``: the whole file)."""
    defaults = CommonDefaults(kv_heads=2, head_dim=256, intermediate_size=False)
    common = common_fields(f, raw, "qwen3_5_moe", defaults, lambda f: read_rope(f, partial=0.25))
    refuse_quantization(f, raw)
    n = common["num_hidden_layers"]
    for key, value in _FIXED.items():
        if key in f.raw and f.raw[key] not in (value, None):
            raise UnsupportedModelError(
                f"{f.where}: {key} {f.raw[key]!r} is not supported (Qwen3.5-MoE runs "
                f"{value!r}: every layer sparse, top-k weights renormalised)"
            )
    if not f.flag("attn_output_gate", default=True):
        raise UnsupportedModelError(f"{f.where}: attn_output_gate=false is not supported")
    return ModelConfig(
        **common,
        layer_types=read_layer_types(f, n),
        mlp_layer_types=("sparse",) * n,
        delta=read_delta(f),
        experts=read_experts(f, norm_topk_prob=True, shared=True),
    )


def tensor_shapes(c: ModelConfig) -> shapes.Shapes:
    return shapes.decoder(c, lambda c, i: layer_shapes(c, i, _mlp))


def _mlp(c: ModelConfig, i: int, p: str) -> shapes.Shapes:
    return shapes.gated_shared(c, p)


def canonical_name(c: ModelConfig, name: str, mtp: bool) -> str | None:
    """The multimodal files' language model under ``model.language_model.``; the vision
    tower and the MTP head are not read."""
    return multimodal_name(name)


def split_stored(
    c: ModelConfig, name: str
) -> tuple[tuple[int, ...], list[tuple[str, tuple[int, int, int]]]] | None:
    """A fused expert tensor (kern's name for it): the shape it must have, and each piece's
    name with (expert, first row, end row) in it; None for any other tensor."""
    e = c.experts
    assert e is not None
    base, _, leaf = name.rpartition(".")
    if not base.endswith(".mlp.experts") or leaf not in ("gate_up_proj", "down_proj"):
        return None
    inner, h = e.moe_intermediate_size, c.hidden_size
    if leaf == "down_proj":
        return (e.num_experts, h, inner), [
            (f"{base}.{x}.down_proj.weight", (x, 0, h)) for x in range(e.num_experts)
        ]
    pieces = []
    for x in range(e.num_experts):
        pieces.append((f"{base}.{x}.gate_proj.weight", (x, 0, inner)))
        pieces.append((f"{base}.{x}.up_proj.weight", (x, inner, 2 * inner)))
    return (e.num_experts, 2 * inner, h), pieces
