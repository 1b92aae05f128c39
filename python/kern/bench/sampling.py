"""The cost of logits processing per decode step: ``python -m kern.bench.sampling``.

A batch of ``--batch`` sequences decodes ``--steps`` steps on the CPU (the embedded tiny model,
or the ~88M one of ``kern.bench.forward`` with ``--model 100m``), as the scheduler runs them:
one forward, then ``kern.engine.sampler.sample`` over the batch's logits. Runs, in turn, on the
same runner: greedy with nothing else; greedy with presence, frequency and repetition
penalties, a logit bias and ``min_tokens`` banning the end tokens (every processor kern
has); greedy with every row held to a JSON schema (xgrammar's mask, each row's matcher fed
its token, as the scheduler does); random sampling (temperature 0.8, top-p 0.9, min-p 0.05,
seeded) plain and with the processors. Prints the median step time of each and what it adds
to the plain step of its kind. Target (docs/performance.md): under 10% of the step.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kern.arith import cdiv
from kern.checkpoint.load import load_checkpoint
from kern.chunk import SeqChunk
from kern.engine.params import Context, SamplingParams
from kern.engine.runner import Runner
from kern.engine.sampler import TokenLog, sample
from kern.tiny import default_model_path, make_tiny

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
    },
    "required": ["name", "age", "tags"],
}


def decode_steps(
    runner: Runner, prompts, params, steps: int, page: int, processed: bool, grammar=None
):
    """Per-step seconds of ``steps`` decode steps (forward + sample) of the batch; with
    ``grammar`` (a compiled JSON schema and its kern.engine.structured.Grammars), every row is held
    to it, a finished JSON starting the next at once."""
    n = len(prompts)
    pages = cdiv(len(prompts[0]) + steps + 1, page)
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(n)]
    tokens = [list(p) for p in prompts]
    logits = runner.forward(
        [SeqChunk(p, 0, t, slot=i) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))]
    )
    banned = frozenset({0, 1, 2}) if processed else frozenset()
    logs = [TokenLog() for _ in range(n)]
    matchers = [None] * n
    times = []
    for s in range(steps + 1):
        t0 = time.perf_counter()
        if s:
            batch = [
                SeqChunk([tokens[i][-1]], len(tokens[i]) - 1, tables[i], slot=i) for i in range(n)
            ]
            logits = runner.forward(batch)
        contexts = None
        if grammar is not None:
            compiled, grammars = grammar
            for i, m in enumerate(matchers):
                if m is None or m.done:
                    matchers[i] = grammars.matcher(compiled)
        if processed or grammar is not None:
            contexts = [
                Context(t, len(prompts[0]), banned, matchers[i], logs[i])
                for i, t in enumerate(tokens)
            ]
        picked = sample(logits, params, [s] * n, contexts)
        for i, tok in enumerate(picked):
            tokens[i].append(tok)
            if grammar is not None and not matchers[i].accept(tok):
                raise AssertionError(f"row {i}: the grammar refused the token it allowed")
        if s:
            times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kern.bench.sampling", description=__doc__)
    ap.add_argument("--model", choices=("tiny", "100m"), default="tiny")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "tiny":
            path = default_model_path()
        else:
            from kern.bench.forward import MODEL_100M

            path = make_tiny("qwen3", Path(tmp) / "m", seed=0, **MODEL_100M)
        ckpt = load_checkpoint(path)
        page = 16
        pages = cdiv(args.prompt + args.steps + 1, page)
        runner = Runner.with_pages(
            ckpt, num_pages=pages * args.batch, page_tokens=page, num_slots=args.batch
        )
        vocab = ckpt.config.vocab_size
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, vocab, (args.batch, args.prompt), generator=gen).tolist()
        procs = dict(
            presence_penalty=0.5,
            frequency_penalty=0.5,
            repetition_penalty=1.2,
            logit_bias=tuple((t, 2.0) for t in range(3, 40)),
        )
        from kern.engine.structured import Grammars

        grammars = Grammars(ckpt.tokenizer, vocab)
        compiled = grammars.compile({"type": "json_schema", "json_schema": {"schema": SCHEMA}})

        def sampled(**kw) -> list[SamplingParams]:
            return [
                SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05, seed=i, **kw)
                for i in range(args.batch)
            ]

        # name: (params, processors on, a JSON schema on, the plain run it is compared with)
        runs = {
            "greedy, plain": ([SamplingParams()] * args.batch, False, False, None),
            "greedy, all processors": (
                [SamplingParams(**procs)] * args.batch, True, False, "greedy, plain"
            ),
            "greedy, JSON schema": (
                [SamplingParams()] * args.batch, False, True, "greedy, plain"
            ),
            "sampled, plain": (sampled(), False, False, None),
            "sampled, all processors": (sampled(**procs), True, False, "sampled, plain"),
        }  # fmt: skip
        got: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(args.rounds):
            for name, (params, processed, json_on, _) in runs.items():
                got[name] += decode_steps(
                    runner, prompts, params, args.steps, page, processed,
                    (compiled, grammars) if json_on else None,
                )  # fmt: skip
    print(
        f"model {args.model} (vocab {vocab}), batch {args.batch}, context {args.prompt}, "
        f"{args.steps} steps x {args.rounds} rounds, {torch.get_num_threads()} threads; "
        "median ms per decode step (forward + sampling):"
    )
    for name, times in got.items():
        med = statistics.median(times)
        base = runs[name][3]
        vs = ""
        if base is not None:
            ref = statistics.median(got[base])
            vs = f"  {(med / ref - 1) * 100:+6.1f}% vs {base}"
        print(f"  {name:26s} {med * 1e3:8.2f} ms{vs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
