"""The tiny qwen3_5 checkpoint's sizes and config.json (``kern make-tiny qwen3_5``): the
text-only form; published Qwen3.5 checkpoints nest this under text_config of a multimodal
"qwen3_5" config, which kern reads as well. Its RMSNorms are zero-centred (they scale by
1 + w), but for the DeltaNet's output norm."""

from __future__ import annotations

from typing import Any

from kern.models.hybrid import TINY_SIZES, tiny_config
from kern.models.hybrid import tiny_norm_center as norm_center

__all__ = ["DEFAULTS", "config_json", "norm_center"]

DEFAULTS: dict[str, Any] = dict(
    layers=4,
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=32,
    intermediate=128,
    vocab=512,
    **TINY_SIZES,
)


def config_json(a: dict[str, Any], cfg: dict[str, Any]) -> None:
    """The family's fields on ``cfg`` (the common ones, kern.tiny.config), sizes ``a``."""
    cfg.update(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text")
    tiny_config(a, cfg)
