"""Model families: plain-tensor implementations of transformers' ``*ForCausalLM``."""

from __future__ import annotations

from kern.backend import Ops
from kern.model_config import ModelConfig
from kern.models.deepseek_v3 import DeepseekV3
from kern.models.deepseek_v4 import DeepseekV4
from kern.models.kimi_linear import KimiLinear
from kern.models.layers import Caches, DecoderModel, Tensors
from kern.models.qwen3 import Qwen3
from kern.models.qwen3_5 import Qwen3_5
from kern.models.qwen3_moe import Qwen3Moe

__all__ = ["Caches", "DecoderModel", "build_model"]

_FAMILIES = {
    "qwen3": Qwen3,
    "qwen3_moe": Qwen3Moe,
    "qwen3_5": Qwen3_5,
    "deepseek_v3": DeepseekV3,
    "deepseek_v4": DeepseekV4,
    "kimi_linear": KimiLinear,
}


def build_model(ops: Ops, config: ModelConfig, tensors: Tensors) -> DecoderModel:
    """The family's model over ``tensors`` (transformers' names), prepared for ``ops``."""
    try:
        family = _FAMILIES[config.model_type]
    except KeyError:
        raise ValueError(f"no model for family {config.model_type!r}") from None
    return family(ops, config, tensors)
