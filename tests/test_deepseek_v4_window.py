"""DeepSeek-V4's window pages (kern.engine.window_pages): a running sequence holds its
compressed entries and one window, measured from the pool at 64k tokens; it gives window pages
back as it goes, in prefill chunks and in decode; speculative rows keep theirs until the round
settles; a budget that cannot hold a sequence's window is refused by name."""

from __future__ import annotations

import pytest
import torch
from support.scheduler import Harness, load, prompt
from support.variants import build
from support.window_traffic import drafts_across_windows, held, random_traffic, windows_follow

from kern.engine.load import Engine
from kern.errors import UsageError
from kern.kern_toml import Target

WINDOW = 8  # the tiny sliding window


@pytest.fixture(scope="module")
def hca128(tmp_path_factory):
    """A sliding and an HCA layer (rate 128: with pages of 128, one entry a page, the
    formula's d / m a token), small enough to prefill thousands of tokens in seconds."""
    return build(
        tmp_path_factory.mktemp("hca128"),
        "deepseek_v4",
        dict(layers=2, hidden=32, head_dim=32, experts=2, moe_intermediate=16),
        dict(
            layer_types=["sliding_attention", "heavily_compressed_attention"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
            max_position_embeddings=1 << 21,
        ),
    )


def running_bytes(h: Harness, req, n: int) -> tuple[int, int]:
    """Step ``req``'s prefill to ``n`` tokens (never a snapshot: the tree stays empty, so
    every page and slot in use is the sequence's); its bytes from the pool's counters, and
    the formula's: the compressed entries and one window of both layers, float32."""
    cache, layout = h.cache, h.engine.layout
    while req.num_computed < n:
        h.step()
        assert len(held(req)) <= 2, held(req)
    assert req.num_computed == n
    s = cache.stats()
    assert s.resident_pages == 0 and s.resident_states == 0
    measured = s.pages_used * layout.page_bytes + s.slots_used * cache.device.slot_stride
    d, item = h.engine.checkpoint.config.head_dim, 4
    return measured, n * d * item // 128 + 2 * WINDOW * d * item


def test_a_running_sequence_holds_its_pages_and_two_window_pages(hca128):
    """At 8k tokens, the model run for real: the pool holds the prompt's pages and two window
    pages (the last window and the page being written, or a spare), nothing more; the answer
    is kern run's."""
    engine = load(hca128, pool_bytes=8 * 2**20, page_tokens=128, snapshot_pages=10**6)
    h = Harness(engine, max_step_tokens=2048)
    n = 8192
    req = h.submit(prompt(1, n + 100), 3, ignore_eos=True)
    running_bytes(h, req, n)
    s = h.cache.stats()
    assert s.pages_used == len(req.block_table) == -(-(n + 100) // 128)
    assert s.slots_used == 2
    h.run()
    h.assert_identical(req)
    h.assert_idle_and_clean()


@pytest.mark.parametrize("n", [65_536, 1 << 20])
def test_the_books_hold_entries_and_one_window_at_64k_and_1m(hca128, monkeypatch, n):
    """At 64k and 1M tokens the pool's pages and slots in use are within 1.2x of the
    compressed entries plus one window, with the forward's arithmetic stubbed out (the books
    and the window tables are the scheduler's and the runner's own, checked every step; the
    numbers the layers compute take no part in what is held)."""
    engine = load(hca128, pool_bytes=64 * 2**20, page_tokens=128, snapshot_pages=10**6)
    runner = engine.runner
    vocab = engine.checkpoint.config.vocab_size

    def logits(batch, inputs=None):
        rows = sum({"last": 1, "all": len(c.token_ids), "none": 0}[c.logits] for c in batch)
        return torch.zeros(rows, vocab)

    monkeypatch.setattr(runner, "forward_eager", logits)
    h = Harness(engine, max_step_tokens=8192)
    req = h.submit(prompt(2, n + 100), 1, ignore_eos=True)
    measured, formula = running_bytes(h, req, n)
    assert measured <= 1.2 * formula, (measured, formula)
    h.run()
    h.assert_idle_and_clean()


def test_window_pages_are_given_back_in_prefill_chunks_and_decode(tiny_dir):
    """After every step a request holds exactly the window pages its next row reads (the
    last window's); the answer is kern run's."""
    windows_follow(load(tiny_dir("deepseek_v4"), pool_bytes=2**20, page_tokens=4), WINDOW)


def test_speculative_rows_keep_their_window_across_a_page_given_back(tiny_dir):
    """n-gram drafts through the scheduler on a repetitive prompt, window pages of 8: rounds
    cross window pages, some drafts are rejected, and the answer is rows 1's."""
    drafts_across_windows(load(tiny_dir("deepseek_v4"), pool_bytes=2**20, page_tokens=4), 41)


def test_a_budget_without_room_for_a_window_is_refused_by_name(tiny_dir):
    """Too small for the slots the pool keeps, or for a page beside them: one line each."""
    folder = tiny_dir("deepseek_v4")
    for pool_bytes in (20_000, 60_000):
        target = Target(name="t", checkpoint=folder, pool_bytes=pool_bytes, page_tokens=4)
        with pytest.raises(UsageError, match="window pages"):
            Engine.load(target)


@pytest.mark.parametrize(
    ("pool_bytes", "host_bytes", "step_tokens", "seed", "answers"),
    [
        (300_000, 400_000, 5, 2, 12),  # hits, parks and wakes
        (200_000, 0, 16, 6, 40),  # hits, preempts and drops
        (180_000, 300_000, 8, 7, 40),  # hits, preempts, parks and wakes
    ],
)
def test_random_traffic_on_window_pages(
    tiny_dir, pool_bytes, host_bytes, step_tokens, seed, answers
):
    """A seeded mix of shared prefixes, repeats, aborts and n-gram drafts on pools small
    enough to evict, park and preempt, where a hit's locked path pins most snapshots: every
    answer is kern run's, the books balance after every step (window pages counted as the
    requests' own), nothing hangs and nothing is left held."""

    engine = load(
        tiny_dir("deepseek_v4"), pool_bytes=pool_bytes, host_bytes=host_bytes, page_tokens=4
    )
    random_traffic(
        engine, step_tokens=step_tokens, seed=seed, answers=answers, host_bytes=host_bytes
    )
