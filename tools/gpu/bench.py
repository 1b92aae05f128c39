"""Device benchmarks for tools/gpu/check.sh, one section at a time, each printed as Markdown.

    python tools/gpu/bench.py SECTION [--small] [--work DIR]

Sections:
* ``copy``: the device's copy bandwidth (bytes read + written per second) and its read
  bandwidth (a sum over a buffer many times L2: the decode roofline's denominator), beside
  the datasheet's.
* ``gemm``: ``kern.kernels.matmul`` (the batch-invariant linear) against cuBLAS
  (``F.linear``) at M = 1, 8, 64 on the linears of a ~0.6B and a ~4B qwen3, a row's bits at
  M = 1, 3, 16, 64 and in every place, and other tiles timed at M = 1 and 64 (candidates
  only: kern runs ``tile(N, K)``).
* ``decode`` (``bench_decode.py``): make-tiny qwen3 ~0.6B, ~4B and ~8B in bf16 through kern's
  runner on the device, eager and through CUDA graphs: ms a step and tokens/s at batch 1, 8,
  64, the step's bytes (weights + KV) over the measured read bandwidth and over the datasheet
  peak, transformers' ``generate`` on the ~0.6B, other servers' figures named beside them;
  prefill tokens/s of one 2,048-token prompt.
* ``sync`` (``bench_sync.py``): one eager decode step with the forward under
  ``torch.cuda.set_sync_debug_mode("error")``, and the whole step's synchronisations counted.
* ``graphs``: the decode step's CUDA graphs on the ~0.6B: a real row's logits bits padded
  to each captured size against eager, the capture time, ms/step eager and replayed at
  batch 1, 8, 64.

``--small`` shrinks every size to the CPU (Triton interpreter, the CPU backend): what CI runs
so that the script does not rot. Its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from common import (
    MODELS,
    SMALL,
    device,
    read_bandwidth,
    spec_read_bandwidth,
    timed,
)


def copy_bandwidth(small: bool) -> float:
    """Bytes read + written per second by a device-to-device copy of 2 GiB (64 MiB small)."""
    n = (64 if small else 2048) * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=device())
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), repeat=10)
    return 2 * n / seconds


def section_env(args) -> dict:
    import platform
    import shutil
    import subprocess

    import triton

    print(
        f"- python {platform.python_version()}, torch {torch.__version__}, "
        f"triton {triton.__version__}"
    )
    info: dict = {"torch": torch.__version__, "triton": triton.__version__}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["device"] = p.name
        print(
            f"- device: {p.name}, {p.multi_processor_count} SMs, "
            f"{p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}"
        )
    else:
        print("- device: none (CPU mode)")
    if shutil.which("nvidia-smi"):
        query = "--query-gpu=name,driver_version,clocks.sm,clocks.mem"
        smi = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True
        )
        print(f"- nvidia-smi: {smi.stdout.strip() or smi.stderr.strip()}")
    return info


def section_copy(args) -> dict:
    bw = copy_bandwidth(args.small)
    read = read_bandwidth(args.small)
    name, peak = spec_read_bandwidth()
    print(f"copy bandwidth (read + written): {bw / 1e12:.2f} TB/s")
    print(f"read bandwidth (a sum over a buffer many times L2): {read / 1e12:.2f} TB/s")
    if peak:
        print(f"{name}'s datasheet bandwidth: {peak / 1e12:.2f} TB/s")
    return {"copy_bytes_per_s": bw, "read_bytes_per_s": read, "spec_bytes_per_s": peak}


def linear_shapes(sizes: dict) -> list[tuple[str, int, int]]:
    """(name, N, K) of one decoder layer's linears as kern fuses them, and the LM head."""
    h, q = sizes["hidden"], sizes["heads"] * sizes["head_dim"]
    kv = sizes["kv_heads"] * sizes["head_dim"]
    i = sizes["intermediate"]
    return [
        ("qkv", q + 2 * kv, h),
        ("o", h, q),
        ("gate_up", 2 * i, h),
        ("down", h, i),
        ("lm_head", sizes["vocab"], h),
    ]


