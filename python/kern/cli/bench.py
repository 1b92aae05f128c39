"""``kern bench``: load against a running server, and the runner's own decode rate beside it.

Design notes
------------
* Each request is a streamed completion (greedy, ``ignore_eos``, a fixed ``max_tokens``) so
  every request produces the same number of tokens, and the latencies are measured at the
  client, where a user sees them (their definitions and the summary: kern.cli.bench_report).
* A request that fails (an HTTP error, a dropped connection, a stream without its usage) is a
  failed row of the summary with its first error, never the end of the run. A server that
  does not answer at all is one line before any load.
* Arrivals: all at once by default, at most ``concurrency`` in flight; with
  ``--request-rate R``, a Poisson process of R requests/s (seeded exponential gaps), still
  capped by ``concurrency``, as ``vllm bench serve --request-rate --max-concurrency``.
* Prompts are token ids drawn from a seeded generator, with a shared prefix for every prompt
  (``--shared-prefix``), so the cached-token ratio measures the prefix cache too.
* The draft acceptance rate of a level (a server at ``--rows`` > 1) is the change of the
  server's ``kern_spec_decode_num_accepted_tokens_total`` over that of
  ``kern_spec_decode_num_draft_tokens_total`` across the level, read from ``/metrics`` before
  and after it ("-" when nothing was drafted).
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
import sys
import threading
import time
from pathlib import Path

import kern.cli.args as argtypes
from kern.arith import cdiv
from kern.cli.bench_report import Result, level_row, print_block, print_table
from kern.errors import UsageError
from kern.kern_toml import Target
from kern.pool import PoolFull

__all__ = ["add_parser", "run"]

# Token ids the prompts draw from: byte tokens exist in every kern tokenizer.
_VOCAB_HI = 256


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="load a running server and print a summary table",
        description="Send --requests streamed completions at each --concurrency to --url and "
        "print TTFT, TPOT, ITL and end-to-end latency (mean, median, p99) per level.",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument(
        "--concurrency",
        type=argtypes.level_list,
        default=[1, 12, 64],
        metavar="N,N,...",
        help="requests in flight at most, one run per level (default 1,12,64)",
    )
    p.add_argument("--requests", type=argtypes.positive_int, default=64, help="requests per level")
    p.add_argument("--prompt-tokens", type=argtypes.positive_int, default=64, metavar="N")
    p.add_argument("--max-tokens", type=argtypes.positive_int, default=64, metavar="N")
    p.add_argument(
        "--shared-prefix",
        type=argtypes.count,
        default=32,
        metavar="N",
        help="tokens every prompt starts with (at most --prompt-tokens; default 32)",
    )
    p.add_argument(
        "--request-rate",
        type=argtypes.rate,
        default=float("inf"),
        metavar="R",
        help="Poisson arrivals at R requests/s (default: all at once)",
    )
    p.add_argument("--api-key", help="Bearer key")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline-model", metavar="DIR", help="also time the runner's decode")
    p.add_argument(
        "--threads", type=argtypes.positive_int, default=2, help="baseline torch threads"
    )
    p.add_argument("--json", action="store_true", help="print the table as JSON too")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.shared_prefix > args.prompt_tokens:
        raise UsageError(
            f"--shared-prefix {args.shared_prefix} is longer than --prompt-tokens "
            f"{args.prompt_tokens}"
        )
    levels = args.concurrency
    model = _probe(args)
    prompt_sets = _prompt_sets(args, levels)
    # The baselines first, while the server is idle: measured after the load they shared the
    # CPU with whatever the server was still doing, and came out 2-6x low.
    runner, sched = {}, {}
    if args.baseline_model:
        runner, sched = _baselines(args, levels, prompt_sets)
    rows = asyncio.run(_bench(args, model, levels, prompt_sets))
    for row in rows:
        level = row["concurrency"]
        if level in runner:
            row["runner_tok_s"] = runner[level]
            row["sched_tok_s"] = sched[level]
            row["ratio"] = row["output_tok_s"] / runner[level]
            row["sched_ratio"] = sched[level] / runner[level]
    for row in rows:
        print_block(row)
    print_table(rows)
    if args.json:
        print(json.dumps(rows))
    return 0


def _probe(args: argparse.Namespace) -> str:
    """The served model's id; a server that does not answer is one line (exit 2)."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        r = httpx.get(args.url.rstrip("/") + "/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        raise UsageError(f"--url {args.url}: no server answers ({e})") from None
    if r.status_code == 401:
        raise UsageError(f"--api-key: {args.url} answered 401 (a missing or wrong key)")
    try:
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        raise UsageError(
            f"--url {args.url}: GET /v1/models answered {r.status_code}, not a model list"
        ) from None


