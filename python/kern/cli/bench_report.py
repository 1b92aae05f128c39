"""``kern bench``'s summary: one request's timings, a level's row of them, and the two ways it
is printed (``vllm bench serve``'s blocks and one markdown table).

Design notes
------------
* The latencies are ``vllm bench serve``'s, measured at the client: TTFT from sending to the
  first token; TPOT the mean gap after the first token, per request; ITL every gap between
  two streamed events (one token each; events that arrive in one write have gaps near 0, as a
  client sees them); E2EL sending to the last byte. Each is reported as mean, median and p99
  (numpy's linear percentile), in ms; None (printed "-") without values, as JSON has no NaN.
* A failed request counts in ``failed`` with its error, and in no latency.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Result", "level_row", "print_block", "print_table"]


@dataclass
class Result:
    """One request: its timings in seconds and token counts, or its error."""

    ok: bool
    error: str | None = None
    ttft: float = 0.0
    tpot: float | None = None
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


def _stats(values: list[float], name: str) -> dict[str, float | None]:
    """mean, median and p99 in ms (None without values: JSON has no NaN)."""
    import numpy as np

    if not values:
        return {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"p99_{name}_ms": None}
    a = np.asarray(values) * 1e3
    return {
        f"mean_{name}_ms": float(a.mean()),
        f"median_{name}_ms": float(np.median(a)),
        f"p99_{name}_ms": float(np.percentile(a, 99)),
    }


def level_row(level: int, results: list[Result], wall: float) -> dict:
    """A level's row (the objects ``--json`` prints) from its results over ``wall`` seconds."""
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "?"] = errors.get(r.error or "?", 0) + 1
    return {
        "concurrency": level,
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": errors,
        "duration_s": wall,
        "input_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": sum(r.tokens for r in ok),
        "req_s": len(ok) / wall,
        "output_tok_s": sum(r.tokens for r in ok) / wall,
        **_stats([r.ttft for r in ok], "ttft"),
        **_stats([r.tpot for r in ok if r.tpot is not None], "tpot"),
        **_stats([g for r in ok for g in r.itl], "itl"),
        **_stats([r.e2el for r in ok], "e2el"),
        "cached_ratio": sum(r.cached_tokens for r in ok) / max(1, sum(r.prompt_tokens for r in ok)),
    }


def print_block(row: dict) -> None:
    """One level's summary, laid out as ``vllm bench serve`` prints it."""
    w = 50
    print(f" Concurrency {row['concurrency']} ".center(w, "="))
    lines = [
        ("Successful requests:", f"{row['completed']}"),
        ("Failed requests:", f"{row['failed']}"),
        ("Benchmark duration (s):", f"{row['duration_s']:.2f}"),
        ("Total input tokens:", f"{row['input_tokens']}"),
        ("Total generated tokens:", f"{row['output_tokens']}"),
        ("Request throughput (req/s):", f"{row['req_s']:.2f}"),
        ("Output token throughput (tok/s):", f"{row['output_tok_s']:.2f}"),
        ("Prompt tokens from the cache:", f"{row['cached_ratio']:.2%}"),
        ("Draft tokens (accepted):", f"{row['draft_tokens']:.0f} ({row['accepted_tokens']:.0f})"),
        ("Draft acceptance rate:", _fmt("{:.2%}", row["acceptance"])),
    ]
    for label, value in lines:
        print(f"{label:<40}{value:>10}")
    for error, count in row["errors"].items():
        print(f"  failed x{count}: {error}")
    for key, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        print(title.center(w, "-"))
        name = key.upper()
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            print(f"{f'{label} {name} (ms):':<40}{_fmt('{:.2f}', row[f'{stat}_{key}_ms']):>10}")
    print("=" * w)


def print_table(rows: list[dict]) -> None:
    cols = [
        ("concurrency", "conc", "{:d}"),
        ("completed", "ok", "{:d}"),
        ("failed", "failed", "{:d}"),
        ("req_s", "req/s", "{:.2f}"),
        ("output_tok_s", "out tok/s", "{:.1f}"),
        ("median_ttft_ms", "TTFT p50 ms", "{:.1f}"),
        ("p99_ttft_ms", "TTFT p99 ms", "{:.1f}"),
        ("median_tpot_ms", "TPOT p50 ms", "{:.2f}"),
        ("p99_itl_ms", "ITL p99 ms", "{:.2f}"),
        ("median_e2el_ms", "E2EL p50 ms", "{:.1f}"),
        ("cached_ratio", "cached", "{:.2f}"),
        ("acceptance", "accept", "{:.2f}"),
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
        print("| " + " | ".join(_fmt(f, row[k]) for k, _, f in cols) + " |")


def _fmt(spec: str, value: float | None) -> str:
    return "-" if value is None else spec.format(value)
