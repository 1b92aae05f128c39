"""Drive a scheduler synchronously, in-process: no thread, no HTTP. Every step is followed by
the cache's own integrity check and by the harness's books (what requests hold, what the tree
holds, what is free), and answers are compared with ``kern.engine.generate`` on the same ids."""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path

from kern.engine.generate import generate
from kern.engine.load import Engine
from kern.engine.request import DraftState, Event, Request
from kern.kern_toml import Target


def draft_of(req: Request) -> DraftState:
    """``req``'s draft state, or an empty one when it never drafted."""
    return DraftState() if req.draft is None else req.draft


def drop_cache(cache) -> None:
    """Drop every unlocked resident entry (device pages and slots back to free). make_room
    refuses a request that could never fit, so ask for one more than is free, until nothing
    more goes."""
    while cache.make_room(cache.pages_free + 1, park=False).evicted:
        pass
    while cache.make_room(0, slots=cache.stats().slots_free + 1, park=False).evicted:
        pass


def load(
    checkpoint: Path,
    *,
    pool_bytes: int,
    host_bytes: int = 0,
    page_tokens: int = 16,
    snapshot_pages: int | None = None,
) -> Engine:
    target = Target(
        name="t",
        checkpoint=checkpoint,
        pool_bytes=pool_bytes,
        host_bytes=host_bytes,
        page_tokens=page_tokens,
        snapshot_pages=snapshot_pages,
    )
    return Engine.load(target)


