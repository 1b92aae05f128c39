"""The ``gpt_oss`` family's config.json (``GptOssForCausalLM``) and tensors. Torch-free.

Design notes
------------
* Defaults are transformers 5.23's ``GptOssConfig``: head_dim 64, 8 KV heads, sliding window
  128 on the even layers (``layer_types``), biases on q/k/v/o, YaRN RoPE (factor 32 over 4,096
  positions, theta 150,000) when the file gives no ``rope_parameters``, the clamped SwiGLU's
  ``swiglu_alpha`` 1.702 and ``swiglu_limit`` 7.
* Experts are stored fused. transformers' ``save_pretrained`` writes ``mlp.experts.gate_up_proj``
  [E, hidden, 2 I] and ``down_proj`` [E, I, hidden] (each expert [in, out], gate and up
  interleaved by column) with ``*_bias`` [E, out]; the release stores the weights as MXFP4,
  ``*_blocks`` [E, out, in / 32, 16] and ``*_scales`` [E, out, in / 32]. kern reads both as
  per-expert [out, in] tensors (``mlp.experts.3.gate_up_proj.weight``), an expert at a time:
  the bf16 pieces transposed, the MXFP4 pieces dequantised at load (``kern.checkpoint``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kern.checkpoint.errors import ConfigFieldError, UnsupportedModelError
from kern.checkpoint.fields import Fields
from kern.models import shapes
from kern.models.config import CommonDefaults, Experts, ModelConfig, common_fields, read_rope

__all__ = [
    "GptOssFields",
    "canonical_name",
    "fp4_weight",
    "read_config",
    "split_stored",
    "tensor_shapes",
]

_LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' rope_parameters when the file has none, and its default theta.
_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
_DEFAULT_THETA = 150000.0
_EXPERT_WEIGHT = re.compile(r"\.mlp\.experts\.\d+\.(gate_up|down)_proj\.weight$")


@dataclass(frozen=True)
class GptOssFields:
    """gpt-oss's own fields: the sliding layers' window and the clamped SwiGLU."""

    sliding_window: int  # 0: no layer windows
    swiglu_alpha: float
    swiglu_limit: float


def read_config(f: Fields, raw: dict[str, Any]) -> ModelConfig:
    """A gpt_oss config (``f``: its fields, ``raw``: the whole file)."""
    defaults = CommonDefaults(
        kv_heads=8, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=131072
    )
    common = common_fields(f, raw, "gpt_oss", defaults, _rope)
    common["attention_bias"] = f.flag("attention_bias", default=True)
    _refuse_quantization(f)
    n = common["num_hidden_layers"]
    layer_types = f.raw.get("layer_types")
    if layer_types is None:
        layer_types = [_LAYER_TYPES[i % 2] for i in range(n)]
    if (
        not isinstance(layer_types, list)
        or len(layer_types) != n
        or any(t not in _LAYER_TYPES for t in layer_types)
    ):
        raise ConfigFieldError(
            f"{f.where}: layer_types must list {n} of 'sliding_attention' / 'full_attention'"
        )
    window = f.raw.get("sliding_window", 128)
    if window is not None and (
        isinstance(window, bool) or not isinstance(window, int) or window < 1
    ):
        raise ConfigFieldError(f"{f.where}: sliding_window must be a positive integer or null")
    num_experts = f.pos_int("num_local_experts", default=128)
    top_k = f.pos_int("num_experts_per_tok", default=4)
    if top_k > num_experts:
        raise ConfigFieldError(
            f"{f.where}: num_experts_per_tok ({top_k}) exceeds num_local_experts ({num_experts})"
        )
    experts = Experts(num_experts, top_k, common["intermediate_size"], norm_topk_prob=True)
    fields = GptOssFields(
        sliding_window=window or 0,
        swiglu_alpha=f.number("swiglu_alpha", default=1.702),
        swiglu_limit=f.number("swiglu_limit", default=7.0),
    )
    if not fields.swiglu_limit > 0:
        raise ConfigFieldError(f"{f.where}: swiglu_limit must be positive")
    return ModelConfig(
        **common,
        layer_types=tuple(layer_types),
        mlp_layer_types=("sparse",) * n,
        experts=experts,
        family_fields=fields,
    )


def _rope(f: Fields) -> dict[str, Any]:
    """YaRN as the file gives it, transformers' defaults where it gives none."""
    params = f.raw.get("rope_parameters") or f.raw.get("rope_scaling") or dict(_DEFAULT_ROPE)
    if isinstance(params, dict) and "rope_theta" not in params:
        params = {**params, "rope_theta": f.raw.get("rope_theta", _DEFAULT_THETA)}
    return read_rope(Fields({**f.raw, "rope_parameters": params}, f.where), yarn_ok=True)


