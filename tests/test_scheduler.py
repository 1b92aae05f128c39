"""The scheduler in-process (tests/support/scheduler.py): admission, chunked prefill,
preemption, parking and waking, hang-ups, slot growth, the request-end snapshot, and the
cases that used to hang. Every step checks the cache's integrity and the books; every answer
is compared with ``kern.engine.generate`` alone on the same ids."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from support.scheduler import Harness, drop_cache, load, prompt

from kern.engine.request import LimitError
from kern.tiny import default_model_path

PT = 4  # small pages: many of them, and hits that end mid-page
QWEN3_PAGE = 2048  # bytes of a 4-token page of the tiny qwen3 (conftest's, seed 1)


@pytest.fixture(scope="module")
def qwen3(tiny_dir):
    """64 pages of 4 tokens and a host tier of 256 pages."""
    return load(
        tiny_dir("qwen3"), pool_bytes=64 * QWEN3_PAGE, host_bytes=256 * QWEN3_PAGE, page_tokens=PT
    )


@pytest.fixture(scope="module", params=["qwen3_5", "kimi_linear"])
def stateful(request, tiny_dir):
    """A family with recurrent states: 40 chunks (two of them slots at the start) and a host
    tier of 64."""
    folder = tiny_dir(request.param)
    chunk = load(folder, pool_bytes=2**20, page_tokens=PT).cache.stats().chunk_bytes
    return load(folder, pool_bytes=40 * chunk, host_bytes=64 * chunk, page_tokens=PT)


def fresh(engine, **limits) -> Harness:
    """A harness over ``engine`` with its cache emptied (engines are shared per module)."""
    drop_cache(engine.cache)
    h = Harness(engine, **limits)
    return h


def test_admission_with_and_without_a_hit(qwen3):
    h = fresh(qwen3)
    p = prompt(1, 37)
    a = h.submit(p, 12)
    h.run()
    h.assert_identical(a)
    assert a.cached_tokens == 0
    b = h.submit(p, 12)  # the same prompt: hits all but the last token
    h.run()
    h.assert_identical(b)
    assert b.cached_tokens == 36
    nxt = p + h.answer(a) + prompt(2, 5)  # a next turn, sent as ids
    c = h.submit(nxt, 8)
    h.run()
    h.assert_identical(c)
    assert c.cached_tokens >= len(p) + len(h.answer(a)) - 1
    h.assert_idle_and_clean()


def test_running_requests_share_a_prompt(qwen3):
    # A's prompt pages enter the cache once prefilled: B, sent while A still decodes, hits
    # them (a shared system prompt), not only after A ends.
    h = fresh(qwen3)
    system = prompt(3, 30)
    a = h.submit(system + [7, 8], 40, ignore_eos=True)
    h.step()
    h.step()
    assert a.num_output > 0
    b = h.submit(system + [9], 6, ignore_eos=True)
    h.step()
    assert not h.finished(a)
    assert b.cached_tokens >= len(system) // PT * PT
    h.run()
    h.assert_identical(a)
    h.assert_identical(b)
    h.assert_idle_and_clean()


def test_chunked_prefill_and_batching(qwen3):
    h = fresh(qwen3, max_step_tokens=7)
    reqs = [h.submit(prompt(10 + i, 15 + 6 * i), 10) for i in range(4)]
    h.run()
    for r in reqs:
        h.assert_identical(r)
    h.assert_idle_and_clean()


def test_preemption_of_the_youngest(tiny_dir):
    # 24 pages: five prompts of 5 pages are admitted, and each needs 8 pages by its end.
    h = Harness(load(tiny_dir("qwen3"), pool_bytes=24 * QWEN3_PAGE, page_tokens=PT))
    reqs = [h.submit(prompt(20 + i, 18), 14, ignore_eos=True) for i in range(5)]
    h.run()
    for r in reqs:
        h.assert_identical(r)
    assert h.sched.metrics.value("kern_num_preemptions_total") > 0
    h.assert_idle_and_clean()


def test_priority_orders_admission(qwen3):
    # One running at a time: the waiting queue admits the lowest priority first, equal ones
    # in arrival order (vLLM's priority), and answers are unchanged.
    h = fresh(qwen3, max_running=1)
    first = h.submit(prompt(60, 9), 4, ignore_eos=True)
    h.step()
    assert first.t_admit > 0
    late = h.submit(prompt(61, 9), 4, ignore_eos=True, priority=5)
    plain = [h.submit(prompt(62 + i, 9), 4, ignore_eos=True) for i in range(2)]
    urgent = h.submit(prompt(64, 9), 4, ignore_eos=True, priority=-3)
    h.run()
    order = sorted([late, *plain, urgent], key=lambda r: r.t_admit)
    assert order == [urgent, *plain, late]
    for r in [first, late, *plain, urgent]:
        h.assert_identical(r)
    h.assert_idle_and_clean()


def test_parking_under_pressure_then_waking(qwen3):
    h = fresh(qwen3)
    m = h.sched.metrics
    firsts = [prompt(30 + i, 40) for i in range(6)]
    for p in firsts:  # 6 x 11 pages: the early ones are parked to make room
        r = h.submit(p, 4, ignore_eos=True)
        h.run()
        h.assert_identical(r)
    assert m.value("kern_parked_total") > 0
    r = h.submit(firsts[0] + [7, 7], 6, ignore_eos=True)  # its prefix is in host memory
    h.run()
    h.assert_identical(r)
    assert m.value("kern_woken_total") > 0 and r.cached_tokens >= 40
    h.assert_idle_and_clean()


def test_hang_up_while_queued_and_while_running(qwen3):
    h = fresh(qwen3, max_running=1)
    running = h.submit(prompt(40, 20), 30, ignore_eos=True)
    queued = h.submit(prompt(41, 20), 30, ignore_eos=True)
    h.step()
    h.step()
    assert running.num_output > 0 and queued.num_output == 0
    h.abort(queued)
    h.step()
    assert h.finish_reason(queued) == "abort" and not h.answer(queued)
    h.abort(running)
    h.step()
    assert h.finish_reason(running) == "abort"
    assert (
        h.answer(running)
        == h.expected(running.prompt_ids, 30, ignore_eos=True)[: len(h.answer(running))]
    )
    h.assert_idle_and_clean()


def test_slot_growth_from_two_and_the_request_end_snapshot(stateful):
    h = fresh(stateful)
    assert h.cache.stats().slot_capacity == 2
    reqs = [h.submit(prompt(50 + i, 10 + i), 8, ignore_eos=True) for i in range(5)]
    h.step()
    assert h.cache.stats().slot_capacity >= 5  # five sequences at once
    h.run()
    for r in reqs:
        h.assert_identical(r)
    first = reqs[0]
    turn = first.prompt_ids + h.answer(first) + [9, 9, 9]
    nxt = h.submit(turn, 6, ignore_eos=True)
    h.run()
    h.assert_identical(nxt)
    # The snapshot sits after the last computed token: all but the last answer token.
    assert nxt.cached_tokens == len(first.prompt_ids) + len(h.answer(first)) - 1
    # The same next turn again resumes from the snapshot its first run took one token short
    # of its prompt's end.
    again = h.submit(turn, 6, ignore_eos=True)
    h.run()
    h.assert_identical(again)
    assert again.cached_tokens == len(turn) - 1
    h.assert_idle_and_clean()


def test_a_prompt_ending_at_a_snapshot_resumes_at_the_one_before(stateful):
    """A prompt as long as an earlier request's computed tokens ends exactly at its
    request-end snapshot, which it cannot resume at (its last token is recomputed for its
    logits): it resumes at the earlier request's prompt-end snapshot, not at nothing."""
    drop_cache(stateful.cache)
    h = Harness(stateful)
    p = prompt(91, 13)
    first = h.submit(p, 6, ignore_eos=True)
    h.run()
    edge = h.submit(first.tokens[:-1], 3, ignore_eos=True)  # its request-end snapshot's length
    h.run()
    h.assert_identical(first)
    h.assert_identical(edge)
    assert edge.cached_tokens == len(p) - 1
    h.assert_idle_and_clean()


