"""The tiny qwen3_5_moe checkpoint's sizes and config.json (``kern make-tiny qwen3_5_moe``):
the text-only form with per-expert tensors (what transformers' ``save_pretrained`` writes);
the releases nest the fields under text_config of a multimodal "qwen3_5_moe" config and fuse
the experts, which kern reads as well. Its RMSNorms are zero-centred (they scale by 1 + w),
but for the DeltaNet's output norm."""

from __future__ import annotations

from typing import Any

from kern.models.hybrid import TINY_SIZES, tiny_config
from kern.models.hybrid import tiny_norm_center as norm_center

__all__ = ["DEFAULTS", "config_json", "norm_center"]

DEFAULTS: dict[str, Any] = dict(
    layers=4,
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=32,
    vocab=512,
    **TINY_SIZES,
    experts=8,
    experts_per_tok=2,
    moe_intermediate=32,
    shared_expert_intermediate=48,
)


def config_json(a: dict[str, Any], cfg: dict[str, Any]) -> None:
    """The family's fields on ``cfg`` (the common ones, kern.tiny.config), sizes ``a``."""
    del cfg["intermediate_size"]  # every layer is sparse: the file has no dense width
    tiny_config(a, cfg)
    cfg.update(
        architectures=["Qwen3_5MoeForCausalLM"],
        model_type="qwen3_5_moe_text",
        moe_intermediate_size=a["moe_intermediate"],
        shared_expert_intermediate_size=a["shared_expert_intermediate"],
        num_experts=a["experts"],
        num_experts_per_tok=a["experts_per_tok"],
        output_router_logits=False,
        router_aux_loss_coef=0.001,
    )