def _refuse_quantization(f: Fields) -> None:
    """MXFP4 (the release's experts) is read; any other quantisation is refused by name."""
    qc = f.raw.get("quantization_config")
    if qc is None:
        return
    method = qc.get("quant_method") if isinstance(qc, dict) else qc
    if method != "mxfp4":
        raise UnsupportedModelError(
            f"{f.where}: quantization_config (quant_method {method!r}) is not supported for "
            "gpt_oss: kern reads the release's mxfp4 experts and bfloat16/float32 weights"
        )


def window(c: ModelConfig, layer: int) -> int:
    """Layer ``layer``'s sliding window (0: full attention)."""
    fields = c.family_fields
    assert isinstance(fields, GptOssFields)
    return fields.sliding_window if c.layer_types[layer] == "sliding_attention" else 0


def tensor_shapes(c: ModelConfig) -> shapes.Shapes:
    return shapes.decoder(c, _layer)


def _layer(c: ModelConfig, i: int) -> shapes.Shapes:
    p = f"model.layers.{i}."
    h, d = c.hidden_size, c.head_dim
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    out = shapes.norms(c, p)
    a = p + "self_attn."
    for name, rows, cols in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h)):
        out[f"{a}{name}.weight"] = (rows, cols)
    out[a + "o_proj.weight"] = (h, q)
    if c.attention_bias:
        out.update({a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)})
        out[a + "o_proj.bias"] = (h,)
    out[a + "sinks"] = (c.num_attention_heads,)
    e = c.experts
    assert e is not None
    inner = e.moe_intermediate_size
    out[p + "mlp.router.weight"] = (e.num_experts, h)
    out[p + "mlp.router.bias"] = (e.num_experts,)
    for x in range(e.num_experts):
        x_p = f"{p}mlp.experts.{x}."
        out[x_p + "gate_up_proj.weight"] = (2 * inner, h)
        out[x_p + "gate_up_proj.bias"] = (2 * inner,)
        out[x_p + "down_proj.weight"] = (h, inner)
        out[x_p + "down_proj.bias"] = (h,)
    return out


def canonical_name(c: ModelConfig, name: str, mtp: bool) -> str | None:
    return name


def fp4_weight(c: ModelConfig, name: str) -> bool:
    """An expert's weight, when stored as MXFP4 blocks."""
    return _EXPERT_WEIGHT.search(name) is not None


def split_stored(c: ModelConfig, name: str) -> tuple[tuple[int, ...], list] | None:
    """A fused expert tensor: the shape it must have and each expert's piece (see the notes);
    None for any other tensor."""
    base, _, leaf = name.rpartition(".")
    if not base.endswith(".mlp.experts"):
        return None
    e = c.experts
    assert e is not None
    n, h, inner = e.num_experts, c.hidden_size, e.moe_intermediate_size
    proj, _, kind = leaf.partition("_proj")
    out_dim, in_dim = {"gate_up": (2 * inner, h), "down": (h, inner)}.get(proj, (0, 0))
    if not out_dim:
        return None
    kinds = {
        "": ((n, in_dim, out_dim), "weight", in_dim, True),
        "_bias": ((n, out_dim), "bias", out_dim, False),
        "_blocks": ((n, out_dim, in_dim // 32, 16), "weight", out_dim, False),
        "_scales": ((n, out_dim, in_dim // 32), "weight_scale_inv", out_dim, False),
    }
    if kind not in kinds:
        return None
    shape, piece, rows, transposed = kinds[kind]
    names = [f"{base}.{x}.{proj}_proj.{piece}" for x in range(n)]
    return shape, [(names[x], (x, 0, rows, transposed)) for x in range(n)]
