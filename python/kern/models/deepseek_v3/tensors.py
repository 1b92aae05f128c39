"""DeepSeek-V3's tensors: transformers' names (DeepSeek's own, under ``model.``), latent
attention, group-routed experts with ``e_score_correction_bias`` and shared experts.

Design notes
------------
* The multi-token-prediction layers are ``model.layers.<num_hidden_layers + k>`` (a decoder
  block plus ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head``): read only for a target
  that drafts with them (``mtp``), skipped unread otherwise.
* Kimi K2.5 stores its text model under ``language_model.`` beside a vision tower and a
  projector, which are skipped unread.
"""

from __future__ import annotations

from kern.models import shapes
from kern.models.config import ModelConfig
from kern.models.deepseek_v3.config import DeepseekV3Fields

__all__ = ["canonical_name", "mtp_shapes", "tensor_shapes"]


def tensor_shapes(c: ModelConfig) -> shapes.Shapes:
    return shapes.decoder(c, lambda c, i: _layer(c, i, c.is_sparse_layer(i)))


def _layer(c: ModelConfig, i: int, sparse: bool) -> shapes.Shapes:
    p = f"model.layers.{i}."
    out = shapes.norms(c, p)
    out.update(shapes.latent_attention(c, p + "self_attn."))
    if sparse:
        out.update(shapes.group_routed(c, c.family_fields.routing, p + "mlp."))
    else:
        out.update(shapes.mlp(c.hidden_size, c.intermediate_size, p + "mlp."))
    return out


def mtp_shapes(c: ModelConfig) -> tuple[shapes.Shapes, set[str]]:
    """The multi-token-prediction layers' tensors with their shapes, and the names among
    them a checkpoint may leave out (the layer's own copies of the embedding and the head,
    which are the model's)."""
    own: DeepseekV3Fields = c.family_fields
    h, v = c.hidden_size, c.vocab_size
    out: shapes.Shapes = {}
    optional: set[str] = set()
    for k in range(c.num_mtp_layers):
        i = c.num_hidden_layers + k
        p = f"model.layers.{i}."
        out.update(_layer(c, i, mtp_sparse(c, own, k)))
        out.update(
            {
                p + "enorm.weight": (h,),
                p + "hnorm.weight": (h,),
                p + "eh_proj.weight": (h, 2 * h),
                p + "shared_head.norm.weight": (h,),
                p + "shared_head.head.weight": (v, h),
                p + "embed_tokens.weight": (v, h),
            }
        )
        optional.update({p + "shared_head.head.weight", p + "embed_tokens.weight"})
    return out, optional


def mtp_sparse(c: ModelConfig, own: DeepseekV3Fields, k: int) -> bool:
    """Whether MTP layer ``k`` routes experts (the decoder's rule, past its last layer)."""
    return c.experts is not None and c.num_hidden_layers + k >= own.first_k_dense_replace


def canonical_name(c: ModelConfig, name: str, mtp: bool) -> str | None:
    """kern's name for a stored tensor, or None for one it does not read (see the notes)."""
    if name.startswith("language_model."):
        name = name[len("language_model.") :]
    elif name.startswith(("vision_tower.", "mm_projector.", "multi_modal_projector.")):
        return None
    if name.startswith("model.layers."):
        layer = name.split(".", 3)[2]
        if layer.isdigit() and int(layer) >= c.num_hidden_layers:
            # DeepSeek's MTP layers follow the decoder's; read only when drafting.
            keep = mtp and int(layer) < c.num_hidden_layers + c.num_mtp_layers
            return name if keep else None
    return name
