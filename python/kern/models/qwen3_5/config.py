"""The ``qwen3_5`` family's config.json and tensors (``Qwen3_5ForCausalLM``): published as the
multimodal ``qwen3_5`` (text fields under ``text_config``, the language model's tensors under
``model.language_model.``, a vision tower and an MTP head kern skips unread) or as the
text-only ``qwen3_5_text``. ``head_dim`` defaults to 256 and ``partial_rotary_factor`` to 0.25,
as transformers 5.23 gives them."""

from __future__ import annotations

from typing import Any

from kern.checkpoint.errors import ConfigFieldError, UnsupportedModelError
from kern.checkpoint.fields import Fields
from kern.models import shapes
from kern.models.config import (
    LAYER_TYPES,
    CommonDefaults,
    Delta,
    ModelConfig,
    common_fields,
    read_rope,
)

__all__ = ["canonical_name", "read_config", "tensor_shapes"]


def read_config(f: Fields, raw: dict[str, Any]) -> ModelConfig:
    """A qwen3_5 config (``f``: the text model's fields, ``raw``: the whole file)."""
    defaults = CommonDefaults(kv_heads=4, head_dim=256)
    common = common_fields(f, raw, "qwen3_5", defaults, lambda f: read_rope(f, partial=0.25))
    n = common["num_hidden_layers"]
    where = f.where
    layer_types = f.raw.get("layer_types")
    if layer_types is None:
        # transformers derives the pattern from full_attention_interval (default 4): every
        # interval-th layer is full attention, the others linear.
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
    delta = Delta(
        num_key_heads=f.pos_int("linear_num_key_heads", default=16),
        num_value_heads=f.pos_int("linear_num_value_heads", default=32),
        key_head_dim=f.pos_int("linear_key_head_dim", default=128),
        value_head_dim=f.pos_int("linear_value_head_dim", default=128),
        conv_kernel_dim=f.pos_int("linear_conv_kernel_dim", default=4),
    )
    # transformers' Qwen3.5 attention always gates; the field exists in published files.
    if not f.flag("attn_output_gate", default=True):
        raise UnsupportedModelError(f"{where}: attn_output_gate=false is not supported")
    if delta.num_value_heads % delta.num_key_heads:
        raise ConfigFieldError(
            f"{where}: linear_num_value_heads ({delta.num_value_heads}) must be a "
            f"multiple of linear_num_key_heads ({delta.num_key_heads})"
        )
    return ModelConfig(
        **common, layer_types=tuple(layer_types), mlp_layer_types=("dense",) * n, delta=delta
    )


def tensor_shapes(c: ModelConfig) -> shapes.Shapes:
    return shapes.decoder(c, _layer)


def _layer(c: ModelConfig, i: int) -> shapes.Shapes:
    p = f"model.layers.{i}."
    out = shapes.norms(c, p)
    if c.is_linear_layer(i):
        out.update(_linear_attention(c, p + "linear_attn."))
    else:
        out.update(shapes.attention(c, p + "self_attn.", gated=True))
    out.update(shapes.mlp(c.hidden_size, c.intermediate_size, p + "mlp."))
    return out


def _linear_attention(c: ModelConfig, p: str) -> shapes.Shapes:
    d = c.delta
    assert d is not None
    key_dim = d.num_key_heads * d.key_head_dim
    value_dim = d.num_value_heads * d.value_head_dim
    nv = d.num_value_heads
    return {
        p + "in_proj_qkv.weight": (2 * key_dim + value_dim, c.hidden_size),
        p + "in_proj_z.weight": (value_dim, c.hidden_size),
        p + "in_proj_b.weight": (nv, c.hidden_size),
        p + "in_proj_a.weight": (nv, c.hidden_size),
        p + "conv1d.weight": (2 * key_dim + value_dim, 1, d.conv_kernel_dim),
        p + "dt_bias": (nv,),
        p + "A_log": (nv,),
        p + "norm.weight": (d.value_head_dim,),
        p + "out_proj.weight": (c.hidden_size, value_dim),
    }


def canonical_name(c: ModelConfig, name: str, mtp: bool) -> str | None:
    """The multimodal files' language model under ``model.language_model.``; the vision
    tower and the MTP head are not read."""
    if name.startswith("model.language_model."):
        name = "model." + name[len("model.language_model.") :]
    if name.startswith(("model.visual.", "mtp.")):
        return None
    return name
