"""The config.json of a tiny checkpoint: each family's tiny sizes and the file transformers
would write for them."""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULTS", "FP8_BLOCK", "V4_FIXED", "config_json"]

# Block of the FP8 weights make_tiny writes with ``fp8=True``: DeepSeek's released
# 128 x 128 would be one block for most tiny matrices; 16 x 16 tests the block edges.
FP8_BLOCK = (16, 16)

DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": dict(
        layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512
    ),
    "qwen3_5": dict(
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
    ),
    "qwen3_moe": dict(
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
    ),
    "deepseek_v3": dict(
        layers=3,
        hidden=64,
        heads=4,
        intermediate=128,
        vocab=512,
        experts=8,
        experts_per_tok=2,
        moe_intermediate=32,
        norm_topk_prob=True,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=16,
        n_group=2,
        topk_group=1,
        shared_experts=1,
        first_k_dense=1,
        mtp_layers=0,
        yarn_factor=0,
    ),
    "kimi_linear": dict(
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
    ),
    # Sliding, compressed sparse and heavily compressed layers, the hash-routed ones first;
    # small window and compression rates, so that a short prompt crosses them all.
    "deepseek_v4": dict(
        layers=4,
        hidden=64,
        heads=4,
        head_dim=64,
        vocab=512,
        experts=8,
        experts_per_tok=2,
        moe_intermediate=32,
        q_lora_rank=48,
        qk_rope_head_dim=16,
        yarn_factor=0,
    ),
}

