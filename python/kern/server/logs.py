"""The server's log: one line per finished request, a stats line while busy, and the handler
``kern serve`` installs (``--log-level``).

Design notes
------------
* Everything goes through the ``kern`` logger, to stderr, one line per record. A request line
  names the request id (``X-Request-Id``), the route, the status, the prompt / cached /
  output tokens, the finish reasons, TTFT and total time. The prompt's text only with
  ``--log-prompts``: prompts are users' data and logs travel further than they should.
* A client's ``X-Request-Id`` is kept only if it is 1 to 128 visible ASCII characters: it is
  echoed into a response header and a log line, where a newline or a control character would
  forge either.
* The stats line reads the app's metrics (the same numbers ``/metrics`` serves) every
  ``--stats-interval`` seconds and is skipped when nothing ran since the last one.
* Generation routes log at INFO; the others (``/health``, ``/metrics``, ...) at DEBUG, so a
  scraper does not fill the log. Server errors (5xx) log at ERROR.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kern.server.request_context import RECORD

if TYPE_CHECKING:
    from kern.metrics import Metrics
    from kern.server.responses import Run

__all__ = ["LEVELS", "RECORD", "RequestRecord", "StatsLine", "configure", "request_id"]

log = logging.getLogger("kern")

LEVELS = ("debug", "info", "warning", "error")
_MAX_ID_LEN = 128


def configure(level: str) -> None:
    """Send the ``kern`` logger to stderr at ``level`` (one of :data:`LEVELS`)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S")
    )
    log.handlers[:] = [handler]
    log.setLevel(level.upper())
    log.propagate = False


def request_id(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The client's ``X-Request-Id`` if it is safe to echo, else a new one."""
    for k, v in headers:
        if k == b"x-request-id":
            if 0 < len(v) <= _MAX_ID_LEN and all(0x21 <= b <= 0x7E for b in v):
                return v.decode("ascii")
            break
    return uuid.uuid4().hex


@dataclass
class RequestRecord:
    """What one HTTP request's log line says; the app fills it as the request goes."""

    id: str
    method: str
    path: str
    t0: float = field(default_factory=time.perf_counter)
    status: int | None = None
    error: str | None = None
    # The run of a generation request: its sequences and choices; None for other routes.
    run: Run | None = None
    prompt: str | None = None

    def log(self) -> None:
        total = time.perf_counter() - self.t0
        parts = [f"{self.id} {self.method} {self.path} {self.status}"]
        run = self.run
        if run is not None:
            reqs = run.reqs
            firsts = [r.t_first - r.t_submit for r in reqs if r.num_output]
            finish = ",".join(c.finish or "-" for c in run.choices)
            usage = run.usage()
            parts.append(
                f"prompt={usage.prompt_tokens} "
                f"cached={usage.prompt_tokens_details.cached_tokens} "
                f"output={sum(len(c.ids) for c in run.choices)} finish={finish} "
                f"ttft={f'{min(firsts):.3f}s' if firsts else '-'}"
            )
        parts.append(f"total={total:.3f}s")
        if self.error is not None:
            parts.append(f"error={self.error!r}")
        if self.prompt is not None:
            parts.append(f"prompt_text={self.prompt!r}")
        if self.status is not None and self.status >= 500:
            level = logging.ERROR
        elif run is not None or (self.path.startswith("/v1/") and self.method == "POST"):
            level = logging.INFO
        else:
            level = logging.DEBUG
        log.log(level, "%s", " ".join(parts))


class StatsLine:
    """Every ``interval`` seconds while there is work, one line from the app's metrics."""

    def __init__(self, metrics: Metrics, interval: float) -> None:
        self.metrics = metrics
        self.interval = interval

    def _totals(self) -> tuple[float, ...]:
        v = self.metrics.value
        return (
            v("kern_prompt_tokens_total"),
            v("kern_generation_tokens_total"),
            v("kern_prefix_cache_queries_total"),
            v("kern_prefix_cache_hits_total"),
        )

    def line(self, before: tuple[float, ...], after: tuple[float, ...], seconds: float) -> str:
        prompt, gen, queries, hits = (a - b for a, b in zip(after, before, strict=True))
        g = self.metrics.gauges
        hit_rate = f"{100 * hits / queries:.1f}%" if queries else "-"
        return (
            f"running={g['kern_num_requests_running']} "
            f"waiting={g['kern_num_requests_waiting']} "
            f"prompt={prompt / seconds:.1f} tok/s generation={gen / seconds:.1f} tok/s "
            f"kv_usage={100 * g['kern_kv_cache_usage_perc']:.1f}% prefix_hit_rate={hit_rate}"
        )

    async def run(self) -> None:
        before, t_before = self._totals(), time.monotonic()
        while True:
            await asyncio.sleep(self.interval)
            after, t_after = self._totals(), time.monotonic()
            g = self.metrics.gauges
            busy = g["kern_num_requests_running"] or g["kern_num_requests_waiting"]
            if busy or after != before:
                log.info("stats %s", self.line(before, after, t_after - t_before))
            before, t_before = after, t_after
