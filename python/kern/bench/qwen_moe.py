"""Qwen3-Next and Qwen3.5-MoE: ``python -m kern.bench.qwen_moe``.

1. Bytes at the released dims (transformers 5.23's ``Qwen3NextConfig`` and
   ``Qwen3_5MoeTextConfig`` defaults, which its docstrings name as Qwen3-Next-80B-A3B's and
   Qwen3.5-35B-A3B's): the KV pages' bytes a token (the full-attention layers only) and a
   sequence's state slot (``Layout.of``, bf16 conv), each against its formula.
2. CPU prefill and decode of each tiny config (``make-tiny qwen3_next`` / ``qwen3_5_moe``,
   seed 0) against transformers in the same run, float32, best of ``--repeat``, the greedy
   answers compared first (``kern.bench.kimi.speed_rows``).
"""

from __future__ import annotations

import torch

from kern.bench.kimi import family_bench
from kern.checkpoint.config import parse_config
from kern.engine.layout import Layout

__all__ = ["RELEASED", "main"]

_HYBRID = {
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}
RELEASED = {
    "Qwen3-Next-80B-A3B": {
        **_HYBRID,
        "model_type": "qwen3_next",
        "vocab_size": 151936,
        "intermediate_size": 5632,
        "num_hidden_layers": 48,
        "num_experts": 512,
        "num_experts_per_tok": 10,
    },
    "Qwen3.5-35B-A3B": {
        **_HYBRID,
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 248320,
        "num_hidden_layers": 40,
        "num_experts": 256,
        "num_experts_per_tok": 8,
    },
}


def bytes_rows() -> list[str]:
    rows = [
        "| model | KV pages a token | formula | state a sequence | formula |",
        "| --- | ---: | --- | ---: | --- |",
    ]
    for name, raw in RELEASED.items():
        c = parse_config(raw)
        layout = Layout.of(c, torch.bfloat16, 1)
        assert c.delta is not None
        full = sum(not c.is_linear_layer(i) for i in range(c.num_hidden_layers))
        linear = c.num_hidden_layers - full
        kv = full * 2 * c.num_key_value_heads * c.head_dim * 2
        d = c.delta
        delta = linear * d.num_value_heads * d.key_head_dim * d.value_head_dim * 4
        conv = linear * d.conv_dim * (d.conv_kernel_dim - 1) * 2
        assert layout.page_bytes == kv and layout.state_bytes == delta + conv
        rows.append(
            f"| {name} | {layout.page_bytes:,} | {full} layers x 2 x {c.num_key_value_heads} "
            f"x {c.head_dim} x 2 | {layout.state_bytes:,} ({layout.state_bytes / 2**20:.1f} "
            f"MiB) | {linear} x ({d.num_value_heads} x {d.key_head_dim} x "
            f"{d.value_head_dim} x 4 + {d.conv_dim} x {d.conv_kernel_dim - 1} x 2) |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    families = ("qwen3_next", "qwen3_5_moe")
    return family_bench(argv, "qwen_moe", __doc__.split("\n")[0], bytes_rows, families)


if __name__ == "__main__":
    raise SystemExit(main())
