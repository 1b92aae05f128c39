"""Kimi-Linear's tensors. Its files (and transformers' ``save_pretrained`` of it) put every
MLP under ``block_sparse_moe.`` and name the experts' projections ``w1``/``w3``/``w2``; kern
reads them as ``mlp.`` and ``gate_proj``/``up_proj``/``down_proj``, the names it uses for every
family. Its delta attention keeps the released names (``q_conv1d``, ``f_a_proj``, ...)."""

from __future__ import annotations

from kern.models import shapes
from kern.models.config import ModelConfig

__all__ = ["canonical_name", "stored_name", "tensor_shapes"]

_EXPERT_NAMES = (
    (".w1.weight", ".gate_proj.weight"),
    (".w3.weight", ".up_proj.weight"),
    (".w2.weight", ".down_proj.weight"),
)


def tensor_shapes(c: ModelConfig) -> shapes.Shapes:
    return shapes.decoder(c, _layer)


def _layer(c: ModelConfig, i: int) -> shapes.Shapes:
    p = f"model.layers.{i}."
    out = shapes.norms(c, p)
    if c.is_linear_layer(i):
        out.update(_delta_attention(c, p + "self_attn."))
    else:
        out.update(shapes.latent_attention(c, p + "self_attn."))
    if c.is_sparse_layer(i):
        out.update(shapes.group_routed(c, c.family_fields.routing, p + "mlp."))
    else:
        out.update(shapes.mlp(c.hidden_size, c.intermediate_size, p + "mlp."))
    return out


def _delta_attention(c: ModelConfig, p: str) -> shapes.Shapes:
    """Kimi Delta Attention, in the released files' names (transformers' save_pretrained
    writes them so too)."""
    d = c.delta
    assert d is not None
    h, heads, dim = c.hidden_size, d.num_value_heads, d.value_head_dim
    width = heads * dim
    k = d.conv_kernel_dim
    return {
        p + "q_proj.weight": (width, h),
        p + "k_proj.weight": (width, h),
        p + "v_proj.weight": (width, h),
        p + "q_conv1d.weight": (width, 1, k),
        p + "k_conv1d.weight": (width, 1, k),
        p + "v_conv1d.weight": (width, 1, k),
        p + "f_a_proj.weight": (dim, h),
        p + "f_b_proj.weight": (width, dim),
        p + "dt_bias": (width,),
        p + "A_log": (1, 1, heads, 1),
        p + "b_proj.weight": (heads, h),
        p + "g_a_proj.weight": (dim, h),
        p + "g_b_proj.weight": (width, dim),
        p + "o_norm.weight": (dim,),
        p + "o_proj.weight": (h, width),
    }


def canonical_name(c: ModelConfig, name: str, mtp: bool) -> str | None:
    """Kimi's files put the MLPs (dense or not) under block_sparse_moe. and name the experts'
    projections w1 (gate), w3 (up), w2 (down)."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    for old, new in _EXPERT_NAMES:
        if name.endswith(old) and ".experts." in name:
            name = name[: -len(old)] + new
    return name


def stored_name(c: ModelConfig, name: str) -> str:
    """The released files' name for kern's tensor ``name`` (the inverse of
    :func:`canonical_name` for the names it renames)."""
    if ".mlp." not in name:
        return name
    layer = int(name.split(".")[2])
    if not c.is_sparse_layer(layer):
        return name
    name = name.replace(".mlp.", ".block_sparse_moe.")
    if ".experts." in name:
        for old, new in _EXPERT_NAMES:
            if name.endswith(new):
                name = name[: -len(new)] + old
    return name
