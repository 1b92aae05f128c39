"""Benchmark the prefix cache on a multi-turn agent trace: kern's tree (``kern.pool.Cache``)
against a fast pure-Python radix tree with the same semantics (``kern.bench.pytree``), in one
run, at page sizes 1 and 16.

    python -m kern.bench.prefix [--requests 2000,20000] [--page-tokens 1,16] [--runs 3]

The trace (seeded): 8 system prompts of 1,536-2,560 tokens, picked with weight 1/(k+1);
conversations of 4-16 turns, each turn adding 50-500 user tokens to the prompt and 50-300
answer tokens after it (the next turn's prompt is the last prompt + answer + new text); an
eighth of the conversations (at least 16) open at once, a finished one replaced by a new one;
at most 8 requests in flight, started and finished in a seeded random interleaving, so a
request holds its lock and its pages while others run. The device holds 20% of the distinct
tokens (or, if more, what the requests in flight can hold at once).

Each request is replayed as kern's scheduler drives the cache. At its start: ``match`` the
prompt (locked), then ``take_pages`` for the rest of the prompt (make room and allocate, one
call). At its end: ``take_pages`` for the answer, then ``release``: insert the whole pages of
prompt + answer (duplicates freed by the tree), free the partial last page and unlock, one
call. The Python tree does the same combined operations with its own free list. Both start
from the same page capacity and must report the same hit length for every request and the
same number of evictions: the run fails otherwise.

Timings are the cache calls of each request (building keys from the trace is not counted), one
implementation after the other, ``--runs`` times each (alternating) at the largest size and
proportionally more often at smaller ones (up to 10x), so every size replays about as many
requests: a 2,000-request replay lasts 15-50 ms, and one scheduler hiccup on a shared machine
would move a median of three. Each of the ``--runs`` rounds replays every size and page size,
so the sizes whose per-request costs are compared are measured in the same minutes. Medians
reported. Pin the process to one core (``taskset -c 1``) on a shared machine.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from kern.arith import cdiv
from kern.bench import pytree
from kern.pool import Cache, Evicted

VOCAB = 150_000
PAGE_BYTES = 64  # any size: only page counts matter to the books
IN_FLIGHT = 8
START, FINISH = 0, 1


@dataclass
class Trace:
    sessions: list[np.ndarray]  # each conversation's tokens, whole (uint32)
    req_session: list[int]
    req_prompt: list[int]  # prompt length
    req_full: list[int]  # prompt + answer length
    ops: list[tuple[int, int]]  # (START or FINISH, request)
    distinct: int  # distinct tokens (templates used + every turn's text)
    peak_tokens: int  # the most tokens the requests in flight hold at once
    session_template: list[int]  # each conversation's system prompt
    template_len: list[int]  # each system prompt's length


def make_trace(num_requests: int, seed: int) -> Trace:
    rng = np.random.default_rng(seed)
    templates = [
        rng.integers(0, VOCAB, int(rng.integers(1536, 2561)), dtype=np.uint32) for _ in range(8)
    ]
    weights = 1.0 / np.arange(1, 9)
    weights /= weights.sum()
    sessions: list[np.ndarray] = []
    session_template: list[int] = []
    turns: list[list[tuple[int, int]]] = []  # per session: (prompt_len, full_len) per turn
    used: set[int] = set()
    distinct = 0

    def new_session() -> int:
        nonlocal distinct
        k = int(rng.choice(8, p=weights))
        if k not in used:
            used.add(k)
            distinct += len(templates[k])
        n = int(rng.integers(4, 17))
        users = rng.integers(50, 501, n)
        answers = rng.integers(50, 301, n)
        tail = rng.integers(0, VOCAB, int(users.sum() + answers.sum()), dtype=np.uint32)
        distinct += len(tail)
        length, spans = len(templates[k]), []
        for u, a in zip(users.tolist(), answers.tolist(), strict=True):
            spans.append((length + u, length + u + a))
            length += u + a
        sessions.append(np.concatenate([templates[k], tail]))
        session_template.append(k)
        turns.append(spans)
        return len(sessions) - 1

    num_open = max(16, -(-num_requests // 10 // 8))  # ~10 turns a conversation: an eighth open
    open_ = [new_session() for _ in range(num_open)]
    next_turn = {s: 0 for s in open_}
    busy: set[int] = set()
    flight: list[int] = []
    t = Trace(sessions, [], [], [], [], 0, 0, session_template, [len(x) for x in templates])
    held = peak = 0
    while len(t.req_session) < num_requests or flight:
        idle = [s for s in open_ if s not in busy]
        can_start = len(t.req_session) < num_requests and len(flight) < IN_FLIGHT and idle
        if can_start and (not flight or rng.random() < 0.5):
            s = idle[int(rng.integers(len(idle)))]
            prompt, full = turns[s][next_turn[s]]
            r = len(t.req_session)
            t.req_session.append(s)
            t.req_prompt.append(prompt)
            t.req_full.append(full)
            t.ops.append((START, r))
            busy.add(s)
            flight.append(r)
            held += full
            peak = max(peak, held)
        else:
            r = flight.pop(int(rng.integers(len(flight))))
            t.ops.append((FINISH, r))
            s = t.req_session[r]
            busy.discard(s)
            held -= t.req_full[r]
            next_turn[s] += 1
            if next_turn[s] == len(turns[s]):
                open_[open_.index(s)] = fresh = new_session()
                next_turn[fresh] = 0
    t.distinct = distinct
    t.peak_tokens = peak
    return t


@dataclass
class Run:
    name: str
    seconds: float = 0.0
    hits: list[int] = field(default_factory=list)
    match_us: list[float] = field(default_factory=list)
    release_us: list[float] = field(default_factory=list)
    take_us: list[float] = field(default_factory=list)
    evicted: int = 0
    nodes: int = 0


def _dropped(evicted: list[Evicted]) -> int:
    """Resident entries dropped: evictions are counted from the returned values alone."""
    return sum(isinstance(e, Evicted.Dropped) and not e.parked for e in evicted)


def replay_kern(t: Trace, pt: int, budget: int) -> Run:
    cache = Cache(page_tokens=pt, page_bytes=PAGE_BYTES, device_bytes=budget)
    clock = time.perf_counter_ns
    run = Run("kern")
    hits = [0] * len(t.req_session)
    state: dict[int, tuple] = {}
    match_ns, release_ns, take_ns = [], [], []
    busy = dropped = 0
    for kind, r in t.ops:
        tokens = t.sessions[t.req_session[r]]
        if kind == START:
            # A fresh array, as a scheduler builds one (and as the Python tree gets fresh
            # bytes): a view into the session's tokens would be cold in cache.
            prompt = tokens[: t.req_prompt[r]].copy()
            t0 = clock()
            m = cache.match(prompt)
            t1 = clock()
            need = cdiv(len(prompt), pt) - m.hit_len // pt
            own, room = cache.take_pages(need)
            block = m.pages + own
            t2 = clock()
            match_ns.append(t1 - t0)
            if room.evicted:
                take_ns.append(t2 - t1)
                dropped += _dropped(room.evicted)
            busy += t2 - t0
            hits[r] = m.hit_len
            state[r] = (m.node, block)
        else:
            node, block = state.pop(r)
            full_len = t.req_full[r]
            whole = full_len // pt * 4
            key = tokens[: full_len // pt * pt].copy()
            t0 = clock()
            need = cdiv(full_len, pt) - len(block) // 4
            own, room = cache.take_pages(need)
            block += own
            t1 = clock()
            cache.release(key, block[:whole], node=node, free=block[whole:])
            t2 = clock()
            if room.evicted:
                take_ns.append(t1 - t0)
                dropped += _dropped(room.evicted)
            release_ns.append(t2 - t1)
            busy += t2 - t0
    cache.check_integrity()
    s = cache.stats()
    assert s.pages_used == s.resident_pages, "pages left outside the tree"
    run.seconds = busy / 1e9
    run.hits = hits
    run.match_us = [x / 1e3 for x in match_ns]
    run.release_us = [x / 1e3 for x in release_ns]
    run.take_us = [x / 1e3 for x in take_ns]
    run.evicted = dropped
    run.nodes = s.num_nodes
    return run


def replay_python(t: Trace, pt: int, budget: int) -> Run:
    num_pages = Cache(page_tokens=pt, page_bytes=PAGE_BYTES, device_bytes=budget).device.num_pages
    tree = pytree.Tree(pt, num_pages)
    clock = time.perf_counter_ns
    run = Run("python")
    hits = [0] * len(t.req_session)
    state: dict[int, tuple] = {}
    match_ns, release_ns, take_ns = [], [], []
    busy = 0
    keys = [s.tobytes() for s in t.sessions]  # the key bytes are built once, untimed
    for kind, r in t.ops:
        tokens = keys[t.req_session[r]]
        if kind == START:
            prompt = tokens[: 4 * t.req_prompt[r]]
            t0 = clock()
            m = tree.match(prompt)
            t1 = clock()
            need = cdiv(len(prompt), (4 * pt)) - m.hit_len // pt
            own, evicted = tree.take_pages(need)
            block = m.pages + own
            t2 = clock()
            match_ns.append(t1 - t0)
            if evicted:
                take_ns.append(t2 - t1)
            busy += t2 - t0
            hits[r] = m.hit_len
            state[r] = (m.node, m.hit_len, block)
        else:
            node, hit, block = state.pop(r)
            full_len = t.req_full[r]
            whole = full_len // pt
            key = tokens[: 4 * whole * pt]
            t0 = clock()
            need = cdiv(full_len, pt) - len(block)
            own, evicted = tree.take_pages(need)
            block += own
            t1 = clock()
            tree.release(key, block[:whole], hit, node, block[whole:])
            t2 = clock()
            if evicted:
                take_ns.append(t1 - t0)
            release_ns.append(t2 - t1)
            busy += t2 - t0
    assert len(tree.free) + tree.cached_pages == num_pages, "pages lost"
    run.seconds = busy / 1e9
    run.hits = hits
    run.match_us = [x / 1e3 for x in match_ns]
    run.release_us = [x / 1e3 for x in release_ns]
    run.take_us = [x / 1e3 for x in take_ns]
    run.evicted = tree.num_evicted
    run.nodes = tree.num_nodes
    return run


def export(directory: str, t: Trace, n: int, pt: int, hits: list[int], write_trace: bool) -> None:
    """Write the trace and kern's hit lengths for the floor model
    (``cargo run --release --example floor -- DIR`` in rust/kern_pool): little-endian, see
    examples/floor.rs for the layout."""
    if write_trace:
        offsets = np.cumsum([0] + [len(x) for x in t.sessions], dtype=np.uint64)
        tl = [t.template_len[k] for k in t.session_template]
        ops = [(kind, t.req_session[r], t.req_prompt[r], t.req_full[r]) for kind, r in t.ops]
        head = [len(t.sessions), len(t.ops)]
        with open(os.path.join(directory, f"trace_{n}.bin"), "wb") as f:
            f.write(b"KERNTRC1")
            f.write(np.asarray(head, "<u8").tobytes())
            f.write(offsets.astype("<u8").tobytes())
            f.write(np.asarray(t.session_template, "<u8").tobytes())
            f.write(np.asarray(tl, "<u8").tobytes())
            f.write(np.asarray(ops, "<u8").tobytes())
            f.write(np.concatenate(t.sessions).astype("<u4").tobytes())
    np.asarray(hits, "<u8").tofile(os.path.join(directory, f"hits_{n}_p{pt}.bin"))


def stat(xs: list[float]) -> str:
    if not xs:
        return "-"
    a = np.asarray(xs)
    return f"{a.mean():.1f} / {np.percentile(a, 99):.1f}"


def digest(hits: list[int]) -> str:
    return hashlib.sha256(np.asarray(hits, np.int64).tobytes()).hexdigest()[:12]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", default="2000,20000", help="comma-separated request counts")
    ap.add_argument("--page-tokens", default="1,16", help="comma-separated page sizes")
    ap.add_argument(
        "--runs",
        type=int,
        default=3,
        help="runs of each tree, alternating, at the largest size (more at smaller sizes)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--export",
        metavar="DIR",
        help="also write each trace and kern's hit lengths to DIR for the floor model "
        "(cargo run --release --example floor -- DIR, in rust/kern_pool)",
    )
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.requests.split(",")]
    pts = [int(x) for x in args.page_tokens.split(",")]
    if args.runs < 1 or min(sizes) < 1 or min(pts) < 1:
        ap.error("--runs, --requests and --page-tokens must be positive")
    if args.export:
        try:
            os.makedirs(args.export, exist_ok=True)
        except OSError as e:
            ap.error(f"--export {args.export}: {e.strerror or e}")
    rows = []
    per_request: dict[tuple[int, int, str], float] = {}
    # Every size and page size is replayed in each round, so the per-request cost at one size
    # is compared with the other's measured in the same minutes, not after them: the load of a
    # shared machine drifts between the two.
    traces = {n: make_trace(n, args.seed) for n in sizes}
    cases = []  # (requests, page, device bytes, replays per round)
    for n in sizes:
        t = traces[n]
        for pt in pts:
            want = max(int(0.2 * t.distinct) // pt, cdiv(int(1.05 * t.peak_tokens), pt) + 1)
            cases.append((n, pt, want * PAGE_BYTES, min(10, max(1, max(sizes) // n))))
    runs: dict[tuple[int, int, str], list[Run]] = {}
    for _ in range(args.runs):
        for n, pt, budget, reps in cases:
            for _ in range(reps):
                for name, replay in (("kern", replay_kern), ("python", replay_python)):
                    gc.collect()
                    runs.setdefault((n, pt, name), []).append(replay(traces[n], pt, budget))
    for n, pt, budget, reps in cases:
        t = traces[n]
        prompt_tokens = sum(t.req_prompt)
        num_pages = Cache(
            page_tokens=pt, page_bytes=PAGE_BYTES, device_bytes=budget
        ).device.num_pages
        k = runs[(n, pt, "kern")][0]
        if args.export:
            export(args.export, t, n, pt, k.hits, write_trace=pt == pts[0])
        for r in runs[(n, pt, "kern")] + runs[(n, pt, "python")]:
            if r.hits != k.hits or r.evicted != k.evicted:
                raise SystemExit(
                    f"{n} requests, page {pt}: {r.name} differs: hits {digest(r.hits)} vs "
                    f"{digest(k.hits)}, evictions {r.evicted} vs {k.evicted}"
                )
        print(
            f"{n} requests, page {pt}: {t.distinct:,} distinct tokens, {num_pages:,} pages; "
            f"{args.runs * reps} runs each; "
            f"identical hits (sha256 {digest(k.hits)}) and evictions ({k.evicted:,})",
            flush=True,
        )
        for name in ("kern", "python"):
            rs = runs[(n, pt, name)]
            secs = statistics.median(r.seconds for r in rs)
            per_request[(n, pt, name)] = secs / n
            mid = sorted(rs, key=lambda r: r.seconds)[len(rs) // 2]
            rows.append((n, pt, name, n / secs, mid, sum(mid.hits) / prompt_tokens))
    header = (
        "requests",
        "page",
        "tree",
        "req/s",
        "match us (mean / p99)",
        "release us (mean / p99)",
        "evicting take_pages us (mean / p99)",
        "hit rate",
        "evictions",
        "nodes",
    )
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for n, pt, name, rps, r, hit_rate in rows:
        cells = [
            f"{n:,}",
            str(pt),
            name,
            f"{rps:,.0f}",
            stat(r.match_us),
            stat(r.release_us),
            stat(r.take_us),
            f"{hit_rate:.4f}",
            f"{r.evicted:,}",
            f"{r.nodes:,}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    print()
    print("\n".join(lines))
    print()
    for n in sizes:
        for pt in pts:
            ratio = per_request[(n, pt, "python")] / per_request[(n, pt, "kern")]
            print(f"{n:,} requests, page {pt}: kern is {ratio:.1f}x the Python tree's requests/s")
    if len(sizes) >= 2:
        lo, hi = sizes[0], sizes[-1]
        for pt in pts:
            growth = per_request[(hi, pt, "kern")] / per_request[(lo, pt, "kern")]
            print(
                f"page {pt}: kern's per-request cost at {hi:,} / at {lo:,} requests: {growth:.2f}x"
            )


if __name__ == "__main__":
    main()