def section_gemm(args) -> dict:
    from kern.kernels.matmul import matmul

    dev, dtype = device(), (torch.float32 if args.small else torch.bfloat16)
    models = SMALL if args.small else MODELS
    ms = (1, 8) if args.small else (1, 8, 64)
    bench = _bench_fn(args.small)
    out: dict = {"rows": [], "invariant": True, "step": {}}
    print("| model | linear | N x K | M | kern ms | cuBLAS ms | kern / cuBLAS |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for model, sizes in models.items():
        per_m = {m: [0.0, 0.0] for m in ms}
        for name, n, k in linear_shapes(sizes):
            w = (torch.randn(n, k, device=dev) / k**0.5).to(dtype)
            x = torch.randn(max(ms) + 80, k, device=dev).to(dtype)
            out["invariant"] &= _rows_hold(matmul, x, w)
            for m in ms:
                ours = bench(lambda: matmul.linear(x[:m], w))  # noqa: B023
                theirs = bench(lambda: F.linear(x[:m], w))  # noqa: B023
                layers = 1 if name == "lm_head" else sizes["layers"]
                per_m[m][0] += ours * layers
                per_m[m][1] += theirs * layers
                out["rows"].append((model, name, n, k, m, ours, theirs))
                print(
                    f"| {model} | {name} | {n} x {k} | {m} | {ours:.4f} | {theirs:.4f} "
                    f"| {ours / theirs:.2f} |",
                    flush=True,
                )
        for m, (ours, theirs) in per_m.items():
            out["step"][f"{model} M={m}"] = ours / theirs
    print()
    print("A decode step's linears (every layer and the LM head), kern / cuBLAS:")
    for key, ratio in out["step"].items():
        print(f"- {key}: {ratio:.2f}")
    if args.small:
        # the interpreter's tl.dot is numpy's matmul, whose rows need not hold on a CPU
        print("- a row's bits: not judged under the interpreter (tests/kernels does that)")
    else:
        held = "held" if out["invariant"] else "CHANGED"
        print(f"- a row's bits at M = 1, 3, 16, 64 in every place: {held}")
    if not args.small:
        out["sweep"] = _sweep(matmul, models, dtype, bench)
    return out


def _bench_fn(small: bool):
    if small:
        return lambda fn: timed(fn, repeat=1, warmup=0) * 1e3
    import triton.testing

    return lambda fn: triton.testing.do_bench(fn, warmup=5, rep=20)


def _rows_hold(matmul, x: torch.Tensor, w: torch.Tensor) -> bool:
    want = matmul.linear(x[5:6], w)
    for m in (3, 16, 64):
        for place in (0, m // 2, m - 1):
            batch = x[10 : 10 + m].clone()
            batch[place] = x[5]
            if not torch.equal(matmul.linear(batch, w)[place : place + 1], want):
                return False
    return True


def _sweep(matmul, models: dict, dtype, bench) -> dict:
    """Other tiles at M = 1 and 64 on every shape: the best three per shape, as a lead for
    tile(); kern does not run them."""
    dev = device()
    tiles = [
        (64, bn, bk, 4, 3, splits)
        for bn in (32, 64, 128)
        for bk in (64, 128)
        for splits in (1, 2, 4)
    ]
    found: dict = {}
    print()
    print("| model | linear | M | tile() ms | best tiles (BM, BN, BK, warps, stages, splits): ms |")
    print("| --- | --- | ---: | ---: | --- |")
    for model, sizes in models.items():
        for name, n, k in linear_shapes(sizes):
            w = (torch.randn(n, k, device=dev) / k**0.5).to(dtype)
            x = torch.randn(64, k, device=dev).to(dtype)
            for m in (1, 64):
                times = []
                for t in tiles:
                    try:
                        times.append((bench(lambda: matmul.linear_tiled(x[:m], w, None, t)), t))  # noqa: B023
                    except Exception as e:  # noqa: BLE001 - a tile that does not compile
                        print(f"<!-- tile {t} failed: {type(e).__name__} -->")
                times.sort()
                ours = bench(lambda: matmul.linear(x[:m], w))  # noqa: B023
                best = ", ".join(f"{t}: {ms:.4f}" for ms, t in times[:3])
                found[f"{model}/{name}/M={m}"] = [(t, ms) for ms, t in times[:3]]
                print(f"| {model} | {name} | {m} | {ours:.4f} | {best} |", flush=True)
    return found


def section_decode(args) -> dict:
    # tools/gpu/bench_decode.py (this folder is the script's, so on sys.path)
    from bench_decode import section_decode as decode

    return decode(args)


def section_sync(args) -> dict:
    from bench_sync import section_sync as sync_check

    return sync_check(args)


def section_graphs(args) -> dict:
    # tools/gpu/bench_graphs.py (this folder is the script's, so on sys.path)
    from bench_graphs import section_graphs as graphs

    return graphs(args)


SECTIONS = {
    "env": section_env,
    "copy": section_copy,
    "gemm": section_gemm,
    "decode": section_decode,
    "graphs": section_graphs,
    "sync": section_sync,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("section", choices=sorted(SECTIONS))
    parser.add_argument("--small", action="store_true", help="CPU sizes (CI); figures mean nothing")
    parser.add_argument("--work", type=Path, default=Path("/tmp/kern-gpu"), help="model folder")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=sorted(MODELS),
        default=sorted(MODELS),
        help="decode: the models to make and run (making the ~4B and ~8B ones takes minutes)",
    )
    args = parser.parse_args(argv)
    if args.section != "env" and not args.small and not torch.cuda.is_available():
        print(f"{args.section}: no GPU here; use --small for the CPU sizes", file=sys.stderr)
        return 2
    args.work.mkdir(parents=True, exist_ok=True)
    result = SECTIONS[args.section](args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