@pytest.mark.parametrize("step_tokens", [None, 7])
def test_a_repeated_prompt_resumes_from_the_prompt_end_snapshot(stateful, step_tokens):
    """Hits that end mid-page, on a page boundary, one past it, and around 64 (the chunk of
    the chunked delta-rule kernels), with prefill in one chunk or in chunks of 7 tokens."""
    limits = {} if step_tokens is None else {"max_step_tokens": step_tokens}
    drop_cache(stateful.cache)
    h = Harness(stateful, **limits)
    for n in (9, 12, 13, 63, 64, 65, 70):
        p = prompt(70 + n + 1000 * bool(step_tokens), n)  # the host tier outlives drop_cache
        first = h.submit(p, 5, ignore_eos=True)
        h.run()
        again = h.submit(p, 5, ignore_eos=True)
        h.run()
        h.assert_identical(first)
        h.assert_identical(again)
        assert first.cached_tokens == 0 and again.cached_tokens == n - 1
    # Two at once with the same prompt: each answer right, the tree's books intact.
    p = prompt(99, 11)
    twins = [h.submit(p, 4, ignore_eos=True) for _ in range(2)]
    h.run()
    for r in twins:
        h.assert_identical(r)
    h.assert_idle_and_clean()


def test_stateful_preemption_parks_states(tiny_dir):
    # 14 chunks of 3 pages or 1 slot, a host tier: four sequences of 32 tokens each need 3
    # chunks of pages and one slot by their end, 16 chunks in all.
    engine = load(tiny_dir("qwen3_5"), pool_bytes=14 * 12288, host_bytes=16 * 12288, page_tokens=PT)
    h = Harness(engine)
    reqs = [h.submit(prompt(60 + i, 12), 20, ignore_eos=True) for i in range(4)]
    h.run()
    for r in reqs:
        h.assert_identical(r)
    m = h.sched.metrics
    assert m.value("kern_num_preemptions_total") > 0 and m.value("kern_parked_total") > 0
    h.assert_idle_and_clean()


