"""Batch invariance on the CPU: a sequence's logits are bitwise the same alone, in batches of
2-16 others, with its prefill chunked differently, and at speculative rows; KV (and state)
written while decoding is bitwise what a prefill writes. See docs/invariance.md."""

from __future__ import annotations

import pytest
import torch

from kern.bench.invariance import run_invariance


@pytest.fixture(
    scope="module",
    params=["qwen3", "qwen3_moe", "qwen3_5", "deepseek_v3", "kimi_linear", "deepseek_v4"],
)
def ckpt(request, tiny):
    return tiny(request.param)


def test_bitwise_invariant(ckpt):
    assert torch.get_num_threads() >= 1
    scores = run_invariance(
        ckpt, steps=8, batch_sizes=(2, 16), chunkings=((1, 15, 24), (7, 9, 20, 4)), rows=(3,)
    )
    bad = {name: str(s) for name, s in scores.items() if s.equal != s.total}
    assert not bad, bad
