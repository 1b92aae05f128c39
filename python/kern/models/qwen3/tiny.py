"""The tiny qwen3 checkpoint's sizes and config.json (``kern make-tiny qwen3``, kern.tiny)."""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULTS", "config_json"]

DEFAULTS: dict[str, Any] = dict(
    layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512
)


def config_json(a: dict[str, Any], cfg: dict[str, Any]) -> None:
    """The family's fields on ``cfg`` (the common ones, kern.tiny.config), sizes ``a``."""
    n = a["layers"]
    cfg.update(
        architectures=["Qwen3ForCausalLM"],
        model_type="qwen3",
        layer_types=["full_attention"] * n,
        max_window_layers=n,
        rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
        sliding_window=None,
        use_sliding_window=False,
    )
