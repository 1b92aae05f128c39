"""The tiny qwen3_next checkpoint's sizes and config.json (``kern make-tiny qwen3_next``). Its
RMSNorms are zero-centred (they scale by 1 + w), but for the DeltaNet's output norm."""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULTS", "config_json", "norm_center"]

DEFAULTS: dict[str, Any] = dict(
    layers=4,
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=32,
    intermediate=128,
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
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=(),
)


def config_json(a: dict[str, Any], cfg: dict[str, Any]) -> None:
    """The family's fields on ``cfg`` (the common ones, kern.tiny.config), sizes ``a``."""
    n, interval = a["layers"], a["full_attention_interval"]
    cfg.update(
        architectures=["Qwen3NextForCausalLM"],
        model_type="qwen3_next",
        layer_types=[
            "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)
        ],
        linear_conv_kernel_dim=a["conv_kernel"],
        linear_key_head_dim=a["linear_key_head_dim"],
        linear_num_key_heads=a["linear_key_heads"],
        linear_num_value_heads=a["linear_value_heads"],
        linear_value_head_dim=a["linear_value_head_dim"],
        decoder_sparse_step=a["decoder_sparse_step"],
        mlp_only_layers=sorted(a["mlp_only_layers"]),
        moe_intermediate_size=a["moe_intermediate"],
        shared_expert_intermediate_size=a["shared_expert_intermediate"],
        norm_topk_prob=a["norm_topk_prob"],
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
