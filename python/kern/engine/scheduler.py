"""The scheduler: one thread that runs every request through the runner, one step at a time.
It handles ints and handles only: the runner owns every tensor and lands every plan.

Design notes
------------
* Continuous batching: each step is one ``Runner.forward`` over every running request, decode
  rows first (one token each), then prefill chunks under a per-step token budget
  (``max_step_tokens``). A request joins or leaves between any two steps.
* One code path for prefill, decode and resume. A request is its tokens (prompt, then what it
  produced) and ``num_computed``, how many of them are in its KV. Each step computes the next
  chunk of ``tokens[num_computed:]``; a chunk that reaches the end asks for logits and yields a
  token. Decoding is a chunk of one. The same shapes ``kern.engine.generate`` runs, so a greedy
  answer is the same bits as ``kern run`` on the CPU backend (batch- and chunk-invariant, see
  docs/invariance.md).
* Admission is first come, first served: the head of the queue is admitted once the pages for
  its whole prompt can be had (making room from the cache if need be), so a prefill never
  preempts anyone. A prefix hit is taken from ``Cache.match``, capped one token short of the
  prompt (recompute the last token for logits), its node locked while the request runs; a
  parked hit is woken and its plan landed first; a hit ending mid-page has its shared page
  copied before anything is written past it. On a stateful model (qwen3_5) a hit is usable only
  where a state snapshot sits, and the snapshot is copied into the request's own slot.
* Admission always progresses. A hit is worth taking only if it fits: one ending mid-page
  keeps its locked page *and* needs a copy of it, one page more than the same prompt without
  the hit, so when the pages cannot be had with the hit, admission retries without it. With
  nothing running nothing is locked, so a request that passed :meth:`Scheduler.check` always
  fits then; the head waits only while others run, and they finish in bounded steps. The
  loop sleeps on its condition variable when there is nothing to run; it never spins.
* Preemption: a decode that needs a page when nothing is evictable preempts the youngest
  running request. Its computed tokens and pages go into the prefix tree (with its state, on a
  stateful model), it unlocks, and it goes back to the head of the queue. The tree's make-room
  loop then parks those pages to the host tier, or drops them when the host is full; on
  resume, the request matches its own tokens, waking them (no recompute) or recomputing what
  was dropped. The oldest request always fits alone (requests that cannot are refused at
  submit), so this never deadlocks, and no answer is ever cut short.
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
import queue
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kern.chunk import SeqChunk
from kern.engine.memory import Memory
from kern.engine.params import Context, Pick
from kern.engine.request import Event, LimitError, Request
from kern.engine.spec import Drafter, accept
from kern.metrics import Metrics

if TYPE_CHECKING:
    from kern.engine.sampler import Sampler
    from kern.pool import Cache, Match

__all__ = ["Scheduler", "start_scheduler"]

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
        # Where a decode step's drafts come from (kern.engine.spec), or None: one row.
        self.drafter = drafter
        self.on_crash = on_crash
        self.stateful = self.runner.stateful
        self._cv = threading.Condition()
        self._inbox: list[Request] = []
        self._poked = False  # a submit or an abort since the loop last looked
        self._stop = False
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self.memory = Memory(cache, self.runner, self.metrics, self._running)
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
        """Raise :class:`LimitError` when a request of this size can never be served."""
        total = prompt_len + max_tokens
        if total > self.max_model_len:
            raise LimitError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} is over "
                f"the model's context of {self.max_model_len} tokens",
                "max_tokens",
            )
        pool_tokens = self.max_pages * self.pt
        if total > pool_tokens:
            raise LimitError(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} is over "
                f"the KV pool of {pool_tokens} tokens ({self.max_pages} pages)",
                "max_tokens",
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
                self._waiting.append(req)
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
            if not self._try_admit(req):
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

    def _try_admit(self, req: Request) -> bool:
        """Admit ``req`` with its longest usable hit, else with none; False if it cannot
        have its pages (and slot) now. Leaves nothing allocated or locked when False."""
        cap = len(req.tokens) - 1  # recompute the last token for logits
        m = self.memory.match(req.tokens)  # locked when it hit
        hit = self._usable_hit(m, cap)
        if hit > 0:
            if self._admit_with_hit(req, m, hit):
                return True
        elif m.node is not None:
            self.memory.unlock(m.node)
        return self._admit_at(req, None, None, 0)

    def _admit_with_hit(self, req: Request, m: Match, hit: int) -> bool:
        memory = self.memory
        node = m.node  # locked by the caller's match; unlocked here unless admitted
        assert node is not None
        cap = len(req.tokens) - 1
        if m.resident_len < hit or (self.stateful and m.state_slot is None):
            parked = -(-m.hit_len // self.pt) - m.resident_len // self.pt
            if memory.wake(node, parked):
                m = memory.match(req.tokens)  # the woken pages, under a lock of their own
                memory.unlock(node)
                node = m.node
                assert node is not None
                hit = self._usable_hit(m, cap)
            else:
                # Without the parked part, a stateless hit keeps its resident prefix; a
                # stateful one has no state to resume from.
                hit = 0 if self.stateful else min(hit, m.resident_len)
        if hit > 0 and self._admit_at(req, m, node, hit):
            return True
        memory.unlock(node)
        return False

    def _admit_at(self, req: Request, m: Match | None, node: int | None, hit: int) -> bool:
        """Allocate what ``req`` needs past a ``hit``-token prefix (``m``'s, locked on
        ``node`` by the caller) and start it there. False, with nothing allocated, if the
        pages (or the slot) cannot be had."""
        pt = self.pt
        shared = self.memory.pages(m)[: hit // pt] if m is not None and hit else []
        need = -(-len(req.tokens) // pt) - len(shared)
        slot = None
        if self.stateful:
            slot = self.memory.take_slot()
            if slot is None:
                return False
        own = self.memory.take_pages(need)
        if own is None:
            if slot is not None:
                self.memory.free_slot(slot)
            return False
        if m is not None and hit % pt:
            # The hit's last page is shared with the tree: copy it before writing past the hit.
            self.runner.copy_pages([self.memory.pages(m)[hit // pt]], [own[0]])
        if slot is not None and m is not None and hit:
            assert m.state_slot is not None
            self.runner.copy_slots([m.state_slot], [slot])
        req.block_table = shared + own
        req.node = node
        req.slot = slot
        req.num_computed = hit
        if req.cached_tokens is None:
            # The first admission (a preempted request resumes without counting again).
            req.cached_tokens = hit
            req.t_admit = time.perf_counter()
            m = self.metrics
            m.queue_time.observe(req.t_admit - req.t_submit)
            m.prefix_queries.inc(len(req.prompt_ids))
            if hit:
                m.prefix_hits.inc(hit)
            if req.counts_prompt:
                m.prompt_tokens.inc(len(req.prompt_ids))
        return True

    def _usable_hit(self, m: Match, cap: int) -> int:
        if not self.stateful:
            return min(m.hit_len, cap)
        # A recurrent model resumes only from a state taken at exactly the hit length.
        if m.state_len is None or m.state_len > cap:
            return 0
        return m.state_len

    # --- the forward ----------------------------------------------------------------------

    def _forward(self, events: list[tuple[Request, Event]]) -> None:
        budget = self.max_step_tokens
        pt = self.pt
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
            if req.num_computed + k > len(req.block_table) * pt and not self._grow(req, k):
                if req.draft is not None:
                    req.draft.drafts = []
                continue  # preempted itself: nothing younger to take from
            plan.append((req, k))
            budget -= k
        plan = [(r, k) for r, k in plan if r.block_table]
        if wants:
            assert drafter is not None
            drafter.run([r for r in wants if r.block_table], self.memory)
            plan = [(r, 1 + len(_drafts(r)) if r in wants else k) for r, k in plan]
        if not plan:
            return
        batch = []
        picks: list[Pick] = []
        for req, k in plan:
            nc = req.num_computed
            drafts = _drafts(req)
            if drafts:
                # Verify: the last token, then the drafts; one row of logits each.
                chunk = [req.tokens[nc], *drafts]
                batch.append(SeqChunk(chunk, nc, req.block_table, slot=req.slot, logits="all"))
                picks.extend(self._pick(req, drafts[:j]) for j in range(k))
                continue
            done = nc + k == len(req.tokens)
            batch.append(
                SeqChunk(
                    req.tokens[nc : nc + k],
                    nc,
                    req.block_table,
                    slot=req.slot,
                    logits="last" if done else "none",
                )
            )
            if done:
                picks.append(self._pick(req, []))
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
            if k > 1 and not self.stateful:
                self.memory.share_prefill(req)
            if self.stateful and req.num_computed == self.memory.prompt_snapshot_at(req):
                self.memory.prompt_snapshot(req)
        if not rows:
            return
        now = time.perf_counter()
        m = self.metrics
        for req, start, n in rows:
            verified = [tok for tok, _ in picked[start : start + n]]
            accepted = accept(_drafts(req), verified)
            if n > 1:
                m.spec_drafts.inc()
                m.spec_draft_tokens.inc(n - 1)
                m.spec_accepted_tokens.inc(accepted - 1)
            reason = None
            sent = 0
            for j, tok in enumerate(verified[:accepted]):
                lp = picked[start + j][1]
                req.tokens.append(tok)
                req.num_output += 1
                sent += 1
                if req.grammar is not None and not req.grammar.accept(tok):
                    # The mask allowed only what the grammar accepts: a refusal is a bug.
                    log.error("the structured-output grammar refused token %d; ending", tok)
                    reason = "abort"
                elif tok in req.stop_ids or (tok in self.eos and not req.ignore_eos):
                    reason = "stop"
                elif req.num_output >= req.max_tokens:
                    reason = "length"
                events.append((req, (tok, lp, None)))
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
                # The KV and state now hold the last token and the drafts that were sent; the
                # rest (rejected, or accepted past a stop) is never read: the next chunk
                # starts at num_computed and overwrites it, and the state is rewound to the
                # row of the last token sent, exactly where rows 1 would leave it.
                req.num_computed += sent
                if self.stateful:
                    assert req.slot is not None
                    self.runner.keep_rows(req.slot, sent)
                assert drafter is not None
                drafter.accepted(req, accepted)
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

    def _pick(self, req: Request, drafts: list[int]) -> Pick:
        """How the logits row of ``req``'s next token after ``drafts`` becomes a token: as
        plain decoding draws it at that position (see kern.engine.spec)."""
        context = self._context(req, drafts)
        # A row behind drafts sees a new list, converted whole; otherwise the runner side
        # keeps the request's token log across steps.
        owner = None if drafts else req
        return Pick(req.params, req.num_output + len(drafts), context, req.num_logprobs, owner)

    def _context(self, req: Request, drafts: list[int]) -> Context | None:
        """What the sampler's logits processing needs of ``req``'s next token after
        ``drafts`` (a verify row's context: the drafts before it, as if accepted), or None
        if it needs none."""
        banned: frozenset[int] = frozenset()
        if req.num_output + len(drafts) < req.min_tokens:
            banned = req.stop_ids | self.eos
        if not banned and not req.params.processes and req.grammar is None:
            return None
        if drafts:
            return Context(req.tokens + drafts, len(req.prompt_ids), banned, req.grammar)
        return Context(req.tokens, len(req.prompt_ids), banned, req.grammar)

    def _grow(self, req: Request, k: int) -> bool:
        """Pages for ``req``'s next ``k`` tokens, preempting the youngest running requests
        when nothing can be evicted. False when ``req`` itself was preempted."""
        need = -(-(req.num_computed + k) // self.pt) - len(req.block_table)
        while True:
            pages = self.memory.take_pages(need)
            if pages is not None:
                req.block_table.extend(pages)
                return True
            victim = max(self._running, key=lambda r: r.order)
            self._preempt(victim)
            if victim is req:
                return False

    def _preempt(self, req: Request) -> None:
        self._running.remove(req)
        self.memory.release(req, snapshot=True)
        self._waiting.appendleft(req)
        self.metrics.preemptions.inc()


def start_scheduler(make: Callable[[], Scheduler]) -> Scheduler:
    """Call ``make`` (load the checkpoint, build the runner, cache and scheduler) on a new
    thread, run the scheduler's loop there, and return the scheduler once built (``make``'s
    exception, if it raised).

    Why one thread for every torch op of the process: libgomp keeps a worker pool per thread
    that starts parallel regions, and with two such pools on 2 cores it stops spinning and
    wakes its workers by futex for every op. Measured at 2 threads: an add of 64 x 3072 took
    17 us from one thread and 86 us once another had run torch ops; a batch-64 decode step of
    the ~30M bench model, 44 ms when loaded and run on one thread, 118 ms when loaded on
    another.
    """
    built: queue.Queue[Scheduler | BaseException] = queue.Queue(maxsize=1)

    def main() -> None:
        try:
            sched = make()
        except BaseException as e:  # noqa: BLE001 - handed to the caller, re-raised there
            built.put(e)
            return
        built.put(sched)
        sched.run()

    threading.Thread(target=main, name="kern-scheduler", daemon=True).start()
    got = built.get()
    if isinstance(got, BaseException):
        raise got
    return got


def _decode_first(req: Request) -> tuple[int, int]:
    return (len(req.tokens) - req.num_computed > 1, req.order)


def _drafts(req: Request) -> list[int]:
    return [] if req.draft is None else req.draft.drafts
