"""Draft checkpoints (kern.engine.drafters.model, the scheduler's model drafts): for every target
family, the answer at rows 5 with a draft model (stateless qwen3, or stateful qwen3_5, whose state
is rolled back after a rejection) is the rows-1 answer bit for bit, alone and in a batch, and ``kern
run``'s at rows 5 with the same draft; seeded sampling too. The draft's pages and slots come from
the target's pool (counted while a request runs, all back after it ends, is aborted or loses them to
a tight pool), and what kern cannot run is refused by name at load: another tokenizer (naming both
files), another vocabulary size, a draft whose KV per token does not fit the target's page, several
ranks."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
from pathlib import Path

import pytest
from support.scheduler import draft_of, fresh, prompt, spec_counts

from kern.checkpoint.load import load_checkpoint
from kern.engine.generate import generate
from kern.engine.load import Engine
from kern.engine.params import SamplingParams
from kern.errors import UsageError
from kern.kern_toml import Target
from kern.tiny import make_tiny

PT = 4
FAMILIES = ("qwen3", "qwen3_5", "qwen3_moe")


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    """A 1-layer qwen3 draft of seed 1: the same embedding, first layer and head as the seed-1
    qwen3 targets (make_tiny seeds each tensor by its name), so it agrees with them often."""
    return make_tiny("qwen3", tmp_path_factory.mktemp("draft"), seed=1, layers=1)


def target(checkpoint: Path, draft: Path | str, **kw) -> Target:
    kw.setdefault("pool_bytes", 8 * 2**20)
    return Target(
        name="t",
        checkpoint=checkpoint,
        page_tokens=PT,
        rows=(1, 5),
        draft=str(draft),
        origin={"draft": "kern.toml: targets.t.draft"},
        **kw,
    )


@pytest.fixture(scope="module")
def stateful_draft_dir(tmp_path_factory) -> Path:
    """A 2-layer qwen3_5 draft (one linear-attention layer, one full-attention layer)."""
    return make_tiny("qwen3_5", tmp_path_factory.mktemp("draft5"), seed=1, layers=2)


@pytest.fixture(scope="module")
def moe_draft_dir(tmp_path_factory) -> Path:
    """A 1-layer qwen3_moe draft (routed experts)."""
    return make_tiny("qwen3_moe", tmp_path_factory.mktemp("draftmoe"), seed=1, layers=1)


@pytest.fixture(scope="module")
def draft_dirs(draft_dir, stateful_draft_dir, moe_draft_dir) -> dict[str, Path]:
    return {"qwen3": draft_dir, "qwen3_5": stateful_draft_dir, "qwen3_moe": moe_draft_dir}


@pytest.fixture(scope="module")
def engines(tiny_dir, draft_dirs):
    made = {}

    def get(family: str, draft: str = "qwen3") -> Engine:
        if (family, draft) not in made:
            made[family, draft] = Engine.load(target(tiny_dir(family), draft_dirs[draft]))
        return made[family, draft]

    return get


@pytest.mark.parametrize("draft_family", FAMILIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_rows_5_with_a_draft_is_rows_1_alone_and_in_a_batch(
    engines, draft_dirs, family, draft_family
):
    engine = engines(family, draft_family)
    draft = engine.drafting.runner
    assert draft is not None
    assert draft.stateful == (draft_family == "qwen3_5")
    # One pool page holds one draft page of page_tokens * 2^m tokens.
    assert draft.page_tokens >= PT
    assert draft.layout.page_bytes <= engine.layout.page_bytes
    ckpt, draft = engine.checkpoint, load_checkpoint(draft_dirs[draft_family])
    h = fresh(engine, rows=5)
    p = prompt(1, 11)
    alone = h.submit(p, 48, ignore_eos=True)
    h.run()
    h.assert_identical(alone)  # generate at rows 1, alone
    run5 = generate(ckpt, p, 48, rows=5, page_tokens=PT, draft=draft)
    assert h.answer(alone) == run5.ids  # kern run --rows 5 with the draft
    n = 6 if draft_family == "qwen3" else 4
    reqs = [h.submit(prompt(i, 7 + 4 * i), 48 - 3 * i, ignore_eos=True) for i in range(n)]
    h.run()
    for r in reqs:
        h.assert_identical(r)
    drafted, accepted = spec_counts(h)
    assert 0 < accepted < drafted, (drafted, accepted)
    print(f"{family}, {draft_family} draft: {accepted:.0f} of {drafted:.0f} accepted")
    h.assert_idle_and_clean()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.3, top_p=0.9, seed=7),
        SamplingParams(temperature=0.5, top_k=20, seed=11, repetition_penalty=1.2),
    ],
)
def test_seeded_sampling_with_a_draft_is_rows_1(engines, params):
    """The draft is greedy, a point mass: a draft is accepted iff the target's own draw at
    that row equals it, which is speculative sampling (tests/test_spec.py checks the rule
    statistically); with seeded draws the rows-5 events equal the rows-1 events."""
    engine = engines("qwen3")
    got = {}
    for rows in (1, 5):
        h = fresh(engine, rows=rows)
        reqs = [
            h.submit(prompt(40 + i, 9 + 4 * i), 36, params=params, ignore_eos=True, num_logprobs=2)
            for i in range(3)
        ]
        h.run()
        got[rows] = [h.events[r] for r in reqs]
        if rows == 5:
            drafted, accepted = spec_counts(h)
            assert 0 < accepted < drafted, (drafted, accepted)
        h.assert_idle_and_clean()
    assert got[5] == got[1]


def test_draft_pages_come_from_the_pool_and_go_back(engines):
    """While a request decodes, its draft pages are pool pages it holds (the pool's books and
    gauges count them); when it ends they are free again, and so when one is aborted
    mid-stream."""
    engine = engines("qwen3")
    h = fresh(engine, rows=5)
    start = engine.cache.stats().pages_free
    r = h.submit(prompt(3, 30), 40, ignore_eos=True)
    while not draft_of(r).table:
        h.step()
    s = engine.cache.stats()
    held = len(r.block_table) + len(draft_of(r).table)
    assert s.pages_used - s.resident_pages <= held
    assert s.pages_free == start - s.pages_used
    assert h.sched.metrics.gauges["kern_pool_pages_held"] == s.pages_used - s.resident_pages
    # The draft saw the whole prompt (its prefill) and every token since.
    assert draft_of(r).computed >= len(r.prompt_ids)
    h.run()
    assert not draft_of(r).table
    h.assert_idle_and_clean()
    assert engine.cache.stats().pages_free == start

    a = h.submit(prompt(4, 30), 400, ignore_eos=True)
    b = h.submit(prompt(5, 20), 400, ignore_eos=True)
    while not (draft_of(a).table and draft_of(b).table):
        h.step()
    h.abort(a)
    h.step()
    assert h.finish_reason(a) == "abort" and not draft_of(a).table
    h.abort(b)
    h.step()
    assert h.finish_reason(b) == "abort"
    h.assert_idle_and_clean()
    assert engine.cache.stats().pages_free == start


def test_the_drafts_prefill_counts_against_the_step_budget(engines):
    """max_step_tokens 8: a 40-token prompt's draft prefill is done over several steps (the
    request decodes one row meanwhile), what the draft computes in a step staying within the
    budget; the answers are the rows-1 answers."""
    engine = engines("qwen3")
    h = fresh(engine, rows=5, max_step_tokens=8)
    reqs = [h.submit(prompt(80 + i, 40), 30, ignore_eos=True) for i in range(2)]
    draft = h.sched.drafter.sampler.runner
    forward = draft.forward
    sizes: list[int] = []

    def counted(batch):
        sizes.append(sum(len(c.token_ids) for c in batch))
        return forward(batch)

    draft.forward = counted
    partial = set()
    try:
        while h.open:
            sizes.clear()
            h.step()
            # The first draft forward of a step is the catch-up (each later one is a row a
            # request): within the budget.
            assert not sizes or sizes[0] <= 8, sizes
            partial.update(draft_of(r).computed for r in reqs if 0 < draft_of(r).computed < 40)
    finally:
        del draft.forward
    assert len(partial) >= 2, partial  # the prompt went into the draft in pieces
    for r in reqs:
        h.assert_identical(r)
    assert spec_counts(h)[1] > 0
    h.assert_idle_and_clean()


@pytest.mark.parametrize("draft_family", ["qwen3", "qwen3_5"])
def test_a_tight_pool_serves_every_request_identically(
    tiny_dir, draft_dir, stateful_draft_dir, draft_family
):
    """A pool of a few dozen pages for eight requests: target pages come first (draft pages
    and slots are dropped for them, a request whose draft pages cannot be had decodes one
    row), nobody deadlocks, every answer is the rows-1 answer and every page and slot comes
    back. With the stateful draft, the stateless target's pool has slots for it."""
    folder = draft_dir if draft_family == "qwen3" else stateful_draft_dir
    engine = Engine.load(target(tiny_dir("qwen3"), folder, pool_bytes=96 * 2**10))
    if draft_family == "qwen3_5":
        assert engine.cache.stats().slot_capacity >= 2 and not engine.runner.stateful
    h = fresh(engine, rows=5)
    total = engine.cache.stats().pages_free
    assert total < 64, total
    seen = {"dropped": 0, "refused": 0}
    memory = h.sched.memory
    drop, alloc = memory.drop_drafts, memory.take_draft_pages

    def counted_drop() -> bool:
        dropped = drop()
        seen["dropped"] += dropped
        return dropped

    def counted_alloc(n: int):
        pages = alloc(n)
        seen["refused"] += pages is None
        return pages

    memory.drop_drafts = counted_drop
    memory.take_draft_pages = counted_alloc
    reqs = [h.submit(prompt(70 + i, 9 + 5 * i), 60, ignore_eos=True) for i in range(8)]
    most = 0
    while h.open:
        h.step()
        most = max(most, sum(len(draft_of(r).table) for r in h.sched._running))
    for r in reqs:
        h.assert_identical(r)
    assert most > 0 and spec_counts(h)[1] > 0
    # Both rules ran: draft pages given up for target pages, and drafting skipped for want
    # of pages.
    assert seen["dropped"] > 0 and seen["refused"] > 0, seen
    h.assert_idle_and_clean()


