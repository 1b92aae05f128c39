"""``kern bench``: load against a running server, and the runner's own decode rate beside it.

Design notes
------------
* Each request is a streamed completion (greedy, ``ignore_eos``, a fixed ``max_tokens``) so
  every request produces the same number of tokens and TTFT / TPOT are measured at the client,
  where a user sees them: TTFT from sending to the first token, TPOT the mean gap after it.
* Prompts are token ids drawn from a seeded generator, with a shared prefix for a share of
  them (``--shared-prefix``), so the cached-token ratio measures the prefix cache too.
* ``--baseline-model DIR`` also runs, before the load, the scheduler in this process on the
  same prompts with no HTTP (``scheduler tok/s``: prefill and scheduling included), and
  times ``Runner.forward`` decoding a batch of ``concurrency``
  sequences in this process (same page size and thread count as the server's default), the
  ceiling the server's output tokens/s is compared with: the gap is what scheduling, prefill
  and HTTP cost. It runs before the load, while the server is idle; run the bench on an
  otherwise idle machine (the client's own SSE parsing still shares the CPU with the server).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="load a running server and print a summary table",
        description="Send --requests streamed completions at each --concurrency to --url.",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--concurrency", default="1,12,64", help="comma-separated levels")
    p.add_argument("--requests", type=int, default=64, help="requests per level")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--shared-prefix", type=int, default=32, help="tokens every prompt shares")
    p.add_argument("--api-key", help="Bearer key")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline-model", metavar="DIR", help="also time the runner's decode")
    p.add_argument("--threads", type=int, default=2, help="baseline torch threads")
    p.add_argument("--json", action="store_true", help="print the table as JSON too")
    p.set_defaults(func=run)


@dataclass
class _Result:
    ttft: float
    tpot: float | None
    tokens: int
    prompt_tokens: int
    cached_tokens: int


def run(args: argparse.Namespace) -> int:
    from kern.errors import UsageError

    try:
        levels = [int(x) for x in args.concurrency.split(",")]
    except ValueError:
        raise UsageError(f"--concurrency {args.concurrency!r}: expected e.g. 1,12,64") from None
    prompt_sets = _prompt_sets(args, levels)
    # The baselines first, while the server is idle: measured after the load they shared the
    # CPU with whatever the server was still doing, and came out 2-6x low.
    runner, sched = {}, {}
    if args.baseline_model:
        runner, sched = _baselines(args, levels, prompt_sets)
    rows = asyncio.run(_bench(args, levels, prompt_sets))
    for row in rows:
        level = row["concurrency"]
        if level in runner:
            row["runner_tok_s"] = runner[level]
            row["sched_tok_s"] = sched[level]
            row["ratio"] = row["output_tok_s"] / runner[level]
            row["sched_ratio"] = sched[level] / runner[level]
    _print_table(rows)
    if args.json:
        print(json.dumps(rows))
    return 0


def _prompt_sets(args: argparse.Namespace, levels: list[int]) -> list[list[list[int]]]:
    """The prompts of each level, from the seed: a shared prefix, then random ids."""
    vocab_hi = 256  # byte tokens exist in every kern tokenizer
    rng = random.Random(args.seed)
    shared = [rng.randrange(vocab_hi) for _ in range(args.shared_prefix)]
    rest = args.prompt_tokens - len(shared)
    return [
        [shared + [rng.randrange(vocab_hi) for _ in range(rest)] for _ in range(args.requests)]
        for _ in levels
    ]


async def _bench(
    args: argparse.Namespace, levels: list[int], prompt_sets: list[list[list[int]]]
) -> list[dict]:
    import httpx
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        rows = []
        for level, prompts in zip(levels, prompt_sets, strict=True):
            sem = asyncio.Semaphore(level)
            bar = tqdm(total=args.requests, desc=f"concurrency {level}", file=sys.stderr)

            async def one(prompt: list[int], sem=sem, bar=bar) -> _Result:
                async with sem:
                    r = await _one(client, model, prompt, args.max_tokens)
                bar.update(1)
                return r

            t0 = time.perf_counter()
            results = await asyncio.gather(*(one(p) for p in prompts))
            wall = time.perf_counter() - t0
            bar.close()
            rows.append(_row(level, results, wall))
    return rows


async def _one(client, model: str, prompt: list[int], max_tokens: int) -> _Result:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = last = None
    usage = None
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            if event["choices"]:
                now = time.perf_counter()
                first = first or now
                last = now
    assert usage is not None and first is not None and last is not None
    n = usage["completion_tokens"]
    return _Result(
        ttft=first - t0,
        tpot=(last - first) / (n - 1) if n > 1 else None,
        tokens=n,
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
    )


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _row(level: int, results: list[_Result], wall: float) -> dict:
    ttft = [r.ttft for r in results]
    tpot = [r.tpot for r in results if r.tpot is not None]
    return {
        "concurrency": level,
        "requests": len(results),
        "req_s": len(results) / wall,
        "output_tok_s": sum(r.tokens for r in results) / wall,
        "ttft_p50_ms": 1e3 * statistics.median(ttft),
        "ttft_p99_ms": 1e3 * _pct(ttft, 0.99),
        "tpot_p50_ms": 1e3 * statistics.median(tpot) if tpot else float("nan"),
        "tpot_p99_ms": 1e3 * _pct(tpot, 0.99),
        "cached_ratio": sum(r.cached_tokens for r in results)
        / max(1, sum(r.prompt_tokens for r in results)),
    }


def _runner_rate(args: argparse.Namespace, engine, batch: int, repeat: int = 2) -> float:
    """Decode tokens/s of ``runner.forward`` over ``batch`` sequences: the best of ``repeat``
    runs of ``max_tokens`` steps from the prompt's end, so the contexts are the ones the
    load's requests decode at (the scheduler's decode shapes, built from Python values and
    sampled greedily every step). Pages and slots come from the (still empty) cache and go
    back to it after."""
    import numpy as np

    from kern.pool import PoolFull

    runner, cache = engine.runner, engine.cache
    pt = runner.page_tokens
    per_seq = -(-(args.prompt_tokens + args.max_tokens) // pt)
    try:
        pages = np.frombuffer(cache.alloc_pages(batch * per_seq), np.uint32).tolist()
        slots = [cache.alloc_slot() for _ in range(batch)] if runner.stateful else [None] * batch
    except PoolFull:
        raise SystemExit(
            f"--baseline-model: the default pool is too small for batch {batch}"
        ) from None
    tables = [pages[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    try:
        return _decode_rate(args, runner, tables, slots, repeat)
    finally:
        cache.free_pages(np.asarray(pages, np.uint32))
        for slot in slots:
            if slot is not None:
                cache.free_slot(slot)


def _decode_rate(args: argparse.Namespace, runner, tables, slots, repeat: int) -> float:
    from kern.batch import SeqChunk
    from kern.sampler import GREEDY, sample

    batch = len(tables)
    prompt = [1] * args.prompt_tokens
    runner.forward([SeqChunk(prompt, 0, t, slot=s) for t, s in zip(tables, slots, strict=True)])
    params = [GREEDY] * batch
    pos = args.prompt_tokens
    n = args.max_tokens
    best = float("inf")
    for _ in range(repeat):
        toks = [1] * batch
        t0 = time.perf_counter()
        for s in range(n):
            chunks = [SeqChunk([toks[i]], pos + s, t, slot=slots[i]) for i, t in enumerate(tables)]
            toks = sample(runner.forward(chunks), params, [s] * batch)
        best = min(best, time.perf_counter() - t0)
    return batch * n / best


def _baselines(
    args: argparse.Namespace, levels: list[int], prompt_sets: list[list[list[int]]]
) -> tuple[dict[int, float], dict[int, float]]:
    """Per level, the runner's batched decode rate and the scheduler's output rate (no
    HTTP, at most ``level`` in flight, a new request submitted as one finishes, levels in
    order on one cache as the server sees them). Both on the scheduler's thread, which also
    loads the model, as in the server (see ``kern.scheduler.start_scheduler``)."""
    import threading
    from pathlib import Path

    from kern.engine import Engine
    from kern.scheduler import Request, Scheduler, start_scheduler
    from kern.toml_config import Target

    target = Target(
        name="baseline", checkpoint=Path(args.baseline_model).resolve(), threads=args.threads
    )
    runner_rates: dict[int, float] = {}
    rates: dict[int, float] = {}
    state: dict = {"level": -1}
    done = threading.Event()

    def make() -> Scheduler:
        engine = Engine.load(target)
        for level in levels:
            runner_rates[level] = _runner_rate(args, engine, level)
        state["sched"] = engine.scheduler(deliver, on_crash=lambda e: done.set())
        # Queued before the loop starts; later levels are submitted from deliver, so only
        # the scheduler's thread ever touches state.
        next_level()
        return state["sched"]

    def submit() -> None:
        prompt = state["prompts"][state["next"]]
        state["next"] += 1
        state["sched"].submit(Request(prompt, args.max_tokens, ignore_eos=True))

    def next_level() -> None:
        if state["level"] >= 0:
            rates[levels[state["level"]]] = state["tokens"] / (time.perf_counter() - state["t0"])
        state["level"] += 1
        if state["level"] == len(levels):
            done.set()
            return
        prompts = prompt_sets[state["level"]]
        state.update(prompts=prompts, next=0, finished=0, tokens=0, t0=time.perf_counter())
        for _ in range(min(levels[state["level"]], len(prompts))):
            submit()

    def deliver(events) -> None:
        for _, (token, _, finish) in events:
            state["tokens"] += token is not None
            if finish is not None:
                state["finished"] += 1
                if state["next"] < len(state["prompts"]):
                    submit()
                elif state["finished"] == len(state["prompts"]):
                    next_level()

    sched = start_scheduler(make)
    done.wait()
    sched.stop()
    if sched.failed is not None:
        raise RuntimeError("the scheduler failed") from sched.failed
    return runner_rates, rates


def _print_table(rows: list[dict]) -> None:
    cols = [
        ("concurrency", "conc", "{:d}"),
        ("req_s", "req/s", "{:.2f}"),
        ("output_tok_s", "out tok/s", "{:.1f}"),
        ("ttft_p50_ms", "TTFT p50 ms", "{:.1f}"),
        ("ttft_p99_ms", "TTFT p99 ms", "{:.1f}"),
        ("tpot_p50_ms", "TPOT p50 ms", "{:.2f}"),
        ("tpot_p99_ms", "TPOT p99 ms", "{:.2f}"),
        ("cached_ratio", "cached", "{:.2f}"),
    ]
    if rows and "runner_tok_s" in rows[0]:
        cols += [
            ("runner_tok_s", "runner tok/s", "{:.1f}"),
            ("sched_tok_s", "scheduler tok/s", "{:.1f}"),
            ("sched_ratio", "scheduler/runner", "{:.2f}"),
            ("ratio", "server/runner", "{:.2f}"),
        ]
    print("| " + " | ".join(h for _, h, _ in cols) + " |")
    print("|" + "|".join(" ---: " for _ in cols) + "|")
    for row in rows:
        print("| " + " | ".join(f.format(row[k]) for k, _, f in cols) + " |")
