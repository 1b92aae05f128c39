"""The tiny deepseek_v4 checkpoint (``kern make-tiny deepseek_v4``): its sizes and config.json,
as transformers' save_pretrained writes it, or with ``--fp8`` the release's format: its names
and config spelling (compress_ratios, num_hash_layers, rope_scaling), FP8 projections with e8m0
block scales and FP4 routed experts, in the layout ``kern.checkpoint.entries`` (and
transformers' FP8 loader) reads.

Every scale is a power of two, so a dequantised weight (value x scale) is exact in float32:
a folder and its dequantised twin load to the same tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from kern.checkpoint.entries import FP4_GROUP, FP4_VALUES
from kern.models.deepseek_v4.tensors import is_routed_expert, released_name

__all__ = ["DEFAULTS", "V4_FIXED", "config_json", "quantize", "quantize_v4", "v4_fp8_weight"]

# Sliding, compressed sparse and heavily compressed layers, the hash-routed ones first;
# small window and compression rates, so that a short prompt crosses them all.
DEFAULTS: dict[str, Any] = dict(
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
    sliding_window=8,
)

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
    hc_mult=4,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=8,
    index_head_dim=16,
    index_topk=4,
)


def config_json(a: dict[str, Any], cfg: dict[str, Any]) -> None:
    """The family's fields on ``cfg`` (the common ones, kern.tiny.config), sizes ``a``."""
    cfg.update(_fields(a))
    del cfg["intermediate_size"]


def quantize(tensors: dict[str, torch.Tensor], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The release's quantised tensors under the release's names (``--fp8``)."""
    return {released_name(k): t for k, t in quantize_v4(tensors, block).items()}


_FP8_MAX = 448.0
_FP4_MAX = 6.0


def v4_fp8_weight(name: str) -> bool:
    """Whether the release stores ``name`` as FP8: the attention's and the indexer's query
    projections and the shared expert. The compressors, the indexer's weights_proj,
    embeddings, head, routers, norms and hyper-connections stay float."""
    if ".attn.compressor." in name or ".indexer.compressor." in name:
        return False
    leaves = (".wq_a.weight", ".wq_b.weight", ".wkv.weight", ".wo_a.weight", ".wo_b.weight")
    return (".attn." in name and name.endswith(leaves)) or ".shared_experts." in name


def quantize_v4(
    tensors: dict[str, torch.Tensor], block: tuple[int, int]
) -> dict[str, torch.Tensor]:
    """kern-named tensors to the release's quantised ones: FP8 (``block`` blocks) and FP4
    (one scale per 32 inputs) weights, each with ``<name minus .weight>.weight_scale_inv``
    holding e8m0 scales; other tensors unchanged."""
    out = {}
    for name, t in tensors.items():
        if is_routed_expert(name):
            out[name], out[name + "_scale_inv"] = _fp4(t.float())
        elif v4_fp8_weight(name):
            out[name], out[name + "_scale_inv"] = _fp8(t.float(), block)
        else:
            out[name] = t
    return out


def _pow2_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The smallest power of two that brings ``amax`` within ``top``."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-30) / top)))


def _fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    b0, b1 = block
    nr, nc = -(-rows // b0), -(-cols // b1)
    padded = torch.zeros(nr * b0, nc * b1)
    padded[:rows, :cols] = w
    blocks = padded.view(nr, b0, nc, b1)
    scale = _pow2_scale(blocks.abs().amax(dim=(1, 3)), _FP8_MAX)
    q = (blocks / scale[:, None, :, None]).view(nr * b0, nc * b1)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.to(torch.float8_e8m0fnu).contiguous()


def _fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    groups = w.view(rows, cols // FP4_GROUP, FP4_GROUP)
    scale = _pow2_scale(groups.abs().amax(dim=2), _FP4_MAX)
    v = (groups / scale[:, :, None]).view(rows, cols)
    # The nearest e2m1 magnitude (codes 0-7), with the sign as the nibble's high bit.
    magnitudes = torch.tensor(FP4_VALUES[:8])
    code = (v.abs()[..., None] - magnitudes).abs().argmin(dim=-1)
    code = code + 8 * (v < 0).long()
    packed = code[:, 0::2] | (code[:, 1::2] << 4)  # input 2j in the low nibble
    return (
        packed.to(torch.uint8).view(torch.int8).contiguous(),
        scale.to(torch.float8_e8m0fnu).contiguous(),
    )


def _fields(a: dict[str, Any]) -> dict[str, Any]:
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
        sliding_window=a["sliding_window"],
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
            "weight_block_size": list(a["fp8_block"]),
        },
        topk_method="noaux_tc",
    )
    if a["yarn_factor"]:
        cfg["rope_scaling"] = {**yarn, "type": "yarn"}
        del cfg["rope_scaling"]["rope_type"]
    return cfg
