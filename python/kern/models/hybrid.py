"""The config fields and tensors of the gated-DeltaNet hybrids (Qwen3-Next and the Qwen3.5
line: ``qwen3_5``, ``qwen3_5_moe``, ``qwen3_next``): which layers are linear attention, the
DeltaNet's sizes and tensor names, and the multimodal files' prefixes. Torch-free.

Design notes
------------
* ``layer_types`` absent, transformers derives it from ``full_attention_interval``
  (default 4): every interval-th layer is full attention, the others linear.
* Two in-projection layouts: Qwen3.5 stores ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b`` and
  ``in_proj_a``; Qwen3-Next one ``in_proj_qkvz`` and one ``in_proj_ba`` whose rows are
  grouped by key head (``kern.models.layers.gated_delta`` reorders them at load).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kern.checkpoint.errors import ConfigFieldError, UnsupportedModelError
from kern.checkpoint.fields import Fields
from kern.models import shapes
from kern.models.config import LAYER_TYPES, Delta, ModelConfig

__all__ = [
    "TINY_SIZES",
    "delta_shapes",
    "layer_shapes",
    "multimodal_name",
    "read_delta",
    "read_layer_types",
    "refuse_quantization",
    "tiny_config",
    "tiny_norm_center",
]

# The tiny checkpoints' DeltaNet sizes and pattern (``kern make-tiny``): 2 key heads serving
# 4 value heads of 16, a conv of 4, linear and full attention alternating.
TINY_SIZES: dict[str, Any] = dict(
    linear_key_heads=2,
    linear_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    conv_kernel=4,
    full_attention_interval=2,
)


def read_layer_types(f: Fields, n: int) -> tuple[str, ...]:
    """Each of the ``n`` layers' mixer (see the notes)."""
    where = f.where
    layer_types = f.raw.get("layer_types")
    if layer_types is None:
        interval = f.pos_int("full_attention_interval", default=4)
        layer_types = [
            "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)
        ]
    if not isinstance(layer_types, list) or len(layer_types) != n:
        raise ConfigFieldError(
            f"{where}: layer_types must be a list of num_hidden_layers ({n}) entries"
        )
    for i, t in enumerate(layer_types):
        if t not in LAYER_TYPES:
            raise ConfigFieldError(
                f"{where}: layer_types[{i}] is {t!r}; expected one of {', '.join(LAYER_TYPES)}"
            )
    return tuple(layer_types)


def read_delta(f: Fields) -> Delta:
    """The gated DeltaNet's sizes, with transformers 5.23's defaults."""
    delta = Delta(
        num_key_heads=f.pos_int("linear_num_key_heads", default=16),
        num_value_heads=f.pos_int("linear_num_value_heads", default=32),
        key_head_dim=f.pos_int("linear_key_head_dim", default=128),
        value_head_dim=f.pos_int("linear_value_head_dim", default=128),
        conv_kernel_dim=f.pos_int("linear_conv_kernel_dim", default=4),
    )
    if delta.num_value_heads % delta.num_key_heads:
        raise ConfigFieldError(
            f"{f.where}: linear_num_value_heads ({delta.num_value_heads}) must be a "
            f"multiple of linear_num_key_heads ({delta.num_key_heads})"
        )
    return delta


def delta_shapes(c: ModelConfig, p: str, *, fused: bool = False) -> shapes.Shapes:
    """A DeltaNet layer's tensors under prefix ``p``; ``fused``: Qwen3-Next's two grouped
    in-projections instead of Qwen3.5's four."""
    d = c.delta
    assert d is not None
    key_dim = d.num_key_heads * d.key_head_dim
    value_dim = d.num_value_heads * d.value_head_dim
    nv, h = d.num_value_heads, c.hidden_size
    if fused:
        out = {
            p + "in_proj_qkvz.weight": (2 * key_dim + 2 * value_dim, h),
            p + "in_proj_ba.weight": (2 * nv, h),
        }
    else:
        out = {
            p + "in_proj_qkv.weight": (2 * key_dim + value_dim, h),
            p + "in_proj_z.weight": (value_dim, h),
            p + "in_proj_b.weight": (nv, h),
            p + "in_proj_a.weight": (nv, h),
        }
    out.update(
        {
            p + "conv1d.weight": (2 * key_dim + value_dim, 1, d.conv_kernel_dim),
            p + "dt_bias": (nv,),
            p + "A_log": (nv,),
            p + "norm.weight": (d.value_head_dim,),
            p + "out_proj.weight": (h, value_dim),
        }
    )
    return out


def layer_shapes(
    c: ModelConfig, i: int, mlp: Callable[[ModelConfig, int, str], shapes.Shapes], *, fused=False
) -> shapes.Shapes:
    """Layer ``i``'s tensors: its norms, the DeltaNet (``fused``: Qwen3-Next's) or gated
    attention per ``layer_types``, and ``mlp(c, i, prefix)``'s."""
    p = f"model.layers.{i}."
    out = shapes.norms(c, p)
    if c.is_linear_layer(i):
        out.update(delta_shapes(c, p + "linear_attn.", fused=fused))
    else:
        out.update(shapes.attention(c, p + "self_attn.", gated=True))
    out.update(mlp(c, i, p + "mlp."))
    return out


def multimodal_name(name: str) -> str | None:
    """A multimodal release's language model sits under ``model.language_model.``; its vision
    tower and MTP head are not read (None), as transformers' ``*ForCausalLM`` skips them."""
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model.") :]
    if name.startswith(("model.visual.", "mtp.")):
        return None
    return name


def refuse_quantization(f: Fields, raw: dict[str, Any]) -> None:
    """These families' quantised releases (FP8 blocks, GPTQ, AWQ) are not read: refused by
    the ``quantization_config`` that declares them, before any tensor is looked at."""
    qc = f.raw.get("quantization_config", raw.get("quantization_config"))
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise UnsupportedModelError(
            f"{f.where}: quantization_config (quant_method {method!r}) is not supported for "
            "this family: kern reads its bfloat16, float16 or float32 weights"
        )


def tiny_config(a: dict[str, Any], cfg: dict[str, Any]) -> None:
    """A tiny checkpoint's hybrid fields on ``cfg`` (sizes ``a``): the layer pattern, the
    DeltaNet's sizes, and RoPE on a quarter of each head."""
    n, interval = a["layers"], a["full_attention_interval"]
    cfg.update(
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


def tiny_norm_center(name: str) -> float:
    """A norm weight's neutral value: 0 for the zero-centred norms, 1 for the DeltaNet's
    gated output norm (it scales by w as stored)."""
    return 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
