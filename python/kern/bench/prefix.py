"""Benchmark the prefix cache on a multi-turn agent trace: the Rust tree (``kern.pool.Cache``)
against the pure-Python baseline (``kern.bench.pytree``) with the same semantics.

    python -m kern.bench.prefix [--requests 2000,20000] [--seed 0]

The trace: conversations that share a few ~2k-token system prompts; each turn appends 50-500
user tokens and 50-300 answer tokens, so turn t+1's prompt is turn t's prompt + answer + new
text; a few dozen conversations interleave. The device budget holds about 20% of the distinct
tokens and the host tier another 40%, so the replay evicts and parks. Each request is replayed
as a scheduler would: match -> lock -> wake a parked hit -> make room and allocate the rest ->
insert -> free duplicates -> unlock. Both trees must report the same token hit rate.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np

from kern.bench.pytree import PoolFull as PyPoolFull
from kern.bench.pytree import PyCache
from kern.pool import Cache, PoolFull

PAGE_TOKENS = 16
PAGE_BYTES = 1 << 16  # any size: only page counts matter to the books
VOCAB = 150_000


@dataclass
class Request:
    prompt: np.ndarray  # uint32
    full: np.ndarray  # prompt + answer, what the request inserts at its end


def trace(num_requests: int, seed: int) -> tuple[list[Request], int]:
    """The seeded workload and its number of distinct tokens."""
    rng = np.random.default_rng(seed)
    systems = [
        rng.integers(0, VOCAB, int(rng.integers(1900, 2100)), dtype=np.uint32) for _ in range(8)
    ]
    distinct = sum(len(s) for s in systems)

    def new_conversation():
        return {
            "history": systems[int(rng.integers(len(systems)))],
            "turns": int(rng.integers(2, 13)),
        }

    active = [new_conversation() for _ in range(32)]
    out = []
    for _ in range(num_requests):
        i = int(rng.integers(len(active)))
        conv = active[i]
        user = rng.integers(0, VOCAB, int(rng.integers(50, 501)), dtype=np.uint32)
        answer = rng.integers(0, VOCAB, int(rng.integers(50, 301)), dtype=np.uint32)
        prompt = np.concatenate([conv["history"], user])
        full = np.concatenate([prompt, answer])
        distinct += len(user) + len(answer)
        out.append(Request(prompt, full))
        conv["history"], conv["turns"] = full, conv["turns"] - 1
        if conv["turns"] == 0:
            active[i] = new_conversation()
    return out, distinct


@dataclass
class Result:
    name: str
    seconds: float
    hit_tokens: int
    prompt_tokens: int
    match_us: list[float]
    insert_us: list[float]
    evict_us: list[float]
    parked: int
    dropped_resident: int
    dropped_parked: int
    woken: int


def replay(cache, requests, *, page_unit: int, as_tokens, pool_full) -> tuple[float, dict]:
    """Replay the trace through `cache`. `page_unit` is how many elements one page id takes in
    the page lists the cache returns (4 bytes for the Rust cache's bytes, 1 for lists)."""
    pt = PAGE_TOKENS
    clock = time.perf_counter_ns
    match_ns, insert_ns, evict_ns = [], [], []
    hit_tokens = prompt_tokens = 0
    busy = 0  # time inside the replay, without the per-request key conversion
    for r in requests:
        prompt, full = as_tokens(r.prompt), as_tokens(r.full)
        start = clock()
        t0 = clock()
        m = cache.match(prompt)
        match_ns.append(clock() - t0)
        if m.node is not None:
            cache.lock(m.node)
        if m.resident_len < m.hit_len:
            for _ in range(2):
                try:
                    cache.wake(m.node)
                    break
                except pool_full:
                    t0 = clock()
                    if cache.make_room(-(-m.hit_len // pt)):
                        evict_ns.append(clock() - t0)
            m = cache.match(prompt)
        hit = m.resident_len
        shared = hit // pt
        need = -(-len(full) // pt) - shared
        t0 = clock()
        if cache.make_room(need):
            evict_ns.append(clock() - t0)
        try:
            fresh = cache.alloc_pages(need)
        except pool_full:
            fresh = None
        if fresh is not None:
            pages = m.pages[: shared * page_unit] + fresh
            t0 = clock()
            dups = cache.insert(full, pages)
            insert_ns.append(clock() - t0)
            cache.free(dups)
        if m.node is not None:
            cache.unlock(m.node)
        hit_tokens += hit
        prompt_tokens += len(prompt)
        busy += clock() - start
    seconds = busy / 1e9
    return seconds, dict(
        hit_tokens=hit_tokens,
        prompt_tokens=prompt_tokens,
        match_us=[x / 1e3 for x in match_ns],
        insert_us=[x / 1e3 for x in insert_ns],
        evict_us=[x / 1e3 for x in evict_ns],
    )


class RustAdapter:
    """kern.pool.Cache with the replay's verbs: one crossing per operation."""

    def __init__(self, cache: Cache):
        self.c = cache
        self.match, self.lock, self.unlock = cache.match, cache.lock, cache.unlock
        self.wake, self.alloc_pages, self.make_room = cache.wake, cache.alloc_pages, cache.make_room

    def insert(self, tokens, pages):
        return self.c.insert(tokens, pages).duplicates

    def free(self, pages):
        if pages:
            self.c.free_pages(pages)


def run_rust(requests, device_pages, host_pages) -> tuple[Result, Cache]:
    cache = Cache(
        page_tokens=PAGE_TOKENS,
        page_bytes=PAGE_BYTES,
        device_bytes=device_pages * PAGE_BYTES,
        host_bytes=host_pages * PAGE_BYTES,
    )
    seconds, r = replay(
        RustAdapter(cache), requests, page_unit=4, as_tokens=lambda a: a, pool_full=PoolFull
    )
    cache.check_integrity()
    s = cache.stats()
    res = Result(
        "rust",
        seconds,
        parked=s.num_parked,
        dropped_resident=s.num_dropped_resident,
        dropped_parked=s.num_dropped_parked,
        woken=s.num_woken,
        **r,
    )
    return res, cache


def run_python(requests, device_pages, host_pages) -> Result:
    cache = PyCache(PAGE_TOKENS, device_pages, host_pages)
    seconds, r = replay(
        cache, requests, page_unit=1, as_tokens=lambda a: a.tolist(), pool_full=PyPoolFull
    )
    return Result(
        "python",
        seconds,
        parked=cache.num_parked,
        dropped_resident=cache.num_dropped_resident,
        dropped_parked=cache.num_dropped_parked,
        woken=cache.num_woken,
        **r,
    )


def stat(xs: list[float]) -> str:
    if not xs:
        return "-"
    a = np.asarray(xs)
    return f"{a.mean():.1f} / {np.percentile(a, 99):.1f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", default="2000,20000", help="comma-separated request counts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-python", action="store_true", help="time only the Rust tree")
    args = ap.parse_args(argv)
    rows, per_request = [], {}
    for n in [int(x) for x in args.requests.split(",")]:
        requests, distinct = trace(n, args.seed)
        device_budget = int(0.2 * distinct) // PAGE_TOKENS
        host_budget = int(0.4 * distinct) // PAGE_TOKENS
        rust, cache = run_rust(requests, device_budget, host_budget)
        # The Python tree gets exactly the capacities the chunked pools ended up with.
        s = cache.stats()
        device_pages, host_pages = (
            s.pages_used + s.pages_free,
            s.host_pages_free + s.host_pages_used,
        )
        results = [rust]
        if not args.skip_python:
            results.append(run_python(requests, device_pages, host_pages))
        print(
            f"\n{n} requests: {distinct} distinct tokens, device {device_pages} pages, "
            f"host {host_pages} pages of {PAGE_TOKENS} tokens"
        )
        for r in results:
            rows.append((n, r))
            per_request[(n, r.name)] = r.seconds / n
        if len(results) == 2:
            a, b = results
            if abs(a.hit_tokens - b.hit_tokens) != 0:
                raise SystemExit(
                    f"hit rates differ: rust {a.hit_tokens} vs python {b.hit_tokens} tokens"
                )
    header = (
        "requests",
        "tree",
        "req/s",
        "match us (mean / p99)",
        "insert us (mean / p99)",
        "evict us (mean / p99)",
        "hit rate",
        "parked",
        "dropped res/parked",
        "woken",
    )
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for n, r in rows:
        lines.append(
            "| "
            + " | ".join(
                [
                    str(n),
                    r.name,
                    f"{n / r.seconds:,.0f}",
                    stat(r.match_us),
                    stat(r.insert_us),
                    stat(r.evict_us),
                    f"{r.hit_tokens / r.prompt_tokens:.4f}",
                    str(r.parked),
                    f"{r.dropped_resident}/{r.dropped_parked}",
                    str(r.woken),
                ]
            )
            + " |"
        )
    print()
    print("\n".join(lines))
    sizes = sorted({n for n, _ in rows})
    print()
    for n in sizes:
        if (n, "python") in per_request:
            print(
                f"{n} requests: rust is "
                f"{per_request[(n, 'python')] / per_request[(n, 'rust')]:.1f}x "
                "the pure-Python tree's requests/s"
            )
    if len(sizes) >= 2:
        lo, hi = sizes[0], sizes[-1]
        print(
            f"rust per-request cost at {hi} / at {lo} requests: "
            f"{per_request[(hi, 'rust')] / per_request[(lo, 'rust')]:.2f}x"
        )


if __name__ == "__main__":
    main()
