"""The ``deepseek_v3`` family's config.json fields (DeepSeek-V3/R1, Kimi K2): latent attention
sizes, group-limited routing, multi-token-prediction layers, YaRN and FP8 quantisation, read as
transformers 5.23 reads them, with what kern cannot honour refused by name.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from kern.checkpoint_errors import ConfigFieldError, UnsupportedModelError

if TYPE_CHECKING:
    from kern.config_fields import Fields
    from kern.model_config import ModelConfig

__all__ = ["deepseek_v3_fields", "softmax_scale", "yarn", "yarn_mscale"]


def softmax_scale(c: ModelConfig) -> float:
    """Latent attention's score scale: qk_head_dim ** -0.5, times yarn's
    mscale(factor, mscale_all_dim) squared, as transformers sets it."""
    scale = (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5
    if c.rope_type == "yarn" and c.rope_yarn[5]:
        m = yarn_mscale(c.rope_yarn[0], c.rope_yarn[5])
        scale *= m * m
    return scale


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn(f: Fields, params: dict[str, Any], where: str) -> tuple[float, ...]:
    """(factor, original_max_position_embeddings, beta_fast, beta_slow, mscale,
    mscale_all_dim, attention_factor (0: derived), truncate) as transformers reads them."""

    def num(key: str, default: float | None) -> float:
        value = params.get(key, default)
        if value is None:
            value = default
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise ConfigFieldError(
                f"{where}: rope_parameters.{key} must be a number, got {value!r}"
            )
        return float(value)

    original = num(
        "original_max_position_embeddings",
        f.raw.get("original_max_position_embeddings", f.raw.get("max_position_embeddings")),
    )
    factor = params.get("factor")
    factor = num("factor", None) if factor is not None else None
    if factor is None:
        factor = f.pos_int("max_position_embeddings", default=4096) / original
    if factor <= 0 or original <= 0:
        raise ConfigFieldError(f"{where}: rope_parameters: yarn needs a positive factor")
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigFieldError(f"{where}: rope_parameters.truncate must be a boolean")
    return (
        factor,
        original,
        num("beta_fast", 32.0) or 32.0,
        num("beta_slow", 1.0) or 1.0,
        num("mscale", 0.0),
        num("mscale_all_dim", 0.0),
        num("attention_factor", 0.0),
        float(truncate),
    )


def deepseek_v3_fields(f: Fields, num_layers: int, heads: int, where: str) -> dict[str, Any]:
    q_lora = f.raw.get("q_lora_rank")
    if q_lora is not None:
        q_lora = f.pos_int("q_lora_rank")
    num_experts = f.raw.get("n_routed_experts", f.raw.get("num_local_experts"))
    num_experts = (
        0
        if num_experts is None
        else f.pos_int("n_routed_experts" if "n_routed_experts" in f.raw else "num_local_experts")
    )
    out: dict[str, Any] = dict(
        kv_lora_rank=f.pos_int("kv_lora_rank", default=512),
        q_lora_rank=q_lora or 0,
        qk_nope_head_dim=f.pos_int("qk_nope_head_dim", default=128),
        qk_rope_head_dim=f.pos_int("qk_rope_head_dim", default=64),
        v_head_dim=f.pos_int("v_head_dim", default=128),
        rope_interleave=f.flag("rope_interleave", default=True),
        num_experts=num_experts,
        num_experts_per_tok=f.pos_int("num_experts_per_tok", default=8) if num_experts else 0,
        moe_intermediate_size=f.pos_int("moe_intermediate_size", default=2048),
        norm_topk_prob=f.flag("norm_topk_prob", default=True),
        n_group=f.pos_int("n_group", default=8) if num_experts else 1,
        topk_group=f.pos_int("topk_group", default=4) if num_experts else 1,
        routed_scaling_factor=f.number("routed_scaling_factor", default=2.5),
        n_shared_experts=_count(f, "n_shared_experts", 1),
        first_k_dense_replace=_count(f, "first_k_dense_replace", 3),
        num_mtp_layers=_count(f, "num_nextn_predict_layers", _count(f, "num_mtp_layers", 1)),
        fp8_block=_fp8_block(f.raw.get("quantization_config"), where),
    )
    if out["qk_rope_head_dim"] % 2:
        raise ConfigFieldError(f"{where}: qk_rope_head_dim must be even")
    if num_experts:
        e, g, k = num_experts, out["n_group"], out["num_experts_per_tok"]
        if e % g or e // g < 2:
            raise ConfigFieldError(
                f"{where}: n_routed_experts ({e}) must be a multiple of n_group ({g}) with at "
                "least 2 experts a group (a group scores its best two)"
            )
        if out["topk_group"] > g:
            raise ConfigFieldError(
                f"{where}: topk_group ({out['topk_group']}) exceeds n_group ({g})"
            )
        if k > out["topk_group"] * (e // g):
            raise ConfigFieldError(
                f"{where}: num_experts_per_tok ({k}) exceeds the experts of topk_group groups"
            )
    for key, expected in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        value = f.raw.get(key, expected)
        if value != expected:
            raise UnsupportedModelError(
                f"{where}: {key} {value!r} is not supported (deepseek_v3 routes with {expected!r})"
            )
    freq = f.raw.get("moe_layer_freq", 1)
    if freq != 1:
        raise UnsupportedModelError(f"{where}: moe_layer_freq {freq!r} is not supported (1)")
    return out


def _count(f: Fields, key: str, default: int) -> int:
    value = f.raw.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigFieldError(f"{f.where}: field {key!r} must be a count (>= 0), got {value!r}")
    return value


def _fp8_block(qc: Any, where: str) -> tuple[int, ...]:
    """DeepSeek's released ``quantization_config`` (fp8, dynamic activations, 128 x 128
    weight blocks with ``weight_scale_inv``): the block; refused by name otherwise."""
    if qc is None:
        return ()
    if not isinstance(qc, dict):
        raise ConfigFieldError(f"{where}: field 'quantization_config' must be an object")
    method = qc.get("quant_method")
    block = qc.get("weight_block_size")
    if method != "fp8" or qc.get("fmt", "e4m3") != "e4m3":
        raise UnsupportedModelError(
            f"{where}: quantization_config quant_method {method!r} (fmt {qc.get('fmt')!r}) is not "
            "supported (kern reads DeepSeek's block-scaled 'fp8' e4m3 weights)"
        )
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ConfigFieldError(
            f"{where}: quantization_config.weight_block_size must be two positive ints, "
            f"got {block!r}"
        )
    return tuple(block)
