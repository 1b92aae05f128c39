"""gpt-oss's window pages (kern.models.gpt_oss.pages): its sliding layers keep their K/V in window
pages, so a running sequence holds its full layers' pages and one window, measured from the
pool; it gives window pages back as it goes, in prefill chunks and in decode; speculative rows
keep theirs until the round settles; a hit resumes at a snapshot, exact; seeded traffic on
small pools answers as kern run; a budget that cannot hold a window is refused by name."""

from __future__ import annotations

import pytest
from support.scheduler import Harness, load, prompt
from support.window_traffic import drafts_across_windows, held, random_traffic, windows_follow

from kern.arith import cdiv
from kern.engine.load import Engine
from kern.errors import UsageError
from kern.kern_toml import Target
from kern.models.gpt_oss.pages import window_page_tokens

WINDOW = window_page_tokens(8)  # the tiny model's window (8) as its window pages hold it


def test_window_pages_hold_a_whole_window_in_a_power_of_two():
    assert WINDOW == 16
    assert [window_page_tokens(w) for w in (1, 3, 16, 17, 100, 128)] == [16, 16, 16, 32, 128, 128]


def test_a_running_sequence_holds_its_full_layers_pages_and_two_window_pages(tiny_dir):
    """At 1,536 tokens, the model run for real: the pool holds the full layers' pages of the
    prompt and two window pages, nothing more (a page holds the full layers only, half of what
    one holding every layer did); the answer is kern run's."""
    engine = load(tiny_dir("gpt_oss"), pool_bytes=8 * 2**20, page_tokens=16, snapshot_pages=10**6)
    c, layout = engine.checkpoint.config, engine.layout
    h = Harness(engine, max_step_tokens=512)
    n = 1536  # chunk ends: the prompt-end snapshot (at n + 39) is not taken yet
    req = h.submit(prompt(1, n + 40), 3, ignore_eos=True)
    while req.num_computed < n:
        h.step()
        assert len(held(req)) <= 2, held(req)
    s = h.cache.stats()
    assert s.resident_pages == 0 and s.resident_states == 0
    assert s.pages_used == len(req.block_table) == cdiv(n + 40, 16)
    assert s.slots_used == 2
    per_layer_token = 2 * c.num_key_value_heads * c.head_dim * 4
    assert layout.page_bytes == 2 * 16 * per_layer_token  # 2 full layers of 4
    assert layout.state_bytes == 2 * WINDOW * per_layer_token  # 2 sliding layers
    h.run()
    h.assert_identical(req)
    h.assert_idle_and_clean()


def test_window_pages_are_given_back_in_prefill_chunks_and_decode(tiny_dir):
    """After every step a request holds exactly the window pages its next row reads (the
    last window's); the answer is kern run's."""
    windows_follow(load(tiny_dir("gpt_oss"), pool_bytes=2**20, page_tokens=4), WINDOW)


def test_speculative_rows_keep_their_window_across_a_page_given_back(tiny_dir):
    """n-gram drafts through the scheduler on a repetitive prompt: rounds cross window pages,
    some drafts are rejected, and the answer is rows 1's."""
    drafts_across_windows(load(tiny_dir("gpt_oss"), pool_bytes=2**20, page_tokens=4), 55)


@pytest.mark.parametrize("snapshot_pages", [1, 2])
def test_a_repeated_prefix_resumes_at_a_snapshot_exactly(tiny_dir, snapshot_pages):
    """A second prompt sharing 50 tokens resumes at the last snapshot in them, and answers as
    kern run does."""
    engine = load(
        tiny_dir("gpt_oss"), pool_bytes=2**20, page_tokens=4, snapshot_pages=snapshot_pages
    )
    h = Harness(engine)
    base = prompt(7, 50)
    first = h.submit(base + prompt(8, 5), 6, ignore_eos=True)
    h.run()
    second = h.submit(base + prompt(9, 7), 6, ignore_eos=True)
    h.run()
    for r in (first, second):
        h.assert_identical(r)
    # Snapshots sit every snapshot_pages pages that also end a window page (16 positions).
    every = snapshot_pages * 16
    assert second.cached_tokens == 50 // every * every
    h.assert_idle_and_clean()


def test_a_budget_without_room_for_a_window_is_refused_by_name(tiny_dir):
    """Too small for the slots the pool keeps, or for a page beside them: one line each."""
    folder = tiny_dir("gpt_oss")
    for pool_bytes in (6_000, 20_000, 30_000):
        target = Target(name="t", checkpoint=folder, pool_bytes=pool_bytes, page_tokens=4)
        with pytest.raises(UsageError, match="window pages"):
            Engine.load(target)


@pytest.mark.parametrize(
    ("pool_bytes", "host_bytes", "step_tokens", "seed", "answers"),
    [
        (100_000, 120_000, 5, 2, 12),  # hits, parks and wakes
        (80_000, 0, 16, 4, 40),  # hits, preempts and drops
        (72_000, 100_000, 8, 7, 40),  # hits, preempts, parks and wakes
    ],
)
def test_random_traffic_on_window_pages(
    tiny_dir, pool_bytes, host_bytes, step_tokens, seed, answers
):
    """A seeded mix of shared prefixes, repeats, aborts and n-gram drafts on pools small
    enough to evict, park and preempt: every answer is kern run's, the books balance after
    every step (window pages counted as the requests' own), nothing hangs and nothing is left
    held."""
    engine = load(tiny_dir("gpt_oss"), pool_bytes=pool_bytes, host_bytes=host_bytes, page_tokens=4)
    random_traffic(
        engine, step_tokens=step_tokens, seed=seed, answers=answers, host_bytes=host_bytes
    )


def test_the_released_bytes_are_the_full_layers_and_one_window():
    """``python -m kern.bench.gpt_oss``'s bytes (checked against their formula inside
    ``bytes_rows``): a 128k-token sequence of gpt-oss-20b holds 3.01 GiB, not 6.00."""
    from kern.bench.gpt_oss import bytes_rows

    rows = [r.split(" | ") for r in bytes_rows()[2:]]
    assert [r[0] for r in rows] == ["| gpt-oss-20b", "| gpt-oss-120b"]
    assert [(r[1], r[3], r[4], r[5], r[6]) for r in rows] == [
        ("24,576", "3.00 MiB", "6.00 GiB", "3.01 GiB", "1.001"),
        ("36,864", "4.50 MiB", "9.00 GiB", "4.51 GiB", "1.001"),
    ]


def test_window_step_lists_only_the_window_pages_a_chunk_reads():
    """Two chunks of different lengths: each table row holds -1 before the first window page
    its rows read and past its own pages; each row's slot is in its window page."""
    import torch

    from kern.batch import build_step, window_step
    from kern.chunk import SeqChunk

    a = SeqChunk([1, 2, 3], 40, list(range(11)), window=[3, 7, 9])  # 3: given back
    b = SeqChunk([4], 3, [0], window=[5])
    step = build_step([a, b], 4, torch.device("cpu"))
    w = window_step(step, [a, b], 16)
    assert w.block_tables.tolist() == [[-1, 7, 9], [5, -1, -1]]
    assert w.slot_mapping.tolist() == [9 * 16 + 8, 9 * 16 + 9, 9 * 16 + 10, 5 * 16 + 3]
    assert w.q_starts == step.q_starts and w.ctx_lens == step.ctx_lens