# --- the cases that used to hang -----------------------------------------------------------


def test_a_prompt_that_needs_the_whole_pool_twice(tiny_dir):
    # 8 pages; a 31-token prompt + 1 token needs all of them. The second copy hits the
    # first's 30 tokens, ending mid-page: with the hit it would need 9 pages.
    h = Harness(load(tiny_dir("qwen3"), pool_bytes=8 * QWEN3_PAGE, page_tokens=PT))
    p = prompt(70, 31)
    a = h.submit(p, 1)
    b = h.submit(p, 1)
    assert h.run(max_steps=20) <= 20
    h.assert_identical(a)
    h.assert_identical(b)
    assert b.cached_tokens == 0  # the hit did not fit: admitted without it
    h.assert_idle_and_clean()


def test_a_repeated_short_prompt_on_a_one_page_pool(tiny_dir):
    h = Harness(load(tiny_dir("qwen3"), pool_bytes=1 * QWEN3_PAGE, page_tokens=PT))
    reqs = [h.submit([5, 6, 7], 1) for _ in range(3)]
    h.run(max_steps=20)
    for r in reqs:
        h.assert_identical(r)
    h.assert_idle_and_clean()


def test_n_choices_on_a_one_page_pool(tiny_dir):
    h = Harness(load(tiny_dir("qwen3"), pool_bytes=1 * QWEN3_PAGE, page_tokens=PT))
    reqs = [h.submit([3, 1, 4], 1, index=i) for i in range(3)]  # n=3: one prompt, 3 choices
    h.run(max_steps=20)
    for r in reqs:
        h.assert_identical(r)
    h.assert_idle_and_clean()


