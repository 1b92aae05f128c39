"""What tools/gpu/bench.py's sections share (bench.py and bench_graphs.py import it): the models
the decode figures are taken on, the device, the timer, and a runner over pages of its own."""

from __future__ import annotations

import time
from pathlib import Path

import torch

__all__ = [
    "MODELS",
    "SMALL",
    "SPEC_READ_BW",
    "_load",
    "_runner",
    "device",
    "read_bandwidth",
    "spec_read_bandwidth",
    "sync",
    "timed",
]

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
    "qwen3-8b": dict(
        layers=36,
        hidden=4096,
        heads=32,
        kv_heads=8,
        head_dim=128,
        intermediate=12288,
        vocab=151936,
        tie_embeddings=False,
    ),
}
# HBM bandwidth by the vendor's datasheets (bytes/s), by a substring of the device's name, most
# specific first: NVIDIA's H100 (SXM 3.35 TB/s, NVL 3.9, PCIe 2.0), H200 (4.8) and A100 80GB
# (SXM 2.039, PCIe 1.935) datasheets. A lead beside the measured figure, never instead of it.
SPEC_READ_BW = (
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
)
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


def read_bandwidth(small: bool) -> float:
    """Bytes read per second by a sum over a 4 GiB float32 buffer (64 MiB small), many times
    any L2: what a memory-bound decode step's reads can reach on this device."""
    n = (64 if small else 4096) * 2**20
    buf = torch.zeros(n // 4, dtype=torch.float32, device=device())
    return n / timed(lambda: buf.sum(), repeat=10)


def spec_read_bandwidth() -> tuple[str, float | None]:
    """The device's name and its datasheet bandwidth (None: not in SPEC_READ_BW, or no GPU)."""
    if not torch.cuda.is_available():
        return "cpu", None
    name = torch.cuda.get_device_properties(0).name
    return name, next((bw for key, bw in SPEC_READ_BW if key in name), None)


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