# deepseek_v4's sizes make_tiny has no option for.
V4_FIXED: dict[str, Any] = dict(
    layer_types=[
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    hash_layers=2,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    sliding_window=8,
    hc_mult=4,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=8,
    index_head_dim=16,
    index_topk=4,
)


def config_json(
    family: str, a: dict[str, Any], ids: dict[str, int], tie: bool, dtype: str
) -> dict[str, Any]:
    """config.json of ``family`` with sizes ``a``; ``ids``: the "bos", "eos" and "pad" ids."""
    n = a["layers"]
    cfg: dict[str, Any] = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids["bos"],
        "dtype": dtype,
        "eos_token_id": ids["eos"],
        "head_dim": a.get("head_dim"),
        "hidden_act": "silu",
        "hidden_size": a["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": a.get("intermediate"),
        "max_position_embeddings": 8192,
        "num_attention_heads": a["heads"],
        "num_hidden_layers": n,
        "num_key_value_heads": a.get("kv_heads"),
        "pad_token_id": ids["pad"],
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tie,
        "use_cache": True,
        "vocab_size": a["vocab"],
    }
    if family == "qwen3":
        cfg.update(
            architectures=["Qwen3ForCausalLM"],
            model_type="qwen3",
            layer_types=["full_attention"] * n,
            max_window_layers=n,
            rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
            sliding_window=None,
            use_sliding_window=False,
        )
    elif family == "qwen3_moe":
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
    elif family == "deepseek_v3":
        del cfg["head_dim"]  # transformers derives it (the rope dims)
        cfg.update(
            num_key_value_heads=a["heads"],  # unused by MLA, but transformers divides by it
            architectures=["DeepseekV3ForCausalLM"],
            model_type="deepseek_v3",
            first_k_dense_replace=a["first_k_dense"],
            kv_lora_rank=a["kv_lora_rank"],
            max_position_embeddings=4096,
            moe_intermediate_size=a["moe_intermediate"],
            n_group=a["n_group"],
            n_routed_experts=a["experts"],
            n_shared_experts=a["shared_experts"],
            norm_topk_prob=a["norm_topk_prob"],
            num_experts_per_tok=a["experts_per_tok"],
            num_nextn_predict_layers=a["mtp_layers"],
            q_lora_rank=a["q_lora_rank"] or None,
            qk_nope_head_dim=a["qk_nope_head_dim"],
            qk_rope_head_dim=a["qk_rope_head_dim"],
            rope_interleave=True,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
            routed_scaling_factor=2.5,
            topk_group=a["topk_group"],
            v_head_dim=a["v_head_dim"],
        )
        if a["yarn_factor"]:
            cfg["rope_parameters"] = {
                "beta_fast": 32,
                "beta_slow": 1,
                "factor": float(a["yarn_factor"]),
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 64,
                "rope_theta": 10000.0,
                "rope_type": "yarn",
            }
        if a["fp8"]:
            cfg["quantization_config"] = {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "weight_block_size": list(FP8_BLOCK),
            }
    elif family == "kimi_linear":
        # Moonshot's released spelling (transformers reads it, and writes its own on save).
        del cfg["head_dim"], cfg["max_position_embeddings"]
        interval = a["full_attention_interval"]
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
    elif family == "deepseek_v4":
        cfg.update(_deepseek_v4(a))
        del cfg["intermediate_size"]
    else:
        interval = a["full_attention_interval"]
        cfg.update(
            # The text-only form; published Qwen3.5 checkpoints nest this under text_config of
            # a multimodal "qwen3_5" config, which kern reads as well.
            architectures=["Qwen3_5ForCausalLM"],
            model_type="qwen3_5_text",
            layer_types=[
                "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)
            ],
            linear_conv_kernel_dim=a["conv_kernel"],
            linear_key_head_dim=a["linear_key_head_dim"],
            linear_num_key_heads=a["linear_key_heads"],
            linear_num_value_heads=a["linear_value_heads"],
            linear_value_head_dim=a["linear_value_head_dim"],
            rope_parameters={
                "partial_rotary_factor": 0.25,
                "rope_theta": 10000000.0,
                "rope_type": "default",
            },
        )
    return dict(sorted(cfg.items()))


def _deepseek_v4(a: dict[str, Any]) -> dict[str, Any]:
    """deepseek_v4's fields: as transformers' save_pretrained writes them, or with
    ``a["fp8"]`` as the release spells them (compress_ratios, num_hash_layers,
    rope_scaling, FP8 quantization_config with e8m0 scales, FP4 experts)."""
    n, fx = a["layers"], V4_FIXED
    types = (fx["layer_types"] * n)[:n]
    rope = a["qk_rope_head_dim"] / a["head_dim"]
    yarn = {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": float(a["yarn_factor"]),
        "original_max_position_embeddings": 64,
        "rope_type": "yarn",
    }
    cfg: dict[str, Any] = dict(
        architectures=["DeepseekV4ForCausalLM"],
        model_type="deepseek_v4",
        compress_rope_theta=160000.0,
        hc_eps=1e-6,
        hc_mult=fx["hc_mult"],
        hc_sinkhorn_iters=20,
        index_head_dim=fx["index_head_dim"],
        index_n_heads=fx["index_n_heads"],
        index_topk=fx["index_topk"],
        max_position_embeddings=4096,
        moe_intermediate_size=a["moe_intermediate"],
        n_routed_experts=a["experts"],
        n_shared_experts=1,
        norm_topk_prob=True,
        num_experts_per_tok=a["experts_per_tok"],
        num_key_value_heads=1,
        num_nextn_predict_layers=1,
        o_groups=fx["o_groups"],
        o_lora_rank=fx["o_lora_rank"],
        q_lora_rank=a["q_lora_rank"],
        rope_theta=10000.0,
        routed_scaling_factor=1.5,
        scoring_func="sqrtsoftplus",
        sliding_window=fx["sliding_window"],
        swiglu_limit=10.0,
    )
    rates = fx["compress_rates"]
    if not a["fp8"]:
        compress = {"partial_rotary_factor": rope, "rope_theta": 160000.0, "rope_type": "default"}
        if a["yarn_factor"]:
            compress = {**yarn, "attention_factor": 1.0, **compress, "rope_type": "yarn"}
        main = {"partial_rotary_factor": rope, "rope_theta": 10000.0, "rope_type": "default"}
        cfg.update(
            compress_rates=dict(rates),
            layer_types=types,
            mlp_layer_types=["hash_moe" if i < fx["hash_layers"] else "moe" for i in range(n)],
            partial_rotary_factor=rope,
            rope_parameters={"compress": compress, "main": main},
        )
        return cfg
    # The release lists the MTP layer's ratio after the decoder's (kern drops it).
    ratio = {"sliding_attention": 0, "compressed_sparse_attention": 4}
    cfg.update(
        compress_ratios=[ratio.get(t, 128) for t in types] + [0],
        compress_rate_csa=rates["compressed_sparse_attention"],
        compress_rate_hca=rates["heavily_compressed_attention"],
        expert_dtype="fp4",
        num_hash_layers=fx["hash_layers"],
        qk_rope_head_dim=a["qk_rope_head_dim"],
        quantization_config={
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": list(FP8_BLOCK),
        },
        topk_method="noaux_tc",
    )
    if a["yarn_factor"]:
        cfg["rope_scaling"] = {**yarn, "type": "yarn"}
        del cfg["rope_scaling"]["rope_type"]
    return cfg