def test_the_queue_is_not_blocked_by_what_cannot_run_yet(qwen3):
    # The head needs the whole pool while another request runs: it waits, and every
    # request finishes in a bounded number of steps.
    h = fresh(qwen3)
    small = h.submit(prompt(80, 8), 30, ignore_eos=True)
    big = h.submit(prompt(81, 250), 6, ignore_eos=True)
    after = h.submit(prompt(82, 8), 4, ignore_eos=True)
    h.run(max_steps=200)
    for r in (small, big, after):
        h.assert_identical(r)
    h.assert_idle_and_clean()


def test_the_size_check_refuses_what_can_never_fit(qwen3):
    h = fresh(qwen3)
    with pytest.raises(LimitError, match="KV pool"):
        h.submit(prompt(90, 250), 7)
    with pytest.raises(LimitError, match="context"):
        h.submit(prompt(90, 10), 9000)


def test_the_loop_sleeps_when_there_is_nothing_to_run(tiny_dir):
    """The thread's loop waits on its condition variable: with nothing submitted it takes
    no steps (it used to spin while a request could not be admitted)."""
    import threading
    import time

    engine = load(default_model_path(), pool_bytes=1 << 20)
    done = threading.Event()
    sched = engine.scheduler(lambda evs: [done.set() for _, (_, _, f) in evs if f])
    steps = [0]
    real = sched.step

    def counted() -> None:
        steps[0] += 1
        real()

    sched.step = counted  # type: ignore[method-assign]
    thread = threading.Thread(target=sched.run, daemon=True)
    thread.start()
    time.sleep(0.3)
    assert steps[0] == 0
    from kern.engine.request import Request

    sched.submit(Request([1, 2, 3], 3))
    assert done.wait(30)
    settled = steps[0]
    time.sleep(0.3)
    assert steps[0] == settled  # idle again: no step without work
    sched.stop()
    thread.join(5)
    assert not thread.is_alive()


