"""Aborts at every point of a wake (issue 27): a request whose prefix is parked in the host
tier is aborted (the scheduler's ``abort``, what a client hang-up calls) at every step boundary
while it waits for a wake or runs on the woken pages, and from inside the wake itself (while
the make-room loop parks others for it, or while its copies land). After each, every page and
slot comes back: the harness checks the cache's integrity and the books after every step, and
once idle the pool is back at its start with the cache dropped. In-process, no HTTP
(tests/support/scheduler.py)."""

from __future__ import annotations

import pytest
from support.scheduler import Harness, drop_cache, load, prompt

from kern.engine.request import Request
from kern.pool import u32

PT = 4
QWEN3_PAGE = 2048  # bytes of a 4-token page of the tiny qwen3 (conftest's, seed 1)
BASE = prompt(70, 40)  # the prefix that is parked: 10 pages
ASK = BASE + prompt(71, 20)  # the request aborted: hits BASE, prefills 20 more tokens
FILLERS = [prompt(80 + i, 40) for i in range(8)]  # 11 pages each: a wake must evict first
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def qwen3(tiny_dir):
    """64 pages of 4 tokens and a host tier of 256 pages."""
    return load(
        tiny_dir("qwen3"), pool_bytes=64 * QWEN3_PAGE, host_bytes=256 * QWEN3_PAGE, page_tokens=PT
    )


@pytest.fixture(scope="module")
def qwen3_5(tiny_dir):
    """A family with recurrent states (its hits resume at state snapshots, woken with their
    pages): 40 chunks of 3 pages or one slot, two of them slots at the start, and a host tier
    of 64."""
    folder = tiny_dir("qwen3_5")
    chunk = load(folder, pool_bytes=2**20, page_tokens=PT).cache.stats().chunk_bytes
    return load(folder, pool_bytes=40 * chunk, host_bytes=64 * chunk, page_tokens=PT)


def park_everything(h: Harness) -> None:
    """Park every unlocked resident entry, landing each plan (the runner copies the pages):
    room for one page more than is free evicts one entry at a time until none is left."""
    cache, memory = h.cache, h.sched.memory
    while True:
        room = cache.make_room(cache.pages_free + 1)
        memory.land(room)
        if not room.evicted:
            return


def woken(h: Harness) -> float:
    return h.sched.metrics.value("kern_woken_total")


class Watch:
    """Wraps the scheduler's ``Memory.wake`` and its runner: records each wake's outcome and,
    with ``at``, hangs up ``req``'s client inside its wake: at the first park the make-room
    loop lands for it (``at="park"``) or as its copies land (``at="wake"``). The abort is a
    flag the next step reaps, as a hang-up's is."""

    def __init__(self, h: Harness, req: Request, at: str | None) -> None:
        self.h, self.req, self.at = h, req, at
        self.memory = h.sched.memory
        self.runner = self.memory.runner
        self.outcomes: list[bool] = []  # each wake: True when it went through
        self.woken_pages = 0  # pages its wakes copied back
        self.in_wake = self.hung_up = False
        self.waited = False  # still queued at a step's end after a wake was tried

    def __enter__(self) -> Watch:
        wake = self.memory.wake

        def watched(node: int) -> bool:
            self.in_wake = True
            try:
                ok = wake(node)
            finally:
                self.in_wake = False
            self.outcomes.append(ok)
            return ok

        self.memory.wake = watched  # type: ignore[method-assign]
        self.memory.runner = self
        return self

    def __exit__(self, *exc) -> None:
        del self.memory.wake
        self.memory.runner = self.runner

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def _hang_up(self, at: str) -> None:
        if self.at == at and self.in_wake and not self.hung_up:
            self.h.abort(self.req)
            self.hung_up = True

    def park(self, plans) -> None:
        if plans:
            self._hang_up("park")
        self.runner.park(plans)

    def wake(self, plan) -> None:
        self._hang_up("wake")
        self.woken_pages += plan.num_pages
        self.runner.wake(plan)


# A request that runs while ASK arrives, holding most of the 64 pages until it ends: its
# prompt's length. 220 tokens (55 pages, 57 with its answer) leave no room for BASE's 10-page
# wake: the wake is refused each step. 216 (54, then 56) leave room for the wake but not for
# ASK's 5 pages more: ASK waits with BASE woken. Either way ASK waits on its wake.
BLOCKERS = {"wakes-at-once": None, "wake-refused": 220, "woken-no-room": 216}