def _prompt_sets(args: argparse.Namespace, levels: list[int]) -> list[list[list[int]]]:
    """The prompts of each level, from the seed: a shared prefix, then random ids."""
    rng = random.Random(args.seed)
    shared = [rng.randrange(_VOCAB_HI) for _ in range(args.shared_prefix)]
    rest = args.prompt_tokens - len(shared)
    return [
        [shared + [rng.randrange(_VOCAB_HI) for _ in range(rest)] for _ in range(args.requests)]
        for _ in levels
    ]


async def _bench(
    args: argparse.Namespace, model: str, levels: list[int], prompt_sets: list[list[list[int]]]
) -> list[dict]:
    import httpx
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(levels), max_keepalive_connections=max(levels))
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, timeout=600, limits=limits
    ) as client:
        rows = []
        for level, prompts in zip(levels, prompt_sets, strict=True):
            sem = asyncio.Semaphore(level)
            bar = tqdm(total=len(prompts), desc=f"concurrency {level}", file=sys.stderr)
            gaps = random.Random(args.seed + level)
            arrivals, t = [], 0.0
            for _ in prompts:
                arrivals.append(t)
                if args.request_rate != float("inf"):
                    t += gaps.expovariate(args.request_rate)
            before = await _spec_counts(client)
            t0 = time.perf_counter()

            async def one(prompt: list[int], at: float, sem=sem, bar=bar, t0=t0) -> Result:
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                async with sem:
                    r = await _one(client, model, prompt, args.max_tokens)
                bar.update(1)
                return r

            results = await asyncio.gather(
                *(one(p, a) for p, a in zip(prompts, arrivals, strict=True))
            )
            wall = time.perf_counter() - t0
            bar.close()
            row = level_row(level, results, wall)
            after = await _spec_counts(client)
            drafted, accepted = (a - b for a, b in zip(after, before, strict=True))
            row["draft_tokens"] = drafted
            row["accepted_tokens"] = accepted
            row["acceptance"] = accepted / drafted if drafted else None
            rows.append(row)
    return rows


async def _spec_counts(client) -> tuple[float, float]:
    """The server's speculative counters now (draft tokens, accepted ones), from /metrics:
    their change over a level is its acceptance rate (0, 0 from a server without them)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = await client.get("/metrics")
    r.raise_for_status()
    totals = dict.fromkeys(_SPEC_COUNTERS, 0.0)
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals[_SPEC_COUNTERS[0]], totals[_SPEC_COUNTERS[1]]


_SPEC_COUNTERS = (
    "kern_spec_decode_num_draft_tokens_total",
    "kern_spec_decode_num_accepted_tokens_total",
)


async def _one(client, model: str, prompt: list[int], max_tokens: int) -> Result:
    """One streamed request, timed; any failure is a failed result naming it."""
    import httpx

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
    times: list[float] = []
    usage = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                try:
                    message = json.loads(text)["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = text[:200]
                return Result(False, f"HTTP {resp.status_code}: {message}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                if event["choices"]:
                    times.append(time.perf_counter())
    except (httpx.HTTPError, ValueError, KeyError) as e:
        return Result(False, f"{type(e).__name__}: {e}")
    end = time.perf_counter()
    if usage is None or not times:
        return Result(False, "the stream ended without tokens and usage")
    n = usage["completion_tokens"]
    return Result(
        True,
        ttft=times[0] - t0,
        tpot=(times[-1] - times[0]) / (n - 1) if n > 1 else None,
        itl=[b - a for a, b in zip(times[:-1], times[1:], strict=True)],
        e2el=end - t0,
        tokens=n,
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
    )


def _runner_rate(args: argparse.Namespace, engine, batch: int, repeat: int = 2) -> float:
    """Decode tokens/s of ``runner.forward`` over ``batch`` sequences: the best of ``repeat``
    runs of ``max_tokens`` steps from the prompt's end, so the contexts are the ones the
    load's requests decode at (the scheduler's decode shapes, built from Python values and
    sampled greedily every step). Pages and slots come from the (still empty) cache and go
    back to it after."""
    import numpy as np

    runner, cache = engine.runner, engine.cache
    pt = runner.page_tokens
    per_seq = cdiv(args.prompt_tokens + args.max_tokens, pt)
    try:
        own, _ = cache.take_pages(batch * per_seq)  # the cache is empty: nothing to evict
        if own is None:
            raise PoolFull
        pages = np.frombuffer(own, np.uint32).tolist()
        slots = [cache.alloc_slot() for _ in range(batch)] if runner.stateful else [None] * batch
    except PoolFull:
        raise UsageError(
            f"--baseline-model: the default pool is too small for --concurrency {batch}"
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
    from kern.chunk import SeqChunk
    from kern.engine.params import GREEDY
    from kern.engine.sampler import sample

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
    loads the model, as in the server (see ``kern.engine.scheduler.start_scheduler``)."""
    from kern.engine.load import Engine
    from kern.engine.request import Request
    from kern.engine.scheduler import Scheduler
    from kern.engine.thread import start_scheduler

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
