"""``kern bench``: load against a running server, and the runner's own decode rate beside it.

Design notes
------------
* Each request is a streamed completion (greedy, ``ignore_eos``, a fixed ``max_tokens``) so
  every request produces the same number of tokens and TTFT / TPOT are measured at the client,
  where a user sees them: TTFT from sending to the first token, TPOT the mean gap after it.
* Prompts are token ids drawn from a seeded generator, with a shared prefix for a share of
  them (``--shared-prefix``), so the cached-token ratio measures the prefix cache too.
* ``--baseline-model DIR`` also times ``Runner.forward`` decoding a batch of ``concurrency``
  sequences in this process (same page size and thread count as the server's default), the
  ceiling the server's output tokens/s is compared with: the gap is what scheduling and HTTP
  cost. Run it on an otherwise idle machine: it shares the CPU with the server.
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
    from kern.cli import UsageError

    try:
        levels = [int(x) for x in args.concurrency.split(",")]
    except ValueError:
        raise UsageError(f"--concurrency {args.concurrency!r}: expected e.g. 1,12,64") from None
    rows = asyncio.run(_bench(args, levels))
    if args.baseline_model:
        for row in rows:
            row["runner_tok_s"] = _runner_rate(args, row["concurrency"])
            row["ratio"] = row["output_tok_s"] / row["runner_tok_s"]
    _print_table(rows)
    if args.json:
        print(json.dumps(rows))
    return 0


async def _bench(args: argparse.Namespace, levels: list[int]) -> list[dict]:
    import httpx
    from tqdm import tqdm

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=600) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        vocab_hi = 256  # byte tokens exist in every kern tokenizer
        rng = random.Random(args.seed)
        shared = [rng.randrange(vocab_hi) for _ in range(args.shared_prefix)]
        rows = []
        for level in levels:
            prompts = [
                shared + [rng.randrange(vocab_hi) for _ in range(args.prompt_tokens - len(shared))]
                for _ in range(args.requests)
            ]
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


def _runner_rate(args: argparse.Namespace, batch: int, steps: int = 32) -> float:
    """Decode tokens/s of ``Runner.forward`` over ``batch`` sequences, in this process."""
    import torch

    from kern.batch import SeqChunk
    from kern.checkpoint import load_checkpoint
    from kern.runner import Runner
    from kern.sampler import GREEDY, sample

    torch.set_num_threads(args.threads)
    ckpt = load_checkpoint(args.baseline_model)
    pt = 16
    ctx = args.prompt_tokens + args.max_tokens
    per_seq = -(-ctx // pt)
    runner = Runner(ckpt, num_pages=batch * per_seq, page_tokens=pt, num_slots=batch)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    prompt = [1] * args.prompt_tokens
    runner.forward([SeqChunk(prompt, 0, t, slot=i) for i, t in enumerate(tables)])
    params = [GREEDY] * batch
    toks = [1] * batch
    pos = args.prompt_tokens
    n = min(steps, args.max_tokens)
    t0 = time.perf_counter()
    for s in range(n):
        batch_chunks = [SeqChunk([toks[i]], pos + s, t, slot=i) for i, t in enumerate(tables)]
        toks = sample(runner.forward(batch_chunks), params, [s] * batch).tolist()
    return batch * n / (time.perf_counter() - t0)


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
        cols += [("runner_tok_s", "runner tok/s", "{:.1f}"), ("ratio", "server/runner", "{:.2f}")]
    print("| " + " | ".join(h for _, h, _ in cols) + " |")
    print("|" + "|".join(" ---: " for _ in cols) + "|")
    for row in rows:
        print("| " + " | ".join(f.format(row[k]) for k, _, f in cols) + " |")
