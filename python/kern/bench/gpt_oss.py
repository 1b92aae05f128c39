"""gpt-oss: ``python -m kern.bench.gpt_oss``.

1. Bytes at the released dims (gpt-oss-20b and gpt-oss-120b, their config.json values), bf16,
   pages of 128 (``Layout.of``): a page's bytes a token (the full layers only) against its
   formula, a window page's (the sliding layers' 128 positions), and what a running sequence
   of 128k tokens holds (its pages and two window pages) beside what it held when every layer
   kept every token on pages, and its ratio to the full layers' bytes plus one window; and the
   experts' weights as loaded (MXFP4 dequantised to bf16) beside the release's MXFP4 bytes.
2. CPU prefill and decode of the tiny config (``make-tiny gpt_oss``, seed 0, bf16 experts)
   against transformers in the same run, float32, best of ``--repeat``, the greedy answers
   compared first (``kern.bench.kimi.speed_rows``).
"""

from __future__ import annotations

import torch

from kern.bench.kimi import family_bench
from kern.checkpoint.config import parse_config
from kern.engine.layout import Layout

__all__ = ["RELEASED", "bytes_rows", "main"]

_COMMON = {
    "model_type": "gpt_oss",
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "sliding_window": 128,
    "num_experts_per_tok": 4,
}
RELEASED = {
    "gpt-oss-20b": {**_COMMON, "num_hidden_layers": 24, "num_local_experts": 32},
    "gpt-oss-120b": {**_COMMON, "num_hidden_layers": 36, "num_local_experts": 128},
}
_CONTEXT = 131072


def bytes_rows() -> list[str]:
    rows = [
        "| model | pages a token | formula | a window page | 128k tokens before (every layer "
        "on pages) | 128k tokens now | / (full layers + one window) "
        "| experts as loaded (bf16) | experts in the release (MXFP4) |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    pt = 128
    for name, raw in RELEASED.items():
        c = parse_config(raw)
        layout = Layout.of(c, torch.bfloat16, pt)
        n, hk, d = c.num_hidden_layers, c.num_key_value_heads, c.head_dim
        per_layer = 2 * hk * d * 2
        sliding = c.layer_types.count("sliding_attention")
        window = c.family_fields.sliding_window
        assert layout.page_bytes == pt * (n - sliding) * per_layer
        assert layout.state_bytes == sliding * window * per_layer  # 128: a power of two
        before = _CONTEXT * n * per_layer
        # A running sequence: its pages and the two window pages it holds (the last window
        # and the page being written, or a spare: kern.engine.window_pages).
        now = -(-_CONTEXT // pt) * layout.page_bytes + 2 * layout.state_bytes
        formula = _CONTEXT * (n - sliding) * per_layer + sliding * window * per_layer
        e = c.experts
        assert e is not None
        weights = n * e.num_experts * 3 * c.hidden_size * e.moe_intermediate_size
        # MXFP4: half a byte a weight and one e8m0 byte a 32 (biases are bf16 either way).
        mxfp4 = weights // 2 + weights // 32
        rows.append(
            f"| {name} | {layout.page_bytes // pt:,} | {n - sliding} full layers x 2 x {hk} x "
            f"{d} x 2 | {layout.state_bytes / 2**20:.2f} MiB | {before / 2**30:.2f} GiB | "
            f"{now / 2**30:.2f} GiB | {now / formula:.3f} | "
            f"{2 * weights / 2**30:.1f} GiB | {mxfp4 / 2**30:.1f} GiB |"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    return family_bench(argv, "gpt_oss", __doc__.split("\n")[0], bytes_rows, ("gpt_oss",))


if __name__ == "__main__":
    raise SystemExit(main())
