"""Decode against its floor: ``python -m kern.bench.decode``.

At batch 1 a decode step reads every weight once, so its floor is the weight bytes over the
memory's read bandwidth. Per batch size (``--batches``, default 1 4 32) this runs greedy
requests of ``--prompt`` random ids through kern's scheduler on a checkpoint (``--model DIR``;
default: a ~88M make-tiny qwen3, float32, written to a temporary folder) and prints:

* tokens/s and ms per decode step (every request in the batch decoding one token a step);
* the step split into linears (``mkldnn::_linear_pointwise``, aten linear/addmm/mm), other
  torch ops, and host time (wall time minus torch-op time: the Python between torch calls):
  op times from a per-call timer (a ``TorchFunctionMode``) on steps of their own, wall times
  from the steps in between, without it (``kern.bench.decode_probe`` says why and how);
* the bytes of linear weights a step reads (the LM head included, the embedding's few rows
  not), the bandwidth that achieves, and the machine's own read (sum) and copy bandwidth of a
  ``--bw-mib`` tensor measured in the same run (best of ``--repeat``): the floor is the weight
  bytes over the faster of the two, and step / floor is how far above it a step is.

``--llama-cpp GGUF`` (the same weights converted to GGUF): the batch-1 prompt decoded by
llama.cpp through the ``llama_cpp`` package (llama-cpp-python, a benchmark dependency only)
in the same run, same thread count, and kern's batch-1 tokens/s over its.

``--host``: on the embedded tiny model (its compute is negligible), a scheduler step at batch 1
and 64 (``--host-batches``) as wall time minus torch-op time, itemised by the part of the step
it is spent in (scheduler bookkeeping, cache calls, building the batch, the runner, the
model's Python, sampling, metrics, stream events).

Every step runs on the thread that loaded the model, as in the server; events cross to an
event loop on another thread through the server's StepGate. Figures are means over the faster
half of each pass's ``--steps`` steps (other processes share these machines).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
import time
from pathlib import Path

import torch

from kern.arith import cdiv
from kern.bench.decode_probe import PARTS, Decode, Probe, Split
from kern.bench.forward import MODEL_100M, best
from kern.checkpoint.config import load_config
from kern.engine.layout import Layout
from kern.engine.load import DEFAULT_POOL_BYTES, Engine
from kern.kern_toml import Target

WARMUP_STEPS = 2
HOST_BATCHES = (1, 64)
MS = 1e3


def bandwidth(mib: int, repeat: int) -> tuple[float, float]:
    """The machine's (read, copy) bandwidth in bytes/s: a sum over a ``mib`` MiB float32
    tensor (bytes read) and a copy into another (bytes read + written), best of ``repeat``."""
    n = mib * 2**20 // 4
    src = torch.ones(n)
    dst = torch.empty(n)
    read = best(lambda: src.sum(), repeat, warmup=True)
    copy = best(lambda: dst.copy_(src), repeat, warmup=True)
    return src.nbytes / read, 2 * src.nbytes / copy


def load(model: Path, threads: int, batch: int, tokens: int) -> Engine:
    """The engine, its pool large enough for ``batch`` requests of ``tokens`` each."""
    page_tokens = 16
    layout = Layout.of(load_config(model), torch.float32, page_tokens)
    need = 2 * batch * (cdiv(tokens, page_tokens) + 1) * layout.page_bytes
    target = Target(
        name="decode",
        checkpoint=model,
        threads=threads,
        page_tokens=page_tokens,
        pool_bytes=max(DEFAULT_POOL_BYTES, need),
    )
    return Engine.load(target)


def measure(engine: Engine, batches: list[int], args) -> list[tuple[int, int, Split]]:
    """(batch, weight bytes a step reads, split) per batch size, on one scheduler."""
    probe = Probe()
    decode = Decode(engine, probe)
    max_tokens = WARMUP_STEPS + 2 * args.steps + 4
    out = []
    try:
        for b in batches:
            reqs = decode.start(b, args.prompt, max_tokens, seed=b)
            wbytes = decode.weight_bytes()
            for _ in range(WARMUP_STEPS - 1):
                decode.sched.step()
            split = probe.measure(decode.sched.step, args.steps)
            decode.end(reqs)
            out.append((b, wbytes, split))
    finally:
        decode.close()
    return out


HEADER = (
    "| batch | tok/s | ms/step | linears ms | other ops ms | host ms | weights MB/step "
    "| weights GB/s | floor ms | step/floor |\n"
    "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
)


def row(b: int, wbytes: int, s: Split, bw: float) -> str:
    host = s.host
    floor = wbytes / bw
    return (
        f"| {b} | {b / s.wall:,.1f} | {s.wall * MS:.2f} | {s.linears * MS:.2f} "
        f"| {s.other * MS:.2f} | {host * MS:.2f} | {wbytes / 1e6:,.1f} "
        f"| {wbytes / s.wall / 1e9:.1f} | {floor * MS:.2f} | {s.wall / floor:.2f}x |"
    )


def linear_shapes(engine: Engine, prompt: int) -> list[tuple[int, int]]:
    """(in, out) of every linear a batch-1 decode step runs, in order."""
    decode = Decode(engine, Probe())
    ops = engine.runner.ops
    linear = ops.linear
    shapes: list[tuple[int, int]] = []

    def recording(x, w, bias=None):
        shapes.append((x.shape[1], w.out_features))
        return linear(x, w, bias)

    try:
        reqs = decode.start(1, prompt, 4, seed=1)
        ops.linear = recording
        decode.sched.step()
        del ops.linear
        decode.end(reqs)
    finally:
        decode.close()
    return shapes


def linears_table(shapes: list[tuple[int, int]], repeat: int) -> str:
    """A decode step's linears (random weights of its shapes) timed four ways, best of
    ``repeat`` rounds taken in turn: kern's oneDNN call on reordered and on plain weights at
    two rows (one row padded, as kern runs it), MKL's matrix-vector product at one row, and
    a torch sum over the same bytes (the read floor)."""
    gen = torch.Generator().manual_seed(0)
    plain = [torch.randn(n, k, generator=gen) for k, n in shapes]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in plain]
    xs = [torch.randn(2, k, generator=gen) for k, _ in shapes]
    flat = torch.cat([w.flatten() for w in plain])
    nbytes = flat.numel() * flat.element_size()

    def onednn(weights):
        def run() -> None:
            for x, w in zip(xs, weights, strict=True):
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

        return run

    def mv() -> None:
        for x, w in zip(xs, plain, strict=True):
            torch.mv(w, x[0])

    ways = {
        "oneDNN, weight reordered at load (kern's), M = 2": onednn(packed),
        "oneDNN, plain [out, in] weight, M = 2": onednn(plain),
        "MKL torch.mv, M = 1": mv,
        "a torch sum over the same bytes": flat.sum,
    }
    times: dict[str, float] = dict.fromkeys(ways, float("inf"))
    for _ in range(repeat):
        for name, fn in ways.items():
            times[name] = min(times[name], best(fn, 1, warmup=True))
    lines = [
        f"| the step's {len(shapes)} linears ({nbytes / 1e6:,.1f} MB) | ms | GB/s |",
        "| --- | ---: | ---: |",
    ]
    lines += [f"| {name} | {t * MS:.3f} | {nbytes / t / 1e9:.1f} |" for name, t in times.items()]
    return "\n".join(lines)


def call_cost(repeat: int) -> float:
    """Seconds of one torch call that does next to nothing (an in-place add to a 1-element
    tensor): what each torch call costs before any work, best of ``repeat`` runs of 1,000."""
    x = torch.zeros(1)

    def calls() -> None:
        for _ in range(1000):
            torch.add(x, 1.0, out=x)

    return best(calls, repeat, warmup=True) / 1000


def host_table(results: list[tuple[int, int, Split]], per_call: float) -> str:
    """Per batch: wall, ops and host time per step, the calls' fixed cost, host time by
    part (``per_call``: from :func:`call_cost`)."""
    cols = " | ".join(f"batch {b} ms" for b, _, _ in results)
    lines = [f"| per step | {cols} |", "| --- |" + " ---: |" * len(results)]

    def line(name: str, values) -> None:
        lines.append(f"| {name} | " + " | ".join(f"{v * MS:.3f}" for v in values) + " |")

    splits = [s for _, _, s in results]
    line("wall", [s.wall for s in splits])
    line("torch ops", [s.linears + s.other for s in splits])
    lines.append(
        "| torch calls from Python | " + " | ".join(f"{s.calls:,.0f}" for s in splits) + " |"
    )
    line(
        f"of the ops: calls x {per_call * 1e6:.1f} us (a 1-element add's cost)",
        [s.calls * per_call for s in splits],
    )
    line("**host** (wall - ops)", [s.host for s in splits])
    for part, what in PARTS:
        line(f"host: {part} ({what})", [s.part_wall[part] - s.part_ops[part] for s in splits])
    return "\n".join(lines)


def llama_cpp_tok_s(gguf: Path, prompt: list[int], steps: int, threads: int, repeat: int) -> float:
    """llama.cpp's greedy decode of ``prompt``'s continuation, tokens/s (best of ``repeat``;
    the prompt and the first token not counted)."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(gguf),
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=len(prompt) + steps + 16,
        verbose=False,
    )
    times = []
    for _ in range(repeat):
        gen = llm.generate(
            prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True
        )
        next(gen)
        t = time.perf_counter()
        for _ in range(steps):
            next(gen)
        times.append(time.perf_counter() - t)
        gen.close()
    return steps / min(times)


