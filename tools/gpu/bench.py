"""Device benchmarks for tools/gpu/check.sh, one section at a time, each printed as Markdown.

    python tools/gpu/bench.py SECTION [--small] [--work DIR]

Sections:
* ``copy``: the device's copy bandwidth (bytes read + written per second), the roofline's
  denominator, measured in the same run as what is compared with it.
* ``gemm``: ``kern.kernels.matmul`` (the batch-invariant linear) against cuBLAS
  (``F.linear``) at M = 1, 8, 64 on the linears of a ~0.6B and a ~4B qwen3, a row's bits at
  M = 1, 3, 16, 64 and in every place, and other tiles timed at M = 1 and 64 (candidates
  only: kern runs ``tile(N, K)``).
* ``decode``: make-tiny qwen3 ~0.6B and ~4B in bf16 through kern's runner on the device:
  decode tokens/s at batch 1, 8, 64 beside the HBM roofline (weight + KV bytes read per step
  over the copy bandwidth) and transformers' ``generate`` on the same weights; prefill
  tokens/s of one 2,048-token prompt.
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
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import MODELS, SMALL, _load, _runner, device, timed


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
    print(f"copy bandwidth (read + written): {bw / 1e12:.2f} TB/s")
    return {"copy_bytes_per_s": bw}


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
    from kern.tiny import make_tiny

    models = SMALL if args.small else {m: MODELS[m] for m in args.models}
    bw = copy_bandwidth(args.small)
    print(f"copy bandwidth (read + written), the roofline's: {bw / 1e12:.2f} TB/s")
    batches = (1, 2) if args.small else (1, 8, 64)
    prompt, steps = (16, 4) if args.small else (128, 32)
    prefill_len = 64 if args.small else 2048
    out: dict = {"copy_bytes_per_s": bw, "rows": []}
    print()
    print(
        "| model | batch | kern decode tok/s | roofline tok/s | of roofline "
        "| HF generate b1 tok/s | kern ms/step |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, sizes in models.items():
        path = args.work / name
        if not (path / "config.json").is_file():
            t = time.perf_counter()
            make_tiny("qwen3", path, seed=0, overwrite=True, dtype="bfloat16", shards=4, **sizes)
            print(f"<!-- made {name} in {time.perf_counter() - t:.0f} s -->", flush=True)
        out["rows"] += _decode_model(name, path, sizes, batches, prompt, steps, bw, args.small)
        out.setdefault("prefill", {})[name] = _prefill(path, prefill_len, args.small)
    return out


def _decode_model(name, path, sizes, batches, prompt, steps, bw, small) -> list:
    from kern.chunk import SeqChunk
    from kern.engine.params import SamplingParams
    from kern.engine.sampler import sample

    ckpt = _load(path, small)
    weight_bytes = _weight_bytes(ckpt)
    kv_per_token = 2 * sizes["layers"] * sizes["kv_heads"] * sizes["head_dim"] * 2
    hf = _hf_generate(path, prompt, steps, small)
    rows = []
    page = 16
    gen = torch.Generator().manual_seed(0)
    for b in batches:
        runner, tables = _runner(ckpt, b, prompt + steps + 1, page)
        prompts = torch.randint(0, ckpt.config.vocab_size, (b, prompt), generator=gen).tolist()
        greedy = [SamplingParams()] * b
        logits = runner.forward(
            [
                SeqChunk(p, 0, t, slot=i)
                for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
            ]
        )
        first = sample(logits, greedy, [0] * b)

        def run(first=first, b=b, tables=tables, runner=runner, greedy=greedy) -> None:
            tokens, pos = first, prompt
            for s in range(steps):
                batch = [SeqChunk([tokens[i]], pos, tables[i], slot=i) for i in range(b)]
                tokens = sample(runner.forward(batch), greedy, [s + 1] * b)
                pos += 1

        seconds = timed(run, repeat=3, warmup=1)
        tok_s = b * steps / seconds
        # bytes one step reads: every weight once, and each sequence's KV at mid-decode
        step_bytes = weight_bytes + b * (prompt + steps // 2) * kv_per_token
        roof = b * bw / 2 / step_bytes  # copy bandwidth counts a byte read and one written
        rows.append((name, b, tok_s, roof, hf if b == 1 else None, seconds / steps * 1e3))
        hf_s = f"{hf:,.0f}" if b == 1 and hf else ""
        print(
            f"| {name} | {b} | {tok_s:,.0f} | {roof:,.0f} | {tok_s / roof:.0%} | {hf_s} "
            f"| {seconds / steps * 1e3:.2f} |",
            flush=True,
        )
        del runner
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def _weight_bytes(ckpt) -> int:
    """Bytes of the weights one decode step reads in bf16: all of them, except the embedding
    table when the LM head is a separate tensor (a step reads a few of its rows)."""
    total = 0
    tied = "lm_head.weight" not in ckpt.tensors
    for key, t in ckpt.tensors.items():
        if key == "model.embed_tokens.weight" and not tied:
            continue
        total += t.numel() * 2
    return total


def _hf_generate(path: Path, prompt: int, steps: int, small: bool) -> float | None:
    """transformers' batch-1 greedy generate on the same weights, decoded tokens/s."""
    try:
        import transformers
    except ImportError:
        print("<!-- transformers is not installed: no generate figure -->")
        return None
    dtype = torch.float32 if small else torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device())
    model.eval()
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), device=device())
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def gen(n: int):
        return lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)

    with torch.inference_mode():
        full = timed(gen(steps + 1), repeat=2, warmup=1)
        one = timed(gen(1), repeat=2, warmup=1)
    return steps / max(full - one, 1e-9)


def _prefill(path: Path, tokens: int, small: bool) -> float:
    from kern.chunk import SeqChunk

    ckpt = _load(path, small)
    runner, tables = _runner(ckpt, 1, tokens + 1, 16)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, ckpt.config.vocab_size, (tokens,), generator=gen).tolist()
    seconds = timed(lambda: runner.forward([SeqChunk(prompt, 0, tables[0], slot=0)]), repeat=3)
    print(f"- {path.name}: prefill of one {tokens}-token prompt: {tokens / seconds:,.0f} tok/s")
    return tokens / seconds


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
        help="decode: the models to make and run (making the ~4B one takes minutes)",
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
