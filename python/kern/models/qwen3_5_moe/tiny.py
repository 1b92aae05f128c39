"""The tiny qwen3_5_moe checkpoint's sizes and config.json (``kern make-tiny qwen3_5_moe``):
the text-only form with per-expert tensors (what transformers' ``save_pretrained`` writes);
the releases nest the fields under text_config of a multimodal "qwen3_5_moe" config and fuse
the experts, which kern reads as well. Its RMSNorms are zero-centred (they scale by 1 + w),
but for the DeltaNet's output norm."""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULTS", "config_json", "norm_center"]

DEFAULTS: dict[str, Any] = dict(
    layers=4,
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=32,
    vocab=512,
    linear_key_heads=2,
    linear_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    conv_kernel=4,
    full_attention_interval=2,
    experts=8,
    experts_per_tok=2,
    moe_intermediate=32,
    shared_expert_intermediate=48,
)


def config_json(a: dict[str, Any], cfg: dict[str, Any]) -> None:
    """The family's fields on ``cfg`` (the common ones, kern.tiny.config), sizes ``a``."""
    n, interval = a["layers"], a["full_attention_interval"]
    del cfg["intermediate_size"]  # every layer is sparse: the file has no dense width
    cfg.update(
        architectures=["Qwen3_5MoeForCausalLM"],
        model_type="qwen3_5_moe_text",
        layer_types=[
            "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)
        ],
        linear_conv_kernel_dim=a["conv_kernel"],
        linear_key_head_dim=a["linear_key_head_dim"],
        linear_num_key_heads=a["linear_key_heads"],
        linear_num_value_heads=a["linear_value_heads"],
        linear_value_head_dim=a["linear_value_head_dim"],
        moe_intermediate_size=a["moe_intermediate"],
        shared_expert_intermediate_size=a["shared_expert_intermediate"],
        num_experts=a["experts"],
        num_experts_per_tok=a["experts_per_tok"],
        output_router_logits=False,
        router_aux_loss_coef=0.001,
        rope_parameters={
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000.0,
            "rope_type": "default",
        },
    )


def norm_center(name: str) -> float:
    """A norm weight's neutral value: 0 for the zero-centred norms, 1 for the DeltaNet's
    gated output norm (it scales by w as stored)."""
    return 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
