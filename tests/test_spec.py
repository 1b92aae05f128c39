"""Speculative rows (kern.engine.scheduler with ``rows > 1``, kern.engine.drafters.ngram): every
family's answer at rows 5 is the rows-1 answer bit for bit, alone and in a batch, and ``kern run``'s
at rows 5; tokens accepted past a stop or ``max_tokens`` are never sent and leave nothing behind
(the recurrent state is rewound, so next turns hit the request-end snapshot every time); logits
processing that depends on earlier tokens is verified row by row; seeded sampling gives the rows-1
tokens, and the accept rule is standard speculative sampling for a point-mass draft."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import random
import re
import subprocess
import sys

import pytest
import torch
from support.scheduler import Harness, fresh, load, prompt, spec_counts

from kern.checkpoint.load import load_checkpoint
from kern.engine.drafters.ngram import NgramDrafter
from kern.engine.generate import generate
from kern.engine.params import SamplingParams
from kern.engine.request import DraftState
from kern.engine.sampler import sample
from kern.tiny import default_model_path

PT = 4
FAMILIES = ("qwen3", "qwen3_5", "qwen3_moe", "kimi_linear")
STATEFUL = ("qwen3_5", "kimi_linear")


@pytest.fixture(scope="module")
def engines(tiny_dir):
    made = {}

    def get(family: str):
        if family not in made:
            made[family] = load(tiny_dir(family), pool_bytes=8 * 2**20, page_tokens=PT)
        return made[family]

    return get


def test_ngram_drafter():
    d = NgramDrafter([1, 2, 3, 4, 1, 2])
    assert d.draft(3) == [3, 4, 1]  # after the latest earlier "1 2"
    assert d.draft(0) == []
    d.sync([1, 2, 3, 4, 1, 2, 9])
    assert d.draft(2) == []  # 9 never appeared before
    d.extend([1, 2])
    assert d.draft(2) == [9, 1]  # the latest "1 2" is now the one followed by 9
    # A loop shorter than k: the copy continues with the loop's period.
    assert NgramDrafter([7, 5, 5, 5]).draft(4) == [5, 5, 5, 5]
    assert NgramDrafter([1, 2, 3, 2, 3]).draft(5) == [2, 3, 2, 3, 2]
    with pytest.raises(ValueError, match="max_n"):
        NgramDrafter(max_n=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_rows_5_is_rows_1_alone_and_in_a_batch(engines, family):
    engine = engines(family)
    ckpt = engine.checkpoint
    h = fresh(engine, rows=5)
    p = prompt(1, 11)
    alone = h.submit(p, 48, ignore_eos=True)
    h.run()
    h.assert_identical(alone)  # generate at rows 1, alone
    assert h.answer(alone) == generate(ckpt, p, 48, rows=5, page_tokens=PT).ids  # kern run --rows 5
    reqs = [h.submit(prompt(i, 7 + 4 * i), 48 - 3 * i, ignore_eos=True) for i in range(6)]
    h.run()
    for r in reqs:
        h.assert_identical(r)
    drafted, accepted = spec_counts(h)
    # n-gram drafts were verified and some rejected (a tiny random model seldom repeats
    # itself: the tiny kimi_linear's answers here accept none; the oracle drafts below are
    # accepted in long runs on every family).
    assert drafted > 0 and accepted < drafted, (drafted, accepted)
    # Drafts that are mostly right (a tiny random model rarely repeats itself): full verify
    # chunks, in a batch with prefills and with each other.
    answers = {tuple(r.prompt_ids): h.answer(r) for r in reqs}
    oracle_drafts(h, answers, wrong_every=6)
    again = [h.submit(r.prompt_ids, r.max_tokens, ignore_eos=True) for r in reqs]
    h.run()
    for r in again:
        h.assert_identical(r)
    assert spec_counts(h)[1] - accepted > 100
    h.assert_idle_and_clean()


def oracle_drafts(h: Harness, answers: dict[tuple[int, ...], list[int]], wrong_every: int):
    """Replace the n-gram drafter with one that knows the rows-1 answer of each prompt in
    ``answers`` and drafts it (one draft in ``wrong_every`` off by one), ignoring max_tokens:
    long accepted runs, stops and lengths inside them, rejections at known places."""
    drafter = h.sched.drafter
    rows = drafter.rows

    def plan(req, room: int) -> tuple[int, int] | None:
        ans = answers.get(tuple(req.prompt_ids))
        if ans is None or req.num_output == 0 or room <= 0:
            return None
        out = ans[req.num_output : req.num_output + min(rows - 1, room)]
        if req.draft is None:
            req.draft = DraftState()
        req.draft.drafts = [
            t + 1 if (req.num_output + i) % wrong_every == 0 else t for i, t in enumerate(out)
        ]
        return len(out), len(out)

    drafter.plan = plan


@pytest.mark.parametrize("family", FAMILIES)
def test_nothing_past_a_stop_or_max_tokens(engines, family, caplog):
    """Drafts that are the answer itself: every token of it as a stop, and every length as
    max_tokens, lands inside an accepted run. The answer is the rows-1 answer cut there; the
    tokens accepted past the cut are never sent, and on the stateful families the request-end
    snapshot is where rows 1 leaves it: the next turn, sent as ids, resumes from it every time."""
    engine = engines(family)
    h = fresh(engine, rows=5)
    p = prompt(2, 9)
    ans = h.expected(p, 40, ignore_eos=True)
    oracle_drafts(h, {tuple(p): ans}, wrong_every=7)
    kern = logging.getLogger("kern")
    kern.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG, logger="kern")
    firsts = [j for j, t in enumerate(ans) if t not in ans[:j]]
    hits = 0
    try:
        for j in range(1, len(ans)):
            if j in firsts:
                req = h.submit(p, 40, stop_ids=frozenset([ans[j]]), ignore_eos=True)
                reason = "stop"
            else:
                req = h.submit(p, j + 1, ignore_eos=True)
                reason = "length"
            h.run()
            assert h.answer(req) == ans[: j + 1] and h.finish_reason(req) == reason, j
            if family in STATEFUL:
                nxt = h.submit(p + ans[: j + 1] + [7, 8], 6, ignore_eos=True)
                h.run()
                h.assert_identical(nxt)
                assert nxt.cached_tokens == len(p) + j  # all it has but its last token
                hits += 1
    finally:
        kern.removeHandler(caplog.handler)
    assert "accepted tokens after a 'stop' finish not sent" in caplog.text
    assert "accepted tokens after a 'length' finish not sent" in caplog.text
    drafted, accepted = spec_counts(h)
    assert 0 < accepted < drafted
    if family in STATEFUL:
        assert hits == len(ans) - 1
        print(f"next turns that hit the request-end snapshot: {hits} of {len(ans) - 1}")
    h.assert_idle_and_clean()


def test_next_turns_hit_the_snapshot_every_time(engines):
    """A speculative qwen3_5 conversation: each next turn (sent as ids) resumes from the state
    the last turn's request left, finished by length or by a stop alike."""
    engine = engines("qwen3_5")
    h = fresh(engine, rows=5)
    turn = prompt(3, 10)
    hits = 0
    for i in range(6):
        stop = frozenset()
        if i % 2:
            # A stop on a token the rows-1 answer produces mid-way.
            want = h.expected(turn, 24, ignore_eos=True)
            stop = frozenset([want[len(want) // 2]])
        req = h.submit(turn, 24, ignore_eos=True, stop_ids=stop)
        h.run()
        ans = h.answer(req)
        ref = h.expected(turn, 24, ignore_eos=True)
        cut = next((k + 1 for k, t in enumerate(ref) if t in stop), len(ref))
        assert ans == ref[:cut]
        if i:
            assert req.cached_tokens == len(turn) - len(prompt(100 + i, 3)) - 1
            hits += 1
        turn = turn + ans + prompt(100 + i + 1, 3)
    assert hits == 5
    drafted, accepted = spec_counts(h)
    assert accepted > 0
    print(f"snapshot hits: {hits} of 5 next turns; drafts accepted {accepted:.0f}/{drafted:.0f}")
    h.assert_idle_and_clean()


@pytest.mark.parametrize(
    "params,kw",
    [
        (SamplingParams(repetition_penalty=1.3, presence_penalty=0.4), {}),
        (SamplingParams(frequency_penalty=0.7, logit_bias=((5, 2.0),)), {"num_logprobs": 3}),
        (SamplingParams(), {"min_tokens": 20, "stop_ids": frozenset([1, 2, 3])}),
        (SamplingParams(temperature=0.9, top_p=0.9, seed=7), {}),
        (SamplingParams(temperature=1.3, top_k=20, seed=11), {"num_logprobs": 2}),
    ],
)
def test_processing_and_seeded_sampling_at_rows_5(engines, params, kw):
    """Penalties, bias, min_tokens (contexts that depend on earlier tokens: each verify row
    gets the context with the drafts before it), logprobs, and seeded sampling: the rows-5
    events equal the rows-1 events."""
    engine = engines("qwen3")
    got = {}
    answers: dict[tuple[int, ...], list[int]] = {}
    for rows in (1, 5):
        h = fresh(engine, rows=rows)
        if rows == 5:
            # Penalties keep answers from repeating, so n-grams rarely draft: draft the rows-1
            # answer instead (one draft in 4 wrong), to verify many rows per step.
            oracle_drafts(h, answers, wrong_every=4)
        reqs = [
            h.submit(prompt(40 + i, 9 + 4 * i), 36, params=params, ignore_eos=True, **kw)
            for i in range(3)
        ]
        h.run()
        got[rows] = [h.events[r] for r in reqs]
        answers = {tuple(r.prompt_ids): h.answer(r) for r in reqs}
        if rows == 5:
            drafted, accepted = spec_counts(h)
            assert 0 < accepted < drafted
        h.assert_idle_and_clean()
    assert got[5] == got[1]


def test_drafts_take_only_what_decode_rows_leave(engines):
    """A step budget of 6 tokens and four sequences decoding: each gets its token every step
    (the drafts fill what the decode rows leave, oldest first), none waits while others
    speculate."""
    engine = engines("qwen3")
    h = fresh(engine, rows=5, max_step_tokens=6)
    prompts = [prompt(60 + i, 5) for i in range(4)]
    answers = {tuple(p): h.expected(p, 30, ignore_eos=True) for p in prompts}
    oracle_drafts(h, answers, wrong_every=1000)
    reqs = [h.submit(p, 30, ignore_eos=True) for p in prompts]
    while not all(r.num_output for r in reqs):
        h.step()
    while h.open:
        before = [r.num_output for r in reqs]
        drafted = spec_counts(h)[0]
        decoding = len(h.sched._running)
        h.step()
        for r, n in zip(reqs, before, strict=True):
            assert r.num_output > n or n == r.max_tokens
        assert spec_counts(h)[0] - drafted <= 6 - decoding
    for r in reqs:
        h.assert_identical(r)
    assert spec_counts(h)[1] > 0
    h.assert_idle_and_clean()


class _Grammar:
    """A stand-in matcher: allows everything, records what it was fed."""

    def __init__(self) -> None:
        self.fed: list[int] = []

    def apply(self, logits) -> None:
        pass

    def accept(self, token: int) -> bool:
        self.fed.append(token)
        return True


def test_a_grammar_decodes_one_row_at_a_time(engines):
    """A grammar's matcher advances with each token: its request is verified at rows 1 (no
    drafts), while others in the batch still speculate."""
    engine = engines("qwen3")
    h = fresh(engine, rows=5)
    p = prompt(1, 11)
    g = _Grammar()
    a = h.submit(p, 30, ignore_eos=True, grammar=g)
    h.run()
    assert spec_counts(h) == (0, 0)
    h.assert_identical(a)
    assert g.fed == h.answer(a)
    b = h.submit(p, 30, ignore_eos=True)
    h.run()
    assert spec_counts(h)[0] > 0
    h.assert_identical(b)
    h.assert_idle_and_clean()


def test_accepting_the_target_draw_is_speculative_sampling():
    """On a 4-token vocabulary: a draft d (a point mass, q(d) = 1) accepted iff the target's
    own draw equals it is accepted with probability min(1, p(d)/q(d)) = p(d), and a rejection
    yields the residual norm(max(0, p - q)), i.e. p without d; so every emitted token is
    distributed as p (chi-square over 20000 seeded draws, df 3, p = 0.001: 16.27)."""
    logits = torch.tensor([[1.2, 0.1, -0.5, 0.7]])
    p = torch.softmax(logits[0].double(), 0)
    n, draft = 20000, 3
    out = torch.zeros(4)
    rejected = torch.zeros(4)
    accepted = 0
    for seed in range(n):
        params = SamplingParams(temperature=1.0, seed=seed)
        tok = sample(logits, [params], [0])[0]
        out[tok] += 1
        if tok == draft:
            accepted += 1
        else:
            rejected[tok] += 1

    def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
        expected = probs * counts.sum()
        return float(((counts.double() - expected) ** 2 / expected).sum())

    assert chi2(out, p) < 16.27
    residual = p.clone()
    residual[draft] = 0
    keep = residual > 0
    assert chi2(rejected[keep], residual[keep] / residual.sum()) < 13.82  # df 2
    # Acceptance: within 4 standard deviations of p(d).
    sd = (p[draft] * (1 - p[draft]) / n) ** 0.5
    assert abs(accepted / n - float(p[draft])) < 4 * sd


# --- served -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from support.server import Server

    s = Server(
        tmp_path_factory.mktemp("spec"),
        "spec",
        pool_bytes="16MiB",
        model=default_model_path(),
        extra=("--rows", "5"),
    )
    yield s
    s.close()


def test_served_at_rows_5_is_kern_run_at_rows_5_and_1(served):
    """Over HTTP, one at a time and eight at once: the served ids are kern run's at rows 5
    and at rows 1; the counters moved; nothing is held afterwards."""
    ckpt = load_checkpoint(default_model_path())
    tok = ckpt.tokenizer
    prompts = [tok.encode(f"Request {i}: the weather" + " is sunny" * i) for i in range(8)]
    eos = set(tok.eos_token_ids)

    def kern_run(p: list[int], rows: int) -> list[int]:
        ids = generate(ckpt, p, 40, rows=rows, page_tokens=16, threads=2).ids
        cut = next((n + 1 for n, t in enumerate(ids) if t in eos), len(ids))
        return ids[:cut]

    assert "rows 5 (the last token and 4 n-gram drafts)" in served.output()
    first = served.complete(prompts[0], 40)["choices"][0]["token_ids"]
    assert first == kern_run(prompts[0], 5) == kern_run(prompts[0], 1)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: served.complete(p, 40), prompts))
    for p, out in zip(prompts, outs, strict=True):
        got = out["choices"][0]["token_ids"]
        assert got == kern_run(p, 5) == kern_run(p, 1)
    m = served.metrics()
    drafted = m["kern_spec_decode_num_draft_tokens_total"]
    accepted = m["kern_spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted <= drafted and m["kern_spec_decode_num_drafts_total"] > 0
    print(f"served at rows 5: {accepted:.0f} of {drafted:.0f} drafts accepted")
    served.assert_no_leak()


def test_kern_bench_reports_the_acceptance_rate(served):
    out = subprocess.run(
        [sys.executable, "-m", "kern.cli", "bench", "--url", served.url, "--api-key", "test-key"]
        + ["--concurrency", "2", "--requests", "2", "--prompt-tokens", "16", "--json"]
        + ["--shared-prefix", "0", "--max-tokens", "32"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    table, js = out.stdout.strip().rsplit("\n", 1)
    assert "| cached | accept |" in table and "Draft acceptance rate:" in table
    (row,) = json.loads(js)
    assert row["draft_tokens"] > 0 and 0 <= row["acceptance"] <= 1
    assert row["acceptance"] == row["accepted_tokens"] / row["draft_tokens"]


def test_rows_under_hypercorn_come_from_kern_rows(tmp_path, monkeypatch):
    from kern.errors import UsageError
    from kern.server.settings import Settings

    toml = tmp_path / "kern.toml"
    toml.write_text(f'[targets.t]\ncheckpoint = "{default_model_path()}"\nrows = [1, 4]\n')
    monkeypatch.setenv("KERN_CONFIG", str(toml))
    monkeypatch.setenv("KERN_TARGET", "t")
    assert Settings.from_env().target.decode_rows == 4  # the widest by default
    for rows, want in (("1", 1), ("4", 4)):
        monkeypatch.setenv("KERN_ROWS", rows)
        assert Settings.from_env().target.decode_rows == want
    for rows, message in (("x", "KERN_ROWS='x' is not a positive integer"),
                          ("3", "KERN_ROWS 3: target 't' declares rows [1, 4]")):  # fmt: skip
        monkeypatch.setenv("KERN_ROWS", rows)
        with pytest.raises(UsageError, match=re.escape(message)):
            Settings.from_env()


def test_the_benchmarks_loop_rules():
    """kern.bench.spec measures answers that repeat themselves: an exact loop keeps one period
    of at most 8 tokens; a loose one only few distinct ids."""

    from kern.bench.spec import _loop_start

    periodic = [9, 8, 7, 6, 5] + [1, 2, 3] * 20
    assert _loop_start(periodic, True) == 5
    assert _loop_start(periodic, False) == 4  # {5, 1, 2, 3}: four distinct ids are a loop
    rng = random.Random(0)
    two_ids = [9, 8, 7] + [rng.choice((1, 2)) for _ in range(64)]
    assert _loop_start(two_ids, True) is None
    assert _loop_start(two_ids, False) == 1  # {8, 7, 1, 2}
    assert _loop_start(list(range(100)), True) is None
    assert _loop_start(list(range(100)), False) is None