# --- hypothesis: random traffic ------------------------------------------------------------


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    pool_pages=st.integers(4, 24),
    host_pages=st.sampled_from([0, 8, 64]),
    plan=st.lists(
        st.tuples(
            st.integers(0, 3),  # which base prompt (repeats share prefixes)
            st.integers(1, 20),  # prompt length
            st.integers(1, 8),  # max_tokens
            st.integers(1, 3),  # n choices
            st.integers(0, 4),  # steps to take before the next arrival
            st.booleans(),  # abort one open request at arrival
        ),
        min_size=1,
        max_size=8,
    ),
    step_tokens=st.sampled_from([3, 16, 512]),
)
def test_random_traffic_finishes_identical_and_leaks_nothing(
    tiny_dir, pool_pages, host_pages, plan, step_tokens
):
    engine = load(
        tiny_dir("qwen3"),
        pool_bytes=pool_pages * QWEN3_PAGE,
        host_bytes=host_pages * QWEN3_PAGE,
        page_tokens=PT,
    )
    h = Harness(engine, max_step_tokens=step_tokens)
    bases = [prompt(100 + i, 20) for i in range(4)]
    submitted = []
    aborted = set()
    for base, length, max_tokens, n, wait, abort in plan:
        if abort and h.open:
            victim = h.open[len(h.open) // 2]
            h.abort(victim)
            aborted.add(victim)
        for i in range(n):
            try:
                submitted.append(h.submit(bases[base][:length], max_tokens, index=i))
            except LimitError:
                assert length + max_tokens > pool_pages * PT
        for _ in range(wait):
            h.step()
    # Bounded: every request's tokens, a few steps each, plus the waits.
    h.run(max_steps=50 + 40 * len(submitted))
    for r in submitted:
        if r in aborted:
            assert h.finish_reason(r) in ("abort", "stop", "length")
            got = h.answer(r)
            assert got == h.expected(r.prompt_ids, r.max_tokens)[: len(got)]
        else:
            h.assert_identical(r)
    h.assert_idle_and_clean()


class RandomTraffic(RuleBasedStateMachine):
    """Arrivals, aborts and steps in any order on a random budget; after every rule the books
    balance and every finished answer equals ``generate``'s; at the end everything finishes
    within a bounded number of steps and nothing is left held."""

    def __init__(self) -> None:
        super().__init__()
        self.h: Harness | None = None
        self.bases = [prompt(300 + i, 16) for i in range(3)]
        self.aborted: set = set()
        self.submitted: list = []

    @initialize(
        pool_pages=st.integers(3, 20),
        host_pages=st.sampled_from([0, 6, 40]),
        step_tokens=st.sampled_from([2, 9, 512]),
        max_running=st.sampled_from([1, 3, 256]),
    )
    def start(self, pool_pages, host_pages, step_tokens, max_running):
        engine = load(
            default_model_path(),  # a qwen3 with the tiny one's page size
            pool_bytes=pool_pages * QWEN3_PAGE,
            host_bytes=host_pages * QWEN3_PAGE,
            page_tokens=PT,
        )
        self.pool_tokens = pool_pages * PT
        self.h = Harness(engine, max_step_tokens=step_tokens, max_running=max_running)

    @rule(
        base=st.integers(0, 2),
        length=st.integers(1, 16),
        max_tokens=st.integers(1, 6),
        n=st.integers(1, 3),
    )
    def arrive(self, base, length, max_tokens, n):
        assert self.h is not None
        for i in range(n):
            try:
                req = self.h.submit(self.bases[base][:length], max_tokens, index=i)
            except LimitError:
                assert length + max_tokens > self.pool_tokens
                return
            self.submitted.append(req)

    @rule(which=st.integers(0, 1000))
    def abort(self, which):
        assert self.h is not None
        if self.h.open:
            victim = self.h.open[which % len(self.h.open)]
            self.h.abort(victim)
            self.aborted.add(victim)

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        assert self.h is not None
        for _ in range(steps):
            self.h.step()

    @invariant()
    def finished_answers_are_identical(self):
        if self.h is None:
            return
        for r in self.submitted:
            if self.h.finished(r) and r not in self.aborted:
                self.h.assert_identical(r)

    def teardown(self):
        if self.h is None:
            return
        self.h.run(max_steps=50 + 30 * len(self.submitted))
        for r in self.submitted:
            got = self.h.answer(r)
            assert got == self.h.expected(r.prompt_ids, r.max_tokens)[: len(got)]
            if r not in self.aborted:
                self.h.assert_identical(r)
        self.h.assert_idle_and_clean()


def test_random_traffic_state_machine():
    run_state_machine_as_test(
        RandomTraffic, settings=settings(max_examples=15, stateful_step_count=12, deadline=None)
    )


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_moe"])
def test_random_traffic_other_families(tiny_dir, family):
    """A fixed random mix (seeded) on the stateful and the MoE family."""
    page = 4096 if family == "qwen3_5" else 2048
    chunk = 12288 if family == "qwen3_5" else page
    engine = load(tiny_dir(family), pool_bytes=12 * chunk, host_bytes=16 * chunk, page_tokens=PT)
    h = Harness(engine, max_step_tokens=8)
    rng = random.Random(7)
    bases = [prompt(200 + i, 24) for i in range(3)]
    reqs = []
    for _ in range(10):
        p = bases[rng.randrange(3)][: rng.randrange(2, 24)]
        reqs.append(h.submit(p, rng.randrange(1, 8), ignore_eos=True))
        for _ in range(rng.randrange(3)):
            h.step()
    h.run(max_steps=600)
    for r in reqs:
        h.assert_identical(r)
    assert page == h.engine.layout.page_bytes
    h.assert_idle_and_clean()


def test_the_scheduler_side_imports_no_torch():
    """The scheduler holds no tensor: it, the request, memory, the drafters and the sampling
    values import without torch (a fresh interpreter, so nothing imported it before)."""
    code = (
        "import sys\n"
        "import kern.engine.scheduler, kern.engine.request, kern.engine.memory\n"
        "import kern.engine.drafters, kern.engine.drafters.ngram, kern.engine.params\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
