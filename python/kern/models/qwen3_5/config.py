"""The ``qwen3_5`` family's config.json and tensors (``Qwen3_5ForCausalLM``): published as the
multimodal ``qwen3_5`` (text fields under ``text_config``, the language model's tensors under
``model.language_model.``, a vision tower and an MTP head kern skips unread) or as the
text-only ``qwen3_5_text``. ``head_dim`` defaults to 256 and ``partial_rotary_factor`` to 0.25,
as transformers 5.23 gives them."""

from __future__ import annotations

from typing import Any

from kern.checkpoint.errors import UnsupportedModelError
from kern.checkpoint.fields import Fields
from kern.models import shapes
from kern.models.config import CommonDefaults, ModelConfig, common_fields, read_rope
from kern.models.hybrid import (
    layer_shapes,
    multimodal_name,
    read_delta,
    read_layer_types,
    refuse_quantization,
)

__all__ = ["canonical_name", "read_config", "tensor_shapes"]


def read_config(f: Fields, raw: dict[str, Any]) -> ModelConfig:
    """A qwen3_5 config (``f``: the text model's fields, ``raw``: the whole file)."""
    defaults = CommonDefaults(kv_heads=4, head_dim=256)
    common = common_fields(f, raw, "qwen3_5", defaults, lambda f: read_rope(f, partial=0.25))
    refuse_quantization(f, raw)
    n = common["num_hidden_layers"]
    layer_types = read_layer_types(f, n)
    delta = read_delta(f)
    # transformers' Qwen3.5 attention always gates; the field exists in published files.
    if not f.flag("attn_output_gate", default=True):
        raise UnsupportedModelError(f"{f.where}: attn_output_gate=false is not supported")
    return ModelConfig(
        **common, layer_types=layer_types, mlp_layer_types=("dense",) * n, delta=delta
    )


def tensor_shapes(c: ModelConfig) -> shapes.Shapes:
    return shapes.decoder(c, lambda c, i: layer_shapes(c, i, _mlp))


def _mlp(c: ModelConfig, i: int, p: str) -> shapes.Shapes:
    return shapes.mlp(c.hidden_size, c.intermediate_size, p)


def canonical_name(c: ModelConfig, name: str, mtp: bool) -> str | None:
    """The multimodal files' language model under ``model.language_model.``; the vision
    tower and the MTP head are not read."""
    return multimodal_name(name)
