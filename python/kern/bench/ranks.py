"""One rank against several on the CPU (gloo): ``python -m kern.bench.ranks``.

For each configuration (``--configs``, e.g. ``1x2,1x1,2x1``: ranks x threads per rank), in
a process of its own, on a ``make-tiny`` qwen3 of ~88M parameters (``--model`` for another):

* weights: the bytes of the tensors each rank holds (from the safetensors headers and
  ``kern.engine.ranks.shard``), and each rank's peak RSS after loading and building its
  runner (VmHWM; the arena is kept small, so this is the weights plus the process's fixed
  cost);
* prefill: ``--batch`` prompts of ``--prompt`` tokens in one forward;
* decode: ``--batch`` sequences at that context, ``--steps`` steps of one token each; the
  step time, the share of it rank 0 spent in the model's collectives (``Comm.seconds``:
  waiting for the other rank included) and in the step's broadcast.

Times are the best of ``--repeat`` runs (prefill) or the median step (decode): other
processes share these machines. The ratios are against the first configuration, measured in
the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kern.arith import cdiv
from kern.bench.forward import MODEL_100M
from kern.chunk import SeqChunk

PAGE_TOKENS = 16


def _hwm_mib(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc")


def _shard_bytes(model: Path, ranks: int) -> list[int]:
    from kern import checkpoint as ck
    from kern.checkpoint.config import load_config
    from kern.engine.ranks.shard import Shard

    config = load_config(model)
    entries = ck._index_tensors(model, config)
    out = []
    for rank in range(ranks):
        shard = Shard(rank, ranks, "tp")
        total = 0
        for name, e in entries.items():
            try:
                part = shard.part(config, name, e.shape)
            except KeyError:
                continue
            n = ck._num_bytes(e)
            if part is not None:
                n = n * sum(b - a for _, a, b in part) // e.shape[part[0][0]]
            total += n
        out.append(total)
    return out


def one(model: Path, ranks: int, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration, in this process: the figures as a dict."""
    from kern.kern_toml import Target

    torch.set_num_threads(threads)
    seqs, prompt = args.batch, args.prompt
    per_seq = cdiv(prompt + args.steps + 1, PAGE_TOKENS)
    num_pages = per_seq * seqs
    target = Target(name="bench", checkpoint=model, ranks=ranks, threads=threads)
    ranked = None
    if ranks > 1:
        from kern.engine.ranks.launch import Ranks

        ranked = Ranks.start(target)
        ckpt = ranked.load(progress=False)
        runner: Any = ranked.runner_with_pages(ckpt, num_pages)
        ranked_runner = runner
    else:
        from kern.checkpoint.load import load_checkpoint
        from kern.engine.runner import Runner

        ckpt = load_checkpoint(model)
        runner = Runner.with_pages(ckpt, num_pages=num_pages, page_tokens=PAGE_TOKENS)
    hwm = [_hwm_mib()]
    if ranked is not None:
        hwm += [_hwm_mib(p.pid) for p in ranked.procs.values()]
    gen = torch.Generator().manual_seed(0)
    vocab = ckpt.config.vocab_size
    prompts = [torch.randint(0, vocab, (prompt,), generator=gen).tolist() for _ in range(seqs)]
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(seqs)]
    batch = [SeqChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    runner.forward(batch)  # warm-up
    prefill = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        runner.forward(batch)
        prefill.append(time.perf_counter() - t0)
    last = [int(t) for t in runner.forward(batch).argmax(-1).tolist()]
    steps, comm, bcast = [], [], []
    for s in range(args.steps):
        chunks = [
            SeqChunk([last[b]], prompt + s, tables[b][: cdiv(prompt + s + 1, PAGE_TOKENS)])
            for b in range(seqs)
        ]
        c0 = ranked.comm.seconds if ranked else 0.0
        b0 = ranked_runner.broadcast_seconds if ranked else 0.0
        t0 = time.perf_counter()
        logits = runner.forward(chunks)
        steps.append(time.perf_counter() - t0)
        if ranked:
            comm.append(ranked.comm.seconds - c0)
            bcast.append(ranked_runner.broadcast_seconds - b0)
        last = logits.argmax(-1).tolist()
    step = statistics.median(steps)
    out = {
        "ranks": ranks,
        "threads": threads,
        "prefill_s": min(prefill),
        "decode_step_s": step,
        "comm_share": statistics.median(c / t for c, t in zip(comm, steps, strict=True))
        if comm
        else 0.0,
        "broadcast_share": statistics.median(b / t for b, t in zip(bcast, steps, strict=True))
        if bcast
        else 0.0,
        "broadcast_ms": statistics.median(bcast) * 1e3 if bcast else 0.0,
        "weights_mib": [b / 2**20 for b in _shard_bytes(model, ranks)],
        "peak_rss_mib": hwm,
    }
    if ranked is not None:
        ranked.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kern.bench.ranks", description=__doc__)
    p.add_argument("--model", type=Path, help="a qwen3 checkpoint (default: make a ~88M one)")
    p.add_argument("--configs", default="1x2,1x1,2x1", help="RANKSxTHREADS, comma-separated")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--one", help=argparse.SUPPRESS)  # RANKSxTHREADS, in this process
    args = p.parse_args(argv)
    if args.one:
        ranks, threads = map(int, args.one.split("x"))
        print(json.dumps(one(args.model, ranks, threads, args)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from kern.tiny import make_tiny

            model = make_tiny("qwen3", Path(tmp) / "m100", seed=0, **MODEL_100M)
        rows = []
        for config in args.configs.split(","):
            cmd = [sys.executable, "-m", "kern.bench.ranks", "--model", str(model), "--one"]
            cmd += [config, "--batch", str(args.batch), "--prompt", str(args.prompt)]
            cmd += ["--steps", str(args.steps), "--repeat", str(args.repeat)]
            env = {**os.environ, "OMP_NUM_THREADS": config.split("x")[1]}
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if out.returncode != 0:
                print(out.stderr, file=sys.stderr)
                return 1
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = rows[0]
    print(
        f"{args.model or 'qwen3 ~88M (make-tiny)'}, batch {args.batch}, prompt {args.prompt}, "
        f"{args.steps} decode steps, "
        f"gloo on {os.cpu_count()} CPUs\n"
    )
    print(
        "| ranks x threads | prefill s | vs first | decode step ms | vs first | comm share "
        "| broadcast ms (share) | weights MiB per rank | peak RSS MiB per rank |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for r in rows:
        print(
            f"| {r['ranks']}x{r['threads']} | {r['prefill_s']:.3f} | "
            f"{r['prefill_s'] / base['prefill_s']:.2f} | {r['decode_step_s'] * 1e3:.1f} | "
            f"{r['decode_step_s'] / base['decode_step_s']:.2f} | {r['comm_share']:.0%} | "
            f"{r['broadcast_ms']:.2f} ({r['broadcast_share']:.1%}) | "
            f"{', '.join(f'{w:.0f}' for w in r['weights_mib'])} | "
            f"{', '.join(f'{m:.0f}' for m in r['peak_rss_mib'])} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
