"""``kern serve``'s answer to SIGTERM and SIGINT (:class:`Drain`): a drain that loses nothing
in flight, bounded by ``--shutdown-timeout``.

Design notes
------------
* The first signal: from that moment every new request, ``/health`` included, gets a 503
  with ``Retry-After`` (and ``Connection: close`` on HTTP/1, so a keep-alive client goes
  elsewhere); ``/metrics`` still answers. The requests in flight run to their end. Once none
  is left the server stops at once: hypercorn closes idle keep-alive connections without
  waiting, so an idle server exits within a second of the signal.
* At the deadline, what is still generating is aborted through the scheduler: a stream gets
  its ``abort`` chunk and ``[DONE]``, a whole answer is the answer so far with
  ``finish_reason: "abort"`` (never a 503: the tokens were paid for). A request that was
  still reading its body then is aborted as it submits (the abort repeats until none is left,
  for :data:`ABORT_WAIT` seconds at most; after that what remains is shut down, as the app's
  drain does).
* A second signal aborts everything at once and stops.
* The drain is handed what it acts on, not the app: the app's :class:`Admission`, the set of
  runs in flight (``OpenAI.runs``) and the scheduler that aborts them.
* Under plain ``hypercorn kern.app:app`` none of this runs: hypercorn handles the signals,
  stops listening, gives open connections ``--graceful-timeout`` seconds (default 3) and
  then cancels them (a stream is cut without its ``abort`` chunk); the lifespan shutdown
  then drains the app. docs/serve.md says so.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

    from kern.engine.scheduler import Scheduler
    from kern.server.http import Scope
    from kern.server.responses import Run

__all__ = ["ABORT_WAIT", "RETRY_AFTER", "Admission", "Drain", "abort_all", "retry_elsewhere"]

log = logging.getLogger("kern")

# Seconds the aborted requests get to send their ends before the app's drain cuts them.
ABORT_WAIT = 5.0
# What a 503 of a draining server tells a client: retry now, elsewhere (a load balancer's
# next replica) or here once the server is back.
RETRY_AFTER = b"1"


class Admission:
    """Whether the app still admits requests (``draining`` once it stops), and the requests it
    admitted and has not answered yet: ``inflight``, and ``idle`` set when there are none. The
    app counts them (:meth:`enter`, :meth:`leave`, on the event loop); the drain waits on
    them."""

    def __init__(self) -> None:
        self.draining = False
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    def enter(self) -> None:
        self.inflight += 1
        self.idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if not self.inflight:
            self.idle.set()


def abort_all(runs: Iterable[Run], scheduler: Scheduler) -> int:
    """Abort every generation of ``runs`` through ``scheduler`` (each ends at its next step with
    ``abort``, its answer so far delivered); returns how many sequences were asked."""
    n = 0
    for run in list(runs):
        for req in run.reqs:
            if req.finish_reason is None and not req.aborted:
                scheduler.abort(req, "abort")
                n += 1
    return n


class Drain:
    """SIGTERM/SIGINT for ``kern serve``: :meth:`on_signal` on the event loop, ``stop`` set
    when hypercorn should stop. ``runs``: the generations in flight (a live set)."""

    def __init__(
        self,
        admission: Admission,
        runs: set[Run],
        scheduler: Scheduler,
        timeout: float,
        stop: asyncio.Event,
    ) -> None:
        self.admission = admission
        self.runs = runs
        self.scheduler = scheduler
        self.timeout = timeout
        self.stop = stop
        self.task: asyncio.Task[None] | None = None

    def on_signal(self, sig: signal.Signals) -> None:
        if self.stop.is_set():
            return
        if self.task is None:
            busy = self.admission.inflight
            log.info(
                "%s: draining (%d request%s in flight, %g s at most; a second signal stops now)",
                sig.name,
                busy,
                "" if busy == 1 else "s",
                self.timeout,
            )
            self.admission.draining = True
            self.task = asyncio.get_running_loop().create_task(self._drain())
            return
        log.info("%s again: aborting %d requests and stopping", sig.name, self.admission.inflight)
        self.task.cancel()
        abort_all(self.runs, self.scheduler)
        self.stop.set()

    async def _drain(self) -> None:
        try:
            await asyncio.wait_for(self.admission.idle.wait(), self.timeout)
        except TimeoutError:
            log.info(
                "shutdown timeout (%g s): aborting %d requests in flight",
                self.timeout,
                self.admission.inflight,
            )
            await self._abort()
        self.stop.set()

    async def _abort(self) -> None:
        deadline = time.monotonic() + ABORT_WAIT
        while self.admission.inflight and time.monotonic() < deadline:
            abort_all(self.runs, self.scheduler)
            try:
                await asyncio.wait_for(self.admission.idle.wait(), 0.05)
            except TimeoutError:
                pass
        if self.admission.inflight:
            # What is left ends now: streams with abort, whole answers with a 503.
            for run in list(self.runs):
                run.shut_down()


def retry_elsewhere(scope: Scope) -> list[tuple[bytes, bytes]]:
    """A draining server's 503 headers: retry at once, and on HTTP/1 on a new connection (a
    keep-alive one would come back here)."""
    headers = [(b"retry-after", RETRY_AFTER)]
    if scope.get("http_version", "1.1").startswith("1."):
        headers.append((b"connection", b"close"))
    return headers
