"""The tiny kimi_linear checkpoint (``kern make-tiny kimi_linear``): its sizes and config.json in
Moonshot's released spelling (transformers reads it, and writes its own on save), with
``tokenizer.json`` or Kimi's ``tiktoken.model`` (``--tokenizer tiktoken``)."""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULTS", "TOKENIZERS", "config_json"]

# The tokenizer files make_tiny may write for it (kern.tiny.tokenizer).
TOKENIZERS = ("json", "tiktoken")

DEFAULTS: dict[str, Any] = dict(
    layers=4,
    hidden=64,
    heads=4,
    intermediate=128,
    vocab=512,
    experts=8,
    experts_per_tok=2,
    moe_intermediate=32,
    norm_topk_prob=True,
    kv_lora_rank=32,
    q_lora_rank=0,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    n_group=1,
    topk_group=1,
    shared_experts=1,
    first_k_dense=1,
    linear_value_heads=4,
    linear_value_head_dim=16,
    conv_kernel=4,
    full_attention_interval=2,
)


def config_json(a: dict[str, Any], cfg: dict[str, Any]) -> None:
    """The family's fields on ``cfg`` (the common ones, kern.tiny.config), sizes ``a``."""
    del cfg["head_dim"], cfg["max_position_embeddings"]
    n, interval = a["layers"], a["full_attention_interval"]
    full = [i + 1 for i in range(n) if (i + 1) % interval == 0]
    cfg.update(
        num_key_value_heads=a["heads"],
        architectures=["KimiLinearForCausalLM"],
        model_type="kimi_linear",
        first_k_dense_replace=a["first_k_dense"],
        kv_lora_rank=a["kv_lora_rank"],
        linear_attn_config={
            "full_attn_layers": full,
            "head_dim": a["linear_value_head_dim"],
            "kda_layers": [i + 1 for i in range(n) if i + 1 not in full],
            "num_heads": a["linear_value_heads"],
            "short_conv_kernel_size": a["conv_kernel"],
        },
        mla_use_nope=True,
        model_max_length=8192,
        moe_intermediate_size=a["moe_intermediate"],
        moe_layer_freq=1,
        moe_renormalize=a["norm_topk_prob"],
        moe_router_activation_func="sigmoid",
        num_expert_group=a["n_group"],
        num_experts=a["experts"],
        num_experts_per_token=a["experts_per_tok"],
        num_shared_experts=a["shared_experts"],
        q_lora_rank=a["q_lora_rank"] or None,
        qk_nope_head_dim=a["qk_nope_head_dim"],
        qk_rope_head_dim=a["qk_rope_head_dim"],
        routed_scaling_factor=2.446,
        topk_group=a["topk_group"],
        use_grouped_topk=True,
        v_head_dim=a["v_head_dim"],
    )
