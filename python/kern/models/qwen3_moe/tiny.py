"""The tiny qwen3_moe checkpoint's sizes and config.json (``kern make-tiny qwen3_moe``)."""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULTS", "config_json"]

DEFAULTS: dict[str, Any] = dict(
    layers=2,
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    intermediate=128,
    vocab=512,
    experts=8,
    experts_per_tok=2,
    moe_intermediate=32,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=(),
)


def config_json(a: dict[str, Any], cfg: dict[str, Any]) -> None:
    """The family's fields on ``cfg`` (the common ones, kern.tiny.config), sizes ``a``."""
    cfg.update(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        decoder_sparse_step=a["decoder_sparse_step"],
        mlp_only_layers=sorted(a["mlp_only_layers"]),
        moe_intermediate_size=a["moe_intermediate"],
        norm_topk_prob=a["norm_topk_prob"],
        num_experts=a["experts"],
        num_experts_per_tok=a["experts_per_tok"],
        output_router_logits=False,
        rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
        router_aux_loss_coef=0.001,
        sliding_window=None,
        use_sliding_window=False,
    )