class Harness:
    """A scheduler over ``engine`` (``limits``: ``max_step_tokens``, ``max_running``)."""

    def __init__(self, engine: Engine, **limits) -> None:
        self.engine = engine
        self.cache = engine.cache
        self.sched = engine.scheduler(self._deliver, **limits)
        self.events: dict[Request, list[Event]] = defaultdict(list)
        self.open: list[Request] = []
        self.num_steps = 0
        self.start = self.cache.stats()
        self._expected: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def _deliver(self, events: list[tuple[Request, Event]]) -> None:
        for req, ev in events:
            assert not any(e[2] for e in self.events[req]), "an event after the final one"
            self.events[req].append(ev)

    # --- requests -------------------------------------------------------------------------

    def submit(self, prompt: list[int], max_tokens: int, **kw) -> Request:
        """Check and queue a request (``LimitError`` when it can never be served)."""
        self.sched.check(len(prompt), max_tokens)
        req = Request(list(prompt), max_tokens, **kw)
        self.sched.submit(req)
        self.open.append(req)
        return req

    def abort(self, req: Request) -> None:
        self.sched.abort(req)

    def finished(self, req: Request) -> bool:
        evs = self.events.get(req)
        return bool(evs) and evs[-1][2] is not None

    def finish_reason(self, req: Request) -> str | None:
        return self.events[req][-1][2] if self.finished(req) else None

    def answer(self, req: Request) -> list[int]:
        return [t for t, _, _ in self.events[req] if t is not None]

    # --- steps ----------------------------------------------------------------------------

    def step(self) -> None:
        self.sched.step()
        self.num_steps += 1
        self.check_books()
        self.open = [r for r in self.open if not self.finished(r)]

    def run(self, max_steps: int = 10_000) -> int:
        """Step until every submitted request has finished; the steps it took. Fails past
        ``max_steps`` (a request that never finishes is a hang)."""
        steps = 0
        while self.open:
            assert steps < max_steps, f"{len(self.open)} requests open after {steps} steps"
            self.step()
            steps += 1
        return steps

    def check_books(self) -> None:
        """The cache's integrity, and the requests' holdings against its counters: slots
        exactly (a request's slot and window pages are its own, never the tree's), pages
        within what the tree and the running requests can hold (a running request's prefix
        pages are the tree's), nothing held by a waiting request."""
        self.cache.check_integrity()
        s = self.cache.stats()
        running = self.sched._running
        pt = self.cache.page_tokens
        for r in running:
            assert len(set(r.block_table)) == len(r.block_table), "a page twice in a table"
            assert len(r.block_table) * pt >= r.num_computed
            # A draft checkpoint's pages: the request's own, never shared with its target's.
            d = draft_of(r)
            assert len(set(d.table)) == len(d.table), "a draft page twice"
            assert not set(d.table) & set(r.block_table), "a draft page in the table"
        listed = sum(len(r.block_table) + len(draft_of(r).table) for r in running)
        drafted = [p for r in running for p in draft_of(r).table]
        assert len(set(drafted)) == len(drafted), "a draft page held by two requests"
        assert s.resident_pages <= s.pages_used <= s.resident_pages + listed
        # Window pages (kern.engine.window_pages): a request's own, never the tree's.
        windows = [p for r in running for p in (r.window or []) + r.window_spare if p >= 0]
        assert len(set(windows)) == len(windows), "a window page held twice"
        slots = sum(r.slot is not None for r in running) + len(windows)
        slots += sum(
            (draft_of(r).slot is not None) + (draft_of(r).saved is not None) for r in running
        )
        assert s.slots_used == s.resident_states + slots, (s.slots_used, s.resident_states, slots)
        for r in self.sched._waiting:
            assert not r.block_table and r.slot is None and r.node is None and r.window is None
            assert not r.window_spare
            d = draft_of(r)
            assert not d.table and d.computed == 0
            assert d.slot is None and d.saved is None

    def assert_idle_and_clean(self) -> None:
        """Nothing runs or waits, nothing is held: every page and slot is free or the tree's,
        and dropping the tree would give back exactly what the pool started with."""
        assert not self.sched._running and not self.sched._waiting and not self.open
        s = self.cache.stats()
        assert s.pages_used == s.resident_pages
        assert s.slots_used == s.resident_states
        assert s.host_pages_used == s.parked_pages and s.host_slots_used == s.parked_states
        drop_cache(self.cache)
        self.cache.check_integrity()
        after = self.cache.stats()
        assert after.pages_used == 0 and after.slots_used == 0
        assert after.pages_free == self.start.pages_free
        assert after.slots_free == self.start.slots_free

    # --- the oracle -----------------------------------------------------------------------

    def expected(self, prompt: list[int], max_tokens: int, *, ignore_eos: bool = False) -> list:
        """``kern run``'s answer: ``generate`` alone, cut after an end-of-sequence token."""
        key = (tuple(prompt), max_tokens)
        if key not in self._expected:
            ckpt = self.engine.checkpoint
            self._expected[key] = generate(
                ckpt, list(prompt), max_tokens, page_tokens=self.cache.page_tokens
            ).ids
        ids = self._expected[key]
        if not ignore_eos:
            eos = set(self.engine.checkpoint.tokenizer.eos_token_ids)
            for n, t in enumerate(ids):
                if t in eos:
                    return ids[: n + 1]
        return ids

    def assert_identical(self, req: Request) -> None:
        assert self.finish_reason(req) in ("stop", "length"), self.finish_reason(req)
        want = self.expected(req.prompt_ids, req.max_tokens, ignore_eos=req.ignore_eos)
        assert self.answer(req) == want, (req.prompt_ids, self.answer(req), want)


def fresh(engine: Engine, **limits) -> Harness:
    """A harness over ``engine`` with its cache emptied first."""
    drop_cache(engine.cache)
    return Harness(engine, **limits)


def spec_counts(h: Harness) -> tuple[float, float]:
    """Draft tokens verified and accepted so far (the Prometheus counters)."""
    m = h.sched.metrics
    return (
        m.value("kern_spec_decode_num_draft_tokens_total"),
        m.value("kern_spec_decode_num_accepted_tokens_total"),
    )


def prompt(seed: int, n: int, vocab: int = 500) -> list[int]:
    """``n`` seeded random token ids in [1, vocab)."""
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(n)]