# --- refused at load --------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_another_tokenizer_is_refused_naming_both_files(tiny_dir, draft_dir, tmp_path):
    other = _copy(draft_dir, tmp_path / "other")
    tok_file = other / "tokenizer.json"
    raw = json.loads(tok_file.read_text(encoding="utf-8"))
    vocab = raw["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    tok_file.write_text(json.dumps(raw), encoding="utf-8")
    t = tiny_dir("qwen3")
    with pytest.raises(UsageError) as e:
        Engine.load(target(t, other))
    msg = str(e.value)
    assert "kern.toml: targets.t.draft" in msg and "tokenizer differs" in msg
    assert str(t / "tokenizer.json") in msg and str(tok_file) in msg


def test_what_kern_cannot_run_is_refused_by_name(tiny_dir, draft_dir, tmp_path):
    t = tiny_dir("qwen3")
    cases = [
        (make_tiny("qwen3", tmp_path / "v", seed=1, layers=1, vocab=400), {}, "vocab_size 400"),
        # 4 layers of the target's width: twice its KV per token.
        (make_tiny("qwen3", tmp_path / "w", seed=1, layers=4), {}, "does not fit the target's"),
        (draft_dir, {"ranks": 2}, "a draft checkpoint with ranks = 2 is not supported"),
        (tmp_path / "missing", {}, "no such checkpoint folder"),
    ]
    for draft, kw, message in cases:
        with pytest.raises(UsageError, match="kern.toml: targets.t.draft") as e:
            Engine.load(target(t, draft, **kw))
        assert message in str(e.value), str(e.value)


# --- served -------------------------------------------------------------------------------


def test_served_with_a_draft_is_kern_run_at_rows_5_and_1(tmp_path, tiny_dir, draft_dir):
    """Over HTTP, one at a time and six at once: a target with a draft checkpoint answers as
    kern run does at rows 5 (with the draft) and at rows 1; a client hanging up mid-stream
    frees its draft pages with the rest."""
    from support.server import KEY, MODEL, Server

    ckpt_dir = tiny_dir("qwen3")
    toml = tmp_path / "kern.toml"
    toml.write_text(
        f'[targets.{MODEL}]\ncheckpoint = "{ckpt_dir}"\npool_bytes = "4MiB"\n'
        f'rows = [1, 5]\ndraft = "{draft_dir}"\n'
    )
    import sys

    command = [sys.executable, "-m", "kern.cli", "serve", "--port", "{port}"]
    s = Server(
        tmp_path,
        "draft",
        pool_bytes="4MiB",
        command=[*command, "--config", str(toml), "--target", MODEL],
        key=KEY,
    )
    try:
        assert f"drafts of {draft_dir}, its pages from the same pool" in s.output()
        ckpt, draft = load_checkpoint(ckpt_dir), load_checkpoint(draft_dir)
        eos = set(ckpt.tokenizer.eos_token_ids)

        def kern_run(p: list[int], rows: int) -> list[int]:
            ids = generate(ckpt, p, 40, rows=rows, page_tokens=16, threads=2, draft=draft).ids
            cut = next((n + 1 for n, t in enumerate(ids) if t in eos), len(ids))
            return ids[:cut]

        prompts = [prompt(90 + i, 6 + 3 * i) for i in range(6)]
        first = s.complete(prompts[0], 40)["choices"][0]["token_ids"]
        assert first == kern_run(prompts[0], 5) == kern_run(prompts[0], 1)
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            outs = list(pool.map(lambda p: s.complete(p, 40), prompts))
        for p, out in zip(prompts, outs, strict=True):
            assert out["choices"][0]["token_ids"] == kern_run(p, 5) == kern_run(p, 1)
        m = s.metrics()
        drafted = m["kern_spec_decode_num_draft_tokens_total"]
        accepted = m["kern_spec_decode_num_accepted_tokens_total"]
        assert 0 < accepted < drafted
        print(f"served with a draft: {accepted:.0f} of {drafted:.0f} draft tokens accepted")
        s.assert_no_leak()
        # A hang-up mid-stream is an abort that frees the draft pages too. The server may have
        # written the whole answer into the socket's buffers before the hang-up reached it (no
        # backpressure below a few MB on loopback): then it ended by length, and we hang up
        # on another one, until an abort is seen.
        body = {"model": MODEL, "prompt": prompts[1], "max_tokens": 2000, "ignore_eos": True}
        abort = 'kern_request_success_total{finished_reason="abort"}'
        length = 'kern_request_success_total{finished_reason="length"}'
        for _ in range(5):
            m0 = s.idle_metrics()
            with s.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n == 8:
                        break
            m = s.idle_metrics()
            s.assert_no_leak()
            if m[abort] == m0[abort] + 1:
                break
            assert m[length] == m0[length] + 1, "the hung-up request neither aborted nor ended"
        else:
            raise AssertionError("no hang-up of 5 was counted as an abort")
        s.assert_no_leak()
    finally:
        s.close()
