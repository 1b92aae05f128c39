"""The tiny deepseek_v3 checkpoint (``kern make-tiny deepseek_v3``): its sizes and config.json,
optional MTP layers, YaRN, and DeepSeek's FP8 release format (``--fp8``)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DEFAULTS", "config_json", "quantize"]

DEFAULTS: dict[str, Any] = dict(
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
)


def config_json(a: dict[str, Any], cfg: dict[str, Any]) -> None:
    """The family's fields on ``cfg`` (the common ones, kern.tiny.config), sizes ``a``."""
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
            "weight_block_size": list(a["fp8_block"]),
        }


def quantize(tensors: dict[str, torch.Tensor], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """DeepSeek's FP8 release format: every projection weight (2-d, not an embedding, head or
    router) as float8_e4m3fn plus ``<name>_scale_inv``, one float32 scale (block amax / 448)
    per ``block``; other tensors unchanged."""
    out = {}
    for name, t in tensors.items():
        if t.dim() != 2 or name.endswith(("embed_tokens.weight", "head.weight", "gate.weight")):
            out[name] = t
            continue
        rows, cols = t.shape
        b0, b1 = block
        nr, nc = -(-rows // b0), -(-cols // b1)
        padded = torch.zeros(nr * b0, nc * b1)
        padded[:rows, :cols] = t.float()
        blocks = padded.view(nr, b0, nc, b1)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        q = (blocks / scale[:, None, :, None]).view(nr * b0, nc * b1)[:rows, :cols]
        out[name] = q.to(torch.float8_e4m3fn).contiguous()
        out[name + "_scale_inv"] = scale.contiguous()
    return out
