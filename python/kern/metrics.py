"""Server metrics in the Prometheus text format.

Design notes
------------
* Plain ints and lists, written by the scheduler thread only and read by ``/metrics``: a torn
  read of one counter is impossible under the GIL, and a scrape that sees step N's running
  count beside step N+1's hit count is fine for monitoring. No lock on the hot path.
* Cache counters are counted from what ``make_room`` and ``wake`` return (``Evicted.Parked`` and
  ``dropped``, ``Evicted.Dropped(parked)``), as the pool's contract asks, never inferred.
* Pool gauges are a copy of ``Cache.stats()`` the scheduler takes after every step (the cache
  is not shared across threads: PyO3 refuses a second borrow), so they are exact after the last
  request ends: ``kern_pool_pages_held`` (pages requests hold, neither free nor
  cached) is back at 0 then, and ``kern_pool_pages_free + kern_pool_pages_cached`` at the total
  (on a stateful model, less the chunks the slots took for the cache's state snapshots,
  ``kern_pool_slots_cached``).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

__all__ = ["Histogram", "Metrics"]

# Seconds. TTFT spans queueing and prefill; TPOT one decode step of a batch.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self, name: str, help_: str) -> list[str]:
        lines = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        running = 0
        for bound, n in zip(self.buckets, self.counts, strict=False):
            running += n
            lines.append(f'{name}_bucket{{le="{bound}"}} {running}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {self.total}")
        lines.append(f"{name}_count {self.count}")
        return lines


class Metrics:
    def __init__(self) -> None:
        self.num_prompt_tokens = 0
        self.num_hit_tokens = 0
        self.num_generated = 0
        self.num_parked = 0
        self.num_dropped_resident = 0
        self.num_dropped_parked = 0
        self.num_woken = 0
        self.num_aborted = 0
        self.num_preempted = 0
        self.num_running = 0
        self.num_waiting = 0
        self.ttft = Histogram(_TTFT_BUCKETS)
        self.tpot = Histogram(_TPOT_BUCKETS)
        # Pool gauges, name -> value, replaced whole by the scheduler after each step.
        self.pool: dict[str, int] = {}

    def render(self) -> str:
        counters = [
            ("kern_prompt_tokens_total", self.num_prompt_tokens, "prompt tokens admitted"),
            ("kern_prefix_hit_tokens_total", self.num_hit_tokens, "prompt tokens from the cache"),
            ("kern_generation_tokens_total", self.num_generated, "tokens generated"),
            ("kern_parked_total", self.num_parked, "cache entries parked to host memory"),
            (
                "kern_dropped_resident_total",
                self.num_dropped_resident,
                "cache entries dropped from the device",
            ),
            (
                "kern_dropped_parked_total",
                self.num_dropped_parked,
                "cache entries dropped from host memory",
            ),
            ("kern_woken_total", self.num_woken, "cache entries woken from host memory"),
            ("kern_aborted_total", self.num_aborted, "requests aborted (hang-ups included)"),
            ("kern_preempted_total", self.num_preempted, "running requests preempted"),
        ]
        lines: list[str] = []
        for name, value, help_ in counters:
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {value}"]
        gauges = {"kern_running": self.num_running, "kern_waiting": self.num_waiting}
        gauges.update(self.pool)
        for name, value in gauges.items():
            lines += [f"# TYPE {name} gauge", f"{name} {value}"]
        lines += self.ttft.render("kern_time_to_first_token_seconds", "time to first token")
        lines += self.tpot.render("kern_time_per_output_token_seconds", "time per output token")
        return "\n".join(lines) + "\n"
