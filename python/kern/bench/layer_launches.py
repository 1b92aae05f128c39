"""A decoder layer's launches at decode, CUDA wiring: ``python -m kern.bench.layer_launches``.

Runs a decode step of a tiny make-tiny model (``--family``, default qwen3; ``--batch`` rows)
through the CUDA backend's wiring with its Triton kernels under the interpreter (float32, on
the CPU: the launches are the same calls a GPU gets), after a prefill, and counts per decoder
layer: Triton launches (by kernel), other compute ops (aten calls that are neither a view nor
an allocation, made outside any Triton launch), allocations, and host syncs (``.item()``,
``.tolist()``: ``aten._local_scalar_dense``). The counts are the issue's measure of a fused
layer; they need no GPU, only the same code path.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections import Counter
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton or a kernel module loads

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

__all__ = ["main"]

VIEWS = {
    "view",
    "_unsafe_view",
    "reshape",
    "transpose",
    "t",
    "slice",
    "select",
    "split",
    "split_with_sizes",
    "expand",
    "as_strided",
    "unsqueeze",
    "squeeze",
    "permute",
    "alias",
    "detach",
    "unbind",
    "chunk",
}
METADATA = {"promote_types", "result_type", "is_same_size"}  # no kernel: dtype and shape queries
ALLOCATIONS = {"empty", "empty_like", "new_empty", "empty_strided", "zeros", "zeros_like"}


class _Count(TorchDispatchMode):
    """Aten calls made outside a Triton launch, sorted into views, allocations, syncs and
    compute; ``layer`` names where they go (None: outside the layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_kernel = False
        self.layer: int | None = None
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.in_kernel and self.layer is not None:
            name = func.__name__.split(".")[0]
            if name == "_local_scalar_dense":
                kind = "sync"
            elif name in VIEWS or name in METADATA:
                kind = "view"
            elif name in ALLOCATIONS:
                kind = "allocation"
            else:
                kind = f"op {name}"
            self.ops[(self.layer, kind)] += 1
        return func(*args, **(kwargs or {}))


def count(family: str, batch: int) -> tuple[Counter, Counter, int]:
    """(aten calls by (layer, kind), Triton launches by (layer, kernel), layer count)."""
    from triton.runtime import interpreter

    from kern.backend import CudaOps
    from kern.checkpoint.load import load_checkpoint
    from kern.chunk import SeqChunk
    from kern.engine.runner import Runner
    from kern.tiny import make_tiny

    class Ops(CudaOps):
        dtype = torch.float32

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = load_checkpoint(make_tiny(family, Path(tmp) / family, seed=0))
    runner = Runner.with_pages(
        ckpt, num_pages=4 * batch, page_tokens=16, num_slots=batch, ops=Ops(torch.device("cpu"))
    )
    prompts = [SeqChunk([3 + i, 4, 5, 6, 7], 0, [2 * i, 2 * i + 1], slot=i) for i in range(batch)]
    runner.forward(prompts)
    decode = [SeqChunk([9], 5, [2 * i, 2 * i + 1], slot=i) for i in range(batch)]
    runner.forward(decode)  # warm: every table and kernel made
    counter = _Count()
    launches: Counter = Counter()
    run = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        launches[(counter.layer, self.fn.__name__)] += 1
        counter.in_kernel = True
        try:
            return run(self, *args, **kwargs)
        finally:
            counter.in_kernel = False

    layers = runner.model.layers
    kept = list(layers)

    def tracked(i: int, run_layer):
        def call(x, pending, step, caches):
            counter.layer = i
            try:
                return run_layer(x, pending, step, caches)
            finally:
                counter.layer = None

        return call

    interpreter.InterpretedFunction.run = counted
    # the model's own forward, each layer's run wrapped to name where the calls go
    for i, layer in enumerate(kept):
        layer.run = tracked(i, layer.run)
    try:
        with counter:
            runner.forward(decode)
    finally:
        interpreter.InterpretedFunction.run = run
        for layer in kept:
            del layer.run
    return counter.ops, launches, len(layers)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kern.bench.layer_launches", description=__doc__.split("\n")[0]
    )
    p.add_argument("--family", default="qwen3", help="a family with taps-free layers (qwen3)")
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args(argv)
    ops, launches, num_layers = count(args.family, args.batch)
    print(f"{args.family} (make-tiny, seed 0), a decode step of {args.batch} row(s), per layer:\n")
    print("| what | per layer |")
    print("| --- | ---: |")
    kernels: Counter = Counter()
    for (layer, name), n in launches.items():
        if layer is not None:
            kernels[name] += n
    kinds: Counter = Counter()
    for (layer, kind), n in ops.items():
        if layer is not None:
            kinds[kind] += n
    total = sum(kernels.values()) / num_layers
    print(f"| **Triton launches** | **{total:g}** |")
    for name, n in sorted(kernels.items()):
        print(f"| - {name} | {n / num_layers:g} |")
    compute = {k: v for k, v in kinds.items() if k.startswith("op ")}
    print(f"| **other compute ops** | **{sum(compute.values()) / num_layers:g}** |")
    for name, n in sorted(compute.items()):
        print(f"| - {name[3:]} | {n / num_layers:g} |")
    for kind, label in (("allocation", "allocations"), ("view", "views and metadata")):
        print(f"| {label} | {kinds.get(kind, 0) / num_layers:g} |")
    print(f"| host syncs | {kinds.get('sync', 0) / num_layers:g} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
