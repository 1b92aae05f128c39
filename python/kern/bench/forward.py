"""Forward-pass throughput of kern's runner on the CPU, next to transformers on the same
weights in the same process: ``python -m kern.bench.forward``.

Per model and batch size B:

* prefill: B prompts of ``--prompt`` tokens in one forward (kern: one ragged batch of B
  chunks, logits for each last row; transformers: one [B, prompt] forward, eager attention);
* decode: B sequences at ``--prompt`` tokens of context, ``--steps`` steps of one token
  each, with greedy sampling and the batch built from Python values every step, as the
  scheduler does (kern), against transformers' ``generate`` at batch 1 (decode time only:
  generate(steps + 1) minus generate(1)).

Times are the best of ``--repeat`` runs: other processes share these machines, and the best
run is the one they disturbed least. Targets (docs/performance.md): decode at batch 32 at
least 10x transformers' batch-1 generate, prefill within 1.5x of transformers' forward time.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kern.arith import cdiv
from kern.checkpoint.load import Checkpoint, load_checkpoint
from kern.chunk import SeqChunk
from kern.engine.params import SamplingParams
from kern.engine.runner import Runner
from kern.engine.sampler import sample

# ~88M parameters: 12 layers of 768 (GQA 12/4 heads of 64, MLP 2048) and an 8192-token vocab.
MODEL_100M = dict(
    layers=12, hidden=768, heads=12, kv_heads=4, head_dim=64, intermediate=2048, vocab=8192
)


def best(fn: Callable[[], object], repeat: int, warmup: bool = False) -> float:
    """The fastest of ``repeat`` timed calls of ``fn`` (seconds), after one untimed call
    with ``warmup``."""
    if warmup:
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def kern_prefill(ckpt: Checkpoint, prompts: list[list[int]], page: int, repeat: int) -> float:
    pages = cdiv(len(prompts[0]), page) + 1
    runner = Runner.with_pages(
        ckpt, num_pages=pages * len(prompts), page_tokens=page, num_slots=len(prompts)
    )
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(len(prompts))]
    batch = [
        SeqChunk(p, 0, t, slot=i) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
    ]
    runner.forward(batch)  # warm-up
    return best(lambda: runner.forward(batch), repeat)


def kern_decode(
    ckpt: Checkpoint, prompts: list[list[int]], steps: int, page: int, repeat: int
) -> float:
    n = len(prompts)
    pages = cdiv(len(prompts[0]) + steps + 1, page)
    runner = Runner.with_pages(ckpt, num_pages=pages * n, page_tokens=page, num_slots=n)
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(n)]
    greedy = [SamplingParams()] * n
    logits = runner.forward(
        [SeqChunk(p, 0, t, slot=i) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]
    )
    first = sample(logits, greedy, [0] * n)
    start = len(prompts[0])

    def run() -> None:
        tokens, pos = first, start
        for s in range(steps):
            batch = [SeqChunk([tokens[i]], pos, tables[i], slot=i) for i in range(n)]
            tokens = sample(runner.forward(batch), greedy, [s + 1] * n)
            pos += 1

    return best(run, repeat)


def hf_prefill(model, prompts: list[list[int]], repeat: int) -> float:
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        model(ids)
        return best(lambda: model(ids), repeat)


def hf_generate_decode(model, prompt: list[int], steps: int, repeat: int) -> float:
    """Seconds per decoded token of transformers' batch-1 greedy generate."""
    ids = torch.tensor([prompt])
    kwargs = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def gen(n: int) -> Callable[[], None]:
        return lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)

    with torch.inference_mode():
        gen(2)()
        full = best(gen(steps + 1), repeat)
        one = best(gen(1), repeat)
    return (full - one) / steps


def bench_model(name: str, path: Path, args) -> list[tuple]:
    import transformers

    ckpt = load_checkpoint(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model.generation_config.eos_token_id = None
    vocab = ckpt.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    hf_tok_s = 1.0 / hf_generate_decode(
        model,
        torch.randint(0, vocab, (args.prompt,), generator=gen).tolist(),
        args.steps,
        args.repeat,
    )
    rows = []
    for b in args.batch:
        prompts = torch.randint(0, vocab, (b, args.prompt), generator=gen).tolist()
        ours_p = kern_prefill(ckpt, prompts, args.page, args.repeat)
        theirs_p = hf_prefill(model, prompts, args.repeat)
        ours_d = kern_decode(ckpt, prompts, args.steps, args.page, args.repeat)
        tokens = b * args.prompt
        rows.append(
            (
                name,
                b,
                tokens / ours_p,
                tokens / theirs_p,
                ours_p / theirs_p,
                b * args.steps / ours_d,
                hf_tok_s,
                b * args.steps / ours_d / hf_tok_s,
            )
        )
        print(_row(rows[-1]), flush=True)
    return rows


HEADER = (
    "| model | batch | kern prefill tok/s | HF forward tok/s | kern/HF prefill time "
    "| kern decode tok/s | HF generate b1 tok/s | decode speedup |\n"
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
)


def _row(r: tuple) -> str:
    name, b, kp, hp, ratio, kd, hd, speed = r
    return (
        f"| {name} | {b} | {kp:,.0f} | {hp:,.0f} | {ratio:.2f}x | {kd:,.0f} | {hd:,.0f} "
        f"| {speed:.1f}x |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kern.bench.forward",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=32, help="decode steps")
    parser.add_argument("--page", type=int, default=16, help="page_tokens")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip-100m", action="store_true", help="only the embedded tiny model")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="where to keep the ~100M checkpoint (default: a temporary folder)",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from kern.tiny import default_model_path, make_tiny

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, prompt {args.prompt}, "
        f"{args.steps} decode steps, best of {args.repeat}"
    )
    print(HEADER, flush=True)
    rows = bench_model("tiny-qwen3 (embedded)", default_model_path(), args)
    if not args.skip_100m:
        with tempfile.TemporaryDirectory() as tmp:
            where = args.model_dir or Path(tmp) / "qwen3-100m"
            if not (where / "config.json").is_file():
                make_tiny("qwen3", where, seed=0, overwrite=True, **MODEL_100M)
            rows += bench_model("qwen3 ~88M (make-tiny)", where, args)
    print()
    print(HEADER)
    for r in rows:
        print(_row(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
