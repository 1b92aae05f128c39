"""The scheduler: one thread that runs every request through the runner, one step at a time:
the inbox, admission, chunk planning, preemption and finish. It handles ints and handles only
(no tensor, no torch): the runner side samples (kern.engine.sampler.Sampler), the cache is
reached through kern.engine.memory, drafts through kern.engine.drafters.

Design notes
------------
* Admission is first come, first served within a priority (kern.engine.waiting): the head
  of the queue is admitted once the pages for its whole prompt can be had (making room from
  the cache if need be), so a prefill never preempts anyone; how a prefix hit is taken is
  kern.engine.memory's (``Memory.admit``). With nothing running nothing is locked, so a
  request that passed :meth:`Scheduler.check` always fits then; the head waits only while
  others run, and they finish in bounded steps. The loop sleeps on its condition variable
  when there is nothing to run; it never spins.
* Preemption: a decode that needs a page when nothing is evictable preempts the youngest
  running request of the highest priority value. Its computed tokens and pages go into the
  prefix tree (with its state, on a stateful model), it unlocks, and it goes back to the
  front of its priority. The tree's make-room loop then parks those pages to the host tier,
  or drops them when the host is full; on resume, the request matches its own tokens, waking
  them (no recompute) or recomputing what was dropped. The first by (priority, arrival)
  fits alone (others are refused at submit) and is never preempted: no deadlock.
* The thread talks to the app through two things only: ``submit``/``abort`` (locked inbox,
  a condition variable to wake the thread) and ``deliver``, called once per step with every
  event of that step, so crossing to the event loop costs one call per step, not per token.
  :meth:`Scheduler.step` runs one step on the calling thread (the tests drive it that way).
* If the loop raises, every open request is finished with ``abort`` and ``on_crash`` runs (the
  server prints the error and exits with code 101).
* Metrics are recorded here, on this thread, as things happen (kern.metrics): cheap calls on
  pre-labelled ``prometheus_client`` children, and one gauge snapshot per step.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kern.arith import cdiv
from kern.chunk import SeqChunk
from kern.engine.drafters import Drafter, accept, settle
from kern.engine.memory import Memory
from kern.engine.params import LogprobEntry, Pick
from kern.engine.request import Event, LimitError, Request
from kern.engine.waiting import Waiting
from kern.metrics import Metrics

if TYPE_CHECKING:
    from kern.engine.sampler import Sampler
    from kern.pool import Cache

__all__ = ["Scheduler"]

log = logging.getLogger("kern")


class Scheduler:
    """Owns the runner and the cache. :meth:`run` loops on the calling thread (see
    :func:`start_scheduler`); :meth:`step` runs one step."""

    def __init__(
        self,
        sampler: Sampler,
        cache: Cache,
        *,
        eos_token_ids: Sequence[int],
        max_model_len: int,
        deliver: Callable[[list[tuple[Request, Event]]], None],
        metrics: Metrics | None = None,
        max_step_tokens: int = 512,
        max_running: int = 256,
        drafter: Drafter | None = None,
        on_crash: Callable[[BaseException], None] | None = None,
        snapshot_pages: int = 1,
    ) -> None:
        if max_step_tokens < 1 or max_running < 1:
            raise ValueError("max_step_tokens and max_running must be >= 1")
        # The runner side of a step: forwards and sampling (kern.engine.sampler.Sampler).
        self.sampler = sampler
        self.runner = sampler.runner
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.deliver = deliver
        self.metrics = metrics or Metrics()
        self.max_step_tokens = max_step_tokens
        self.max_running = max_running
        # Where a decode step's drafts come from (kern.engine.drafters), or None: one row.
        self.drafter = drafter
        self.on_crash = on_crash
        self.stateful = self.runner.stateful
        self._cv = threading.Condition()
        self._inbox: list[Request] = []
        self._poked = False  # a submit or an abort since the loop last looked
        self._stop = False
        self._waiting = Waiting()
        self._running: list[Request] = []
        self.memory = Memory(cache, self.runner, self.metrics, self._running, snapshot_pages)
        self.pt = self.memory.page_tokens
        self.max_pages = self.memory.max_pages
        self._order = 0
        self.failed: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._gauges()

    # --- the app's side (any thread) ------------------------------------------------------

    def run(self) -> None:
        """Run the loop on the calling thread until :meth:`stop` (or a crash); the thread
        that built the scheduler, see :func:`start_scheduler`."""
        self._thread = threading.current_thread()
        try:
            while True:
                with self._cv:
                    while not (self._stop or self._poked or self._running or self._waiting):
                        self._cv.wait()
                    if self._stop:
                        return
                self.step()
        except BaseException as e:  # noqa: BLE001 - a PanicException too: nothing may hang
            self._crash(e)

    def stop(self) -> None:
        """Ask the loop to end after its step; waits for it unless called from it."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """Raise :class:`LimitError` when a request of this size can never be served (param
        "": the caller's prompt field, when the prompt alone leaves no room)."""
        pool = self.max_pages * self.pt
        limits = ((self.max_model_len, "the model's context of"), (pool, "the KV pool of"))
        for room, what in limits:
            if prompt_len >= room:
                msg = f"leaves no room to generate in {what} {room} tokens"
                raise LimitError(f"the prompt ({prompt_len} tokens) {msg}", "")
        total = prompt_len + max_tokens
        for room, what in limits:
            if total > room:
                msg = f"= {total} is over {what} {room} tokens"
                raise LimitError(
                    f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) {msg}", "max_tokens"
                )

    def max_tokens_for(self, prompt_len: int) -> int:
        """The most tokens a prompt of this length may ask for (the default when unset)."""
        return max(1, min(self.max_model_len, self.max_pages * self.pt) - prompt_len)

    def submit(self, req: Request) -> None:
        """Queue ``req`` (checked with :meth:`check` first). Its events go to ``deliver``."""
        req.tokens = list(req.prompt_ids)
        req.t_submit = time.perf_counter()
        with self._cv:
            if self.failed is not None:
                raise RuntimeError("the scheduler has stopped")
            self._inbox.append(req)
            self._poked = True
            self._cv.notify()

    def abort(self, req: Request, reason: str = "abort") -> None:
        """Ask for ``req`` to end at the next step (a no-op once finished), counted with
        ``reason``: ``abort``, or ``stop`` when the app ends it at a stop string."""
        req.end_reason = reason
        req.aborted = True
        with self._cv:
            self._poked = True
            self._cv.notify()

    # --- one step -------------------------------------------------------------------------

    def step(self) -> None:
        """One step on the calling thread: take what was submitted and aborted, admit what
        fits, run one forward over the running requests, deliver the step's events."""
        with self._cv:
            self._poked = False
            for req in self._inbox:
                req.order = self._order
                self._order += 1
                self._waiting.add(req, behind=True)
            self._inbox.clear()
        events: list[tuple[Request, Event]] = []
        self._reap_aborted(events)
        self._admit(events)
        self._forward(events)
        if events:
            self.deliver(events)
        self._gauges()

    def _gauges(self) -> None:
        self.metrics.snapshot(
            self.memory.stats(),
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            max_pages=self.max_pages,
            arena_bytes=self.memory.arena_bytes,
        )

    def _crash(self, e: BaseException) -> None:
        traceback.print_exception(e)
        with self._cv:
            self.failed = e
            open_reqs = [*self._running, *self._waiting, *self._inbox]
            self._inbox.clear()
        try:
            self.deliver([(r, (None, None, "abort")) for r in open_reqs])
        finally:
            if self.on_crash is not None:
                self.on_crash(e)

    def _reap_aborted(self, events: list[tuple[Request, Event]]) -> None:
        if any(r.aborted for r in self._waiting):
            for r in [r for r in self._waiting if r.aborted]:
                self._waiting.remove(r)
                self._finish(r, r.end_reason, events, snapshot=False)
        for r in [r for r in self._running if r.aborted]:
            self._running.remove(r)
            self._finish(r, r.end_reason, events, snapshot=False)

    def _finish(
        self,
        req: Request,
        reason: str,
        events: list[tuple[Request, Event]],
        *,
        snapshot: bool = True,
    ) -> None:
        """End ``req`` with ``reason``; ``snapshot=False`` for an abort, whose last state
        need not match what the client received."""
        req.finish_reason = reason
        self.memory.release(req, snapshot=snapshot)
        if req.cached_tokens is None:
            req.cached_tokens = 0
        self.metrics.finished(req, reason, time.perf_counter())
        events.append((req, (None, None, reason)))

    # --- admission ------------------------------------------------------------------------

    def _admit(self, events: list[tuple[Request, Event]]) -> None:
        while self._waiting and len(self._running) < self.max_running:
            req = self._waiting[0]
            if not self.memory.admit(req):
                if not self._running:
                    # Nothing is locked now, so a request that passed check() fits; this is
                    # a broken invariant, and the request ends instead of blocking the queue.
                    log.error(
                        "could not admit a %d-token request with nothing running (%d pages "
                        "free); ending it",
                        len(req.tokens),
                        self.memory.pages_free,
                    )
                    self._waiting.popleft()
                    self._finish(req, "abort", events, snapshot=False)
                    continue
                return
            self._waiting.popleft()
            self._running.append(req)

    # --- the forward ----------------------------------------------------------------------

    def _forward(self, events: list[tuple[Request, Event]]) -> None:
        """One step's three phases: plan the batch (drafts included), run it, and settle
        every row that yields tokens."""
        plan = self._plan()
        if not plan:
            return
        batch, picks = self._batch(plan)
        windows = self.memory.windows
        # The forward and the choice of every logits row, on the runner side: ids back.
        picked = self.sampler.forward(batch, picks)
        # Requests that get tokens: (request, its first logits row, its number of rows).
        rows: list[tuple[Request, int, int]] = []
        first = 0
        for req, k in plan:
            if _drafts(req):
                rows.append((req, first, k))
                first += k
                continue  # num_computed moves once the drafts are judged
            if req.num_computed + k == len(req.tokens):
                rows.append((req, first, 1))
                first += 1
            req.num_computed += k
            if windows is not None:
                windows.share(req, req.num_computed - k)
            elif k > 1 and not self.stateful:
                self.memory.share_prefill(req)
            if req.num_computed == self.memory.prompt_snapshot_at(req):
                self.memory.prompt_snapshot(req)
        now = time.perf_counter()
        for req, start, n in rows:
            self._emit(req, [picked[i] for i in range(start, start + n)], now, events)
        if self.drafter is not None:
            self.drafter.stepped(batch, [r for r, _ in plan], self.memory)
        if windows is not None:
            # Once every row settled: a verify's rejected rows may still need their window.
            for req, _ in plan:
                windows.trim(req)

    def _plan(self) -> list[tuple[Request, int]]:
        """Each running request's next chunk length under the step's budget (decode rows
        first, then prefill chunks), growing their pages, and the drafts of those that
        draft."""
        budget = self.max_step_tokens
        drafter = self.drafter
        plan: list[tuple[Request, int]] = []
        # Requests the drafter planned drafts for this step, in the order planned.
        wants: dict[Request, None] = {}
        # Drafts take only what the step's decode rows leave of the budget, so speculation
        # never keeps a younger request from its token.
        spare = budget - sum(len(r.tokens) - r.num_computed == 1 for r in self._running)
        # Decode rows first, oldest first: they are cheap and keep streams flowing.
        for req in sorted(self._running, key=_decode_first):
            if req not in self._running:
                continue  # preempted for an older request in this loop
            if budget <= 0:
                break
            left = len(req.tokens) - req.num_computed
            k = min(left, budget)
            room = min(spare, budget - 1)
            if req.draft is not None:
                req.draft.drafts = []
            if left == 1 and drafter is not None:
                want = drafter.plan(req, room)
                if want is not None:
                    # A draft model drafts after planning, for every request at once.
                    wants[req] = None
                    cost, num = want
                    spare -= cost
                    k += num
            at = self.memory.prompt_snapshot_at(req)
            if at is not None and req.num_computed < at < req.num_computed + k:
                k = at - req.num_computed
            got = self._grow(req, k)
            if got < k:
                # Preempted itself (nothing younger to take from), or cut to the rows its
                # window pages cover: drafts wait for another step.
                wants.pop(req, None)
                if req.draft is not None:
                    req.draft.drafts = []
                if not got:
                    continue
                k = min(got, left)
            plan.append((req, k))
            budget -= k
        plan = [(r, k) for r, k in plan if r.block_table]
        if wants:
            assert drafter is not None
            drafter.run([r for r in wants if r.block_table], self.memory)
            plan = [(r, 1 + len(_drafts(r)) if r in wants else k) for r, k in plan]
        return plan

    def _batch(self, plan: list[tuple[Request, int]]) -> tuple[list[SeqChunk], list[Pick]]:
        """The step's chunks and how each logits row becomes a token."""
        batch = []
        picks: list[Pick] = []
        for req, k in plan:
            chunk, rows = req.next_chunk(k, self.eos)
            batch.append(chunk)
            picks.extend(rows)
        return batch, picks

    def _emit(
        self,
        req: Request,
        picked: list[tuple[int, LogprobEntry | None]],
        now: float,
        events: list[tuple[Request, Event]],
    ) -> None:
        """``req``'s rows' tokens (one, or a verify's): judge its drafts, send the tokens up
        to a stop, settle the verify, count, and finish it if it stopped."""
        m = self.metrics
        n = len(picked)
        verified = [tok for tok, _ in picked]
        accepted = accept(_drafts(req), verified)
        if n > 1:
            m.spec_drafts.inc()
            m.spec_draft_tokens.inc(n - 1)
            m.spec_accepted_tokens.inc(accepted - 1)
        reason = None
        sent = 0
        for j, tok in enumerate(verified[:accepted]):
            reason = req.append(tok, self.eos)
            sent += 1
            events.append((req, (tok, picked[j][1], None)))
            if reason is not None:
                break  # tokens accepted past a stop are never sent
        if reason is not None and sent < accepted:
            log.debug(
                "%d accepted tokens after a %r finish not sent; state rewound to the last "
                "token sent",
                accepted - sent,
                reason,
            )
        if n > 1:
            assert self.drafter is not None
            settle(req, sent, accepted, self.runner, self.drafter)
        if req.draft is not None:
            req.draft.drafts = []
        m.generation_tokens.inc(sent)
        if req.num_output == sent:
            req.t_first = now
            m.ttft.observe(now - req.t_submit)
            m.prefill_time.observe(now - req.t_admit)
        else:
            m.itl.observe(now - req.t_last)
        req.t_last = now
        if reason is not None:
            self._running.remove(req)
            self._finish(req, reason, events)

    def _grow(self, req: Request, k: int) -> int:
        """Pages for ``req``'s next ``k`` rows and window pages for as many of them as can be
        had (the rows covered), preempting the youngest running requests while not even the
        next row's can be had. 0 when ``req`` itself was preempted."""
        need = cdiv(req.num_computed + k, self.pt) - len(req.block_table)
        windows = self.memory.windows
        while True:
            pages = self.memory.take_pages(need)
            if pages is not None:
                req.block_table.extend(pages)
                need = 0
                got = k if req.window is None or windows is None else windows.grow(req, k)
                if got:
                    return got
            victim = max(self._running, key=lambda r: (r.priority, r.order))
            self._preempt(victim)
            if victim is req:
                return 0

    def _preempt(self, req: Request) -> None:
        self._running.remove(req)
        self.memory.release(req, snapshot=True)
        self._waiting.add(req, behind=False)
        self.metrics.preemptions.inc()


def _decode_first(req: Request) -> tuple[int, int]:
    return (len(req.tokens) - req.num_computed > 1, req.order)


def _drafts(req: Request) -> list[int]:
    return [] if req.draft is None else req.draft.drafts