def _describe(engine: Engine) -> str:
    params = sum(t.numel() for t in engine.checkpoint.tensors.values())
    return f"{engine.checkpoint.config.model_type}, {params / 1e6:.1f}M parameters"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m kern.bench.decode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", type=Path, default=None, help="checkpoint folder")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 32])
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per pass")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeat", type=int, default=5, help="bandwidth and llama.cpp runs")
    parser.add_argument("--bw-mib", type=int, default=256, help="bandwidth tensor size")
    parser.add_argument("--llama-cpp", type=Path, default=None, metavar="GGUF")
    parser.add_argument("--host", action="store_true", help="host overhead on the tiny model")
    parser.add_argument(
        "--linears", action="store_true", help="also time the step's linears four ways"
    )
    parser.add_argument("--host-batches", type=int, nargs="+", default=list(HOST_BATCHES))
    args = parser.parse_args(argv)
    for name in ("prompt", "steps", "threads", "repeat", "bw_mib"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if min(args.batches + args.host_batches) < 1:
        parser.error("--batches and --host-batches must be positive")
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there")
    if args.llama_cpp is not None:
        if importlib.util.find_spec("llama_cpp") is None:
            parser.error(
                "--llama-cpp needs the llama_cpp package (pip install llama-cpp-python), "
                "which this Python cannot import"
            )
        if not args.llama_cpp.is_file():
            parser.error(f"--llama-cpp {args.llama_cpp}: no such file")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    load1, load5, _ = os.getloadavg()
    print(
        f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} cpus, "
        f"load average {load1:.2f} (1 min) {load5:.2f} (5 min); prompt {args.prompt}, "
        f"{args.steps} steps a pass, means over the faster half",
        flush=True,
    )
    tokens = args.prompt + WARMUP_STEPS + 2 * args.steps + 8
    if args.host:
        from kern.tiny import default_model_path

        engine = load(default_model_path(), args.threads, max(args.host_batches), tokens)
        print(f"\nHost overhead per scheduler step, embedded tiny {_describe(engine)}:\n")
        print(host_table(measure(engine, args.host_batches, args), call_cost(args.repeat)))
        return 0
    read_bw, copy_bw = bandwidth(args.bw_mib, args.repeat)
    bw = max(read_bw, copy_bw)
    print(
        f"machine: read (sum) {read_bw / 1e9:.1f} GB/s, copy {copy_bw / 1e9:.1f} GB/s "
        f"(read + written; {args.bw_mib} MiB float32, best of {args.repeat}); the floor is "
        f"the weight bytes at {bw / 1e9:.1f} GB/s, the faster of the two",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from kern.tiny import make_tiny

            model = Path(tmp) / "qwen3-88m"
            make_tiny("qwen3", model, seed=0, overwrite=True, **MODEL_100M)
        engine = load(model, args.threads, max(args.batches), tokens)
        print(f"model: {model} ({_describe(engine)})\n")
        print(HEADER)
        results = measure(engine, args.batches, args)
        for b, wbytes, split in results:
            print(row(b, wbytes, split, bw))
        print("\nHost time by part (ms per step):\n")
        print(host_table(results, call_cost(args.repeat)))
        if args.linears:
            print("\nA batch-1 step's linears on their own (best of --repeat rounds):\n")
            print(linears_table(linear_shapes(engine, args.prompt), args.repeat))
        if args.llama_cpp is not None:
            one = [s for b, _, s in results if b == 1]
            prompt = Decode.prompts(engine, 1, args.prompt, seed=1)[0]
            theirs = llama_cpp_tok_s(args.llama_cpp, prompt, args.steps, args.threads, args.repeat)
            print(f"\nllama.cpp ({args.llama_cpp}, {args.threads} threads): {theirs:,.1f} tok/s")
            if one:
                print(f"kern batch 1 / llama.cpp: {1 / one[0].wall / theirs:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
