"""A step's index tensors: ``python -m kern.bench.step_inputs``.

Times :func:`kern.batch.validate` and :func:`kern.batch.build_step`, what every forward runs on
the host before the first kernel, for a decode batch of ``--batch`` sequences (default 1 and
64) with contexts of ``--context`` tokens (default 2,048) in pages of 16, best of
``--repeat`` rounds of 200 calls. ``kern.bench.decode --host`` counts the torch calls inside
``build_step`` as torch-op time, not host time; this is their whole cost.
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch

from kern.batch import build_step, validate
from kern.chunk import SeqChunk

__all__ = ["main"]

PAGE = 16


def decode_batch(batch: int, context: int) -> list[SeqChunk]:
    """``batch`` one-token chunks at ``context - 1`` (+ i), each with its own random pages."""
    rng = random.Random(0)
    chunks = []
    for i in range(batch):
        n = context + i
        pages = rng.sample(range(1 << 20), -(-n // PAGE))
        chunks.append(SeqChunk([5], n - 1, pages, slot=i))
    return chunks


def per_call(fn, repeat: int, calls: int = 200) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kern.bench.step_inputs", description=__doc__.split("\n")[0]
    )
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    cpu = torch.device("cpu")
    print(
        f"kern.bench.step_inputs: torch {torch.__version__}, load average "
        f"{os.getloadavg()[0]:.2f}; contexts of {args.context} tokens, pages of {PAGE}\n"
    )
    print("| batch | validate ms | build_step ms |")
    print("| ---: | ---: | ---: |")
    for b in args.batch:
        chunks = decode_batch(b, args.context)
        v = per_call(lambda c=chunks, b=b: validate(c, PAGE, 1 << 20, False, b), args.repeat)
        s = per_call(lambda c=chunks: build_step(c, PAGE, cpu), args.repeat)
        print(f"| {b} | {v * 1e3:.3f} | {s * 1e3:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