def scenario(
    h: Harness,
    abort_after: int | None,
    *,
    blocker: int | None,
    inside: str | None,
    fillers: int = 5,
) -> tuple[Request, Watch]:
    """BASE parked, the device full of unlocked entries (and, with a ``blocker`` length, a
    running request holding most pages until it ends); then ``ASK`` is submitted and aborted
    after ``abort_after`` steps (or inside its wake). Runs until idle and checks that
    nothing leaked; returns the request and what its wakes did."""
    seed = h.submit(BASE, 4, ignore_eos=True)
    h.run()
    h.assert_identical(seed)
    park_everything(h)
    parked = h.cache.stats()
    assert h.cache._peek(u32(ASK)).resident_len == 0 < parked.parked_pages
    assert parked.parked_states > 0 or not h.sched.stateful  # its snapshot wakes with it
    for p in FILLERS[:fillers]:
        h.submit(p, 4, ignore_eos=True)
    h.run()
    if blocker is not None:
        h.submit(prompt(90, blocker), 8, ignore_eos=True)
        h.step()
    req = h.submit(ASK, MAX_TOKENS, ignore_eos=True)
    before = woken(h)
    with Watch(h, req, inside) as watch:
        steps = 0
        while not h.finished(req):
            if steps == abort_after:
                h.abort(req)
            h.step()
            steps += 1
            assert steps < 200, "the aborted request never ended"
            if watch.outcomes and req in h.sched._waiting:
                watch.waited = True
        h.run()
    if inside is not None:
        assert watch.hung_up, f"no hang-up inside the wake ({inside})"
        assert h.finish_reason(req) == "abort"
    if blocker is not None and req.cached_tokens:
        # It waited while the blocker ran, and was admitted once it ended.
        assert watch.waited and watch.outcomes[-1] is True, watch.outcomes
        # Its first wake: refused, or woken (then waiting for the rest of its pages).
        assert watch.outcomes[0] is (blocker != BLOCKERS["wake-refused"]), watch.outcomes
    # BASE comes back once (twice if evicted again meanwhile), not at every step it waits:
    # a start without the hit that could not fit either used to park it again each step.
    assert watch.woken_pages <= 2 * len(BASE) // PT, watch.woken_pages
    if req.cached_tokens:
        # It was admitted on its parked prefix (a stateful one at BASE's prompt-end snapshot,
        # a token short): woken, not recomputed.
        assert req.cached_tokens >= len(BASE) - 1 and woken(h) > before
    if h.finish_reason(req) == "abort":
        got = h.answer(req)
        assert got == h.expected(ASK, MAX_TOKENS, ignore_eos=True)[: len(got)]
    else:
        h.assert_identical(req)
    h.assert_idle_and_clean()
    return req, watch


def every_boundary(h: Harness, blocker: int | None, fillers: int) -> set:
    """Abort after 0, 1, 2, ... steps until the request ends on its own first; what each
    abort hit: (waiting after a wake, admitted, decoding)."""
    seen = set()
    k = 0
    while True:
        req, watch = scenario(h, k, blocker=blocker, inside=None, fillers=fillers)
        admitted = bool(req.cached_tokens)
        seen.add((watch.waited and not admitted, admitted, req.num_output > 0))
        if h.finish_reason(req) != "abort":
            break  # it ended before this boundary: every one before it was tried
        k += 1
    return seen


# Aborted queued before any wake, after its wake mid-prefill, and while decoding.
EVERY = {(False, False, False), (False, True, False), (False, True, True)}


@pytest.mark.parametrize("blocker", BLOCKERS.values(), ids=BLOCKERS.keys())
def test_an_abort_at_every_step_boundary_of_a_wake_gives_everything_back(qwen3, blocker):
    drop_cache(qwen3.cache)
    seen = every_boundary(Harness(qwen3, max_step_tokens=8), blocker, fillers=5)
    # With a blocker, also while it waited between wakes.
    want = EVERY if blocker is None else EVERY | {(True, False, False)}
    assert want <= seen, seen


@pytest.mark.parametrize("at", ["park", "wake"])
@pytest.mark.parametrize("blocker", BLOCKERS.values(), ids=BLOCKERS.keys())
def test_a_hang_up_inside_the_wake_gives_everything_back(qwen3, at, blocker):
    drop_cache(qwen3.cache)
    h = Harness(qwen3, max_step_tokens=8)
    req, watch = scenario(h, None, blocker=blocker, inside=at)
    assert req.num_output <= 1  # ended at the step after the wake
    # Its copies landed (at="wake"), or it hung up while the wake made room, which then
    # went through or was refused (at="park", "wake-refused").
    assert watch.outcomes[-1] is (at == "wake" or blocker != BLOCKERS["wake-refused"])


def test_a_stateful_family_gives_pages_and_slots_back_at_every_boundary(qwen3_5):
    drop_cache(qwen3_5.cache)
    h = Harness(qwen3_5, max_step_tokens=8)
    assert EVERY <= every_boundary(h, None, fillers=8)
    for at in ("park", "wake"):
        req, watch = scenario(h, None, blocker=None, inside=at, fillers=8)
        assert watch.outcomes == [True] and req.num_output <= 1
