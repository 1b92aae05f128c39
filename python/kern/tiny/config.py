"""The config.json of a tiny checkpoint: the fields every family's file has, then the family's
own (its tiny writer, ``kern.models.<family>.tiny``: sizes and the file transformers would
write for them)."""

from __future__ import annotations

from typing import Any

from kern.models import registry

__all__ = ["FP8_BLOCK", "config_json", "defaults"]

# Block of the FP8 weights make_tiny writes with ``fp8=True``: DeepSeek's released
# 128 x 128 would be one block for most tiny matrices; 16 x 16 tests the block edges.
FP8_BLOCK = (16, 16)


def defaults(family: str) -> dict[str, Any]:
    """The sizes make_tiny takes for ``family``, with their tiny defaults."""
    return dict(registry.family(family).tiny_writer().DEFAULTS)


def config_json(
    family: str, a: dict[str, Any], ids: dict[str, int], tie: bool, dtype: str
) -> dict[str, Any]:
    """config.json of ``family`` with sizes ``a``; ``ids``: the "bos", "eos" and "pad" ids."""
    cfg: dict[str, Any] = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": ids["bos"],
        "dtype": dtype,
        "eos_token_id": ids["eos"],
        "head_dim": a.get("head_dim"),
        "hidden_act": "silu",
        "hidden_size": a["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": a.get("intermediate"),
        "max_position_embeddings": 8192,
        "num_attention_heads": a["heads"],
        "num_hidden_layers": a["layers"],
        "num_key_value_heads": a.get("kv_heads"),
        "pad_token_id": ids["pad"],
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tie,
        "use_cache": True,
        "vocab_size": a["vocab"],
    }
    registry.family(family).tiny_writer().config_json(a, cfg)
    return dict(sorted(cfg.items()))
