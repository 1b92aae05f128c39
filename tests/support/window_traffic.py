"""Checks every model with window pages passes (tests/test_deepseek_v4_window.py,
tests/test_gpt_oss_window.py): window pages given back as a request goes, n-gram drafts across
window pages, and seeded traffic (shared prefixes, repeats, aborts and drafts) on a pool small
enough to evict, park and preempt."""

from __future__ import annotations

import random

from kern.engine.load import Engine
from support.scheduler import Harness, prompt

__all__ = ["drafts_across_windows", "held", "random_traffic", "windows_follow"]


def random_traffic(
    engine: Engine, *, step_tokens: int, seed: int, answers: int, host_bytes: int
) -> None:
    """Every answer is kern run's (an aborted one a prefix of it), the books balance after
    every step (window pages counted as the requests' own), nothing hangs and nothing is left
    held; the pool saw hits, and preemptions (long answers) and parks (a host tier)."""
    h = Harness(engine, max_step_tokens=step_tokens, rows=3)
    rng = random.Random(seed)
    bases = [prompt(400 + i, 40) for i in range(3)]
    reqs, aborted = [], set()
    for _ in range(14):
        p = bases[rng.randrange(3)][: rng.randrange(2, 40)]
        reqs.append(h.submit(p, rng.randrange(1, answers), ignore_eos=True))
        if rng.random() < 0.2 and h.open:
            victim = h.open[rng.randrange(len(h.open))]
            h.abort(victim)
            aborted.add(victim)
        for _ in range(rng.randrange(4)):
            h.step()
    h.run(max_steps=2000)
    for r in reqs:
        got = h.answer(r)
        assert got == h.expected(r.prompt_ids, r.max_tokens, ignore_eos=True)[: len(got)]
        if r not in aborted:
            h.assert_identical(r)
    m = h.sched.metrics
    assert m.prefix_hits._value.get() > 0
    if answers > 12:
        assert m.preemptions._value.get() > 0
    if host_bytes:
        assert m.parked._value.get() > 0
    h.assert_idle_and_clean()


def held(req) -> list[int]:
    """The window page indices ``req`` holds."""
    return [j for j, p in enumerate(req.window or []) if p >= 0]


def windows_follow(engine: Engine, window: int) -> None:
    """After every step a request holds exactly the window pages (of ``window`` positions)
    its next row reads, in prefill chunks and in decode; the answer is kern run's."""
    h = Harness(engine, max_step_tokens=24)
    req = h.submit(prompt(3, 150), 30, ignore_eos=True)
    seen = 0
    while h.open:
        h.step()
        if req.window is not None:
            nc = req.num_computed
            want = range(max(0, nc - window + 1) // window, (nc - 1) // window + 1)
            assert held(req) == list(want), (nc, held(req))
            seen += 1
    assert seen > 30
    h.assert_identical(req)
    h.assert_idle_and_clean()


def drafts_across_windows(engine: Engine, seed: int) -> None:
    """n-gram drafts through the scheduler on a repetitive prompt (``seed``'s): rounds cross
    window pages, some drafts are accepted and some rejected, and the answer is rows 1's."""
    h = Harness(engine, rows=5)
    base = prompt(seed, 40)
    req = h.submit(base + base[:20] + base, 60, ignore_eos=True)
    h.run()
    h.assert_identical(req)
    m = h.sched.metrics
    drafted = m.spec_draft_tokens._value.get()
    accepted = m.spec_accepted_tokens._value.get()
    assert 0 < accepted < drafted
    h.assert_idle_and_clean()
