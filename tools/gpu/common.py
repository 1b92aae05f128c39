"""What tools/gpu/bench.py's sections share (bench.py and bench_graphs.py import it): the models
the decode figures are taken on, the device, the timer, and a runner over pages of its own."""

from __future__ import annotations

import time
from pathlib import Path

import torch

__all__ = ["MODELS", "SMALL", "_load", "_runner", "device", "sync", "timed"]

# (name, make-tiny sizes) of the models the issue names; --small swaps in a tiny one.
MODELS = {
    "qwen3-0.6b": dict(
        layers=28,
        hidden=1024,
        heads=16,
        kv_heads=8,
        head_dim=128,
        intermediate=3072,
        vocab=151936,
        tie_embeddings=True,
    ),
    "qwen3-4b": dict(
        layers=36,
        hidden=2560,
        heads=32,
        kv_heads=8,
        head_dim=128,
        intermediate=9728,
        vocab=151936,
        tie_embeddings=True,
    ),
}
SMALL = {
    "qwen3-small": dict(
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=2,
        head_dim=16,
        intermediate=128,
        vocab=512,
        tie_embeddings=True,
    )
}


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeat: int = 5, warmup: int = 2) -> float:
    """Best seconds of ``repeat`` calls of fn (after ``warmup``), synchronized."""
    for _ in range(warmup):
        fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def _runner(ckpt, num_seqs: int, tokens: int, page: int):
    from kern.arith import cdiv
    from kern.backend import make_ops
    from kern.engine.runner import Runner

    pages = cdiv(tokens, page)
    ops = make_ops(device())
    runner = Runner.with_pages(
        ckpt, num_pages=pages * num_seqs, page_tokens=page, num_slots=num_seqs, ops=ops
    )
    return runner, [list(range(i * pages, (i + 1) * pages)) for i in range(num_seqs)]


def _load(path: Path, small: bool):
    from kern.checkpoint.load import load_checkpoint

    dtype = torch.float32 if small else torch.bfloat16
    return load_checkpoint(path, device=device(), dtype=dtype, progress=False)
