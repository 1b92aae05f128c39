"""The CPU attention's fast path gives the plain formulation's bits (kern.backend.cpu_attention,
"Speed without new bits"): key chunks, masks from the first hiding block only, the values
matmul over probabilities read in place, the in-place block tree, and the chunked path for
many keys against the one-pass one. Each is switched off in turn and every output bit
compared, over random batches of decode rows, verify rows and prefill tiles, short and long
contexts, GQA and latent pages."""

from __future__ import annotations

import random

import pytest
import torch

from kern.backend import cpu_attention as attention
from kern.backend import cpu_attention_plan as planning
from kern.backend.tree_sum import tree_sum, tree_sum_
from kern.batch import build_step
from kern.chunk import SeqChunk


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)  # -0.0 and +0.0 differ here, as NaNs would


def _batch(rng: random.Random, page: int, long: bool):
    """Sequences (q_len, ctx, block table) over shuffled pages; ``long``: one prefill chunk
    deep in a context of a few thousand keys (many blocks, several key chunks)."""
    q_lens, ctx = [], []
    for i in range(rng.randint(1, 4)):
        if long and i == 0:
            c, n = rng.randint(2100, 3000), rng.randint(65, 300)
        else:
            c = rng.choice([rng.randint(1, 120), rng.randint(120, 900)])
            n = min(c, rng.choice([1, rng.randint(2, 8), rng.randint(9, 200)]))
        q_lens.append(n)
        ctx.append(c)
    num_pages = sum(-(-c // page) for c in ctx) + 1
    order = list(range(num_pages))
    rng.shuffle(order)
    tables, at = [], 0
    for c in ctx:
        n = -(-c // page)
        tables.append(order[at : at + n])
        at += n
    return q_lens, ctx, tables, num_pages


def _plan(q_lens, ctx, tables, page, hk, rep, d, cache):
    chunks = [SeqChunk([0] * n, c - n, t) for n, c, t in zip(q_lens, ctx, tables, strict=True)]
    step = build_step(chunks, page, torch.device("cpu"))
    args = (step.q_starts, q_lens, ctx, step.block_tables, page, hk, rep, d, cache.stride(0))
    return attention.plan_attention(*args, step.page_ids, step.page_offsets)


PLAIN = {
    "one key chunk": ("CHUNK_BYTES", 1 << 40),
    "one pass": ("LONG_BLOCKS", 1 << 40),
    "copied probabilities": ("STRIDED_MATMULS", 0),
    "masks everywhere": None,  # _tail_block -> 0
}


def _attend(batch, page, hk, rep, d, latent, q, cache):
    plan = _plan(*batch[:3], page, hk, rep, d, cache)
    if latent:
        return attention.attend_latent(plan, q, cache, 0.11, d // 2)
    return attention.attend(plan, q, cache, 0.11)


@pytest.mark.parametrize("plain", list(PLAIN))
@pytest.mark.parametrize("latent", [False, True], ids=["gqa", "latent"])
def test_fast_path_keeps_every_bit(monkeypatch, plain, latent):
    rng = random.Random(f"{plain}-{latent}")
    # Small chunks, so that a few thousand keys make several of them.
    monkeypatch.setattr(attention, "CHUNK_BYTES", 1)
    for trial in range(12):
        page = rng.choice([16, 32, 64])
        hk, rep = (1, rng.choice([4, 8])) if latent else (rng.choice([1, 2, 4]), rng.choice([1, 2]))
        d = rng.choice([48, 80]) if latent else rng.choice([16, 32, 128])
        batch = _batch(rng, page, long=trial % 2 == 0)
        q_lens, num_pages = batch[0], batch[3]
        gen = torch.Generator().manual_seed(trial)
        q = torch.randn(sum(q_lens), hk * rep, d, generator=gen)
        if latent:
            cache = torch.randn(num_pages, page, d, generator=gen)
        else:
            cache = torch.randn(num_pages, 2, hk, page, d, generator=gen)
        args = (batch, page, hk, rep, d, latent, q, cache)
        fast = _attend(*args)
        with monkeypatch.context() as m:
            if PLAIN[plain] is None:
                m.setattr(planning, "_tail_block", lambda first_pos, num_blocks: 0)
            else:
                m.setattr(attention, *PLAIN[plain])
            slow = _attend(*args)
        assert torch.equal(_bits(fast), _bits(slow)), (plain, page, hk, rep, d, batch[:2])


def test_long_context_takes_the_fast_path(monkeypatch):
    """The batches above do reach the strided values matmul and several key chunks."""
    calls = {"bmm": 0, "chunks": 0}
    bmm, chunks = torch.bmm, attention._key_chunks

    def counted_bmm(*a, **k):
        calls["bmm"] += 1
        return bmm(*a, **k)

    def counted_chunks(*a):
        out = chunks(*a)
        calls["chunks"] = max(calls["chunks"], len(out))
        return out

    monkeypatch.setattr(attention, "CHUNK_BYTES", 1)
    monkeypatch.setattr(attention.torch, "bmm", counted_bmm)
    monkeypatch.setattr(attention, "_key_chunks", counted_chunks)
    page, hk, rep, d = 16, 2, 2, 16
    q_lens, ctx, tables, num_pages = [128], [2600], [list(range(163))], 163
    cache = torch.randn(num_pages, 2, hk, page, d)
    plan = _plan(q_lens, ctx, tables, page, hk, rep, d, cache)
    attention.attend(plan, torch.randn(128, hk * rep, d), cache, 0.25)
    assert calls["bmm"] > 0
    assert calls["chunks"] >= 4


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 16, 33, 64, 100])
def test_tree_sum_in_place_matches_the_padded_tree(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(3, n, 5, generator=gen)
    x[0] = 0.0
    x[1] = -0.0  # a sum of negative zeros: the padded tree's + 0.0 makes it +0.0
    want = tree_sum(x.clone(), 1)
    got = tree_sum_(x.clone(), 1)
    assert torch.equal(_bits(got), _bits(want))


def test_scratch_is_kept_across_plans_within_its_bound():
    scratch: dict = {}
    page, hk, rep, d = 16, 2, 2, 16
    cache = torch.randn(170, 2, hk, page, d)  # a long context: the chunked path's buffers
    step = build_step([SeqChunk([0] * 300, 2400, list(range(170)))], page, torch.device("cpu"))
    args = (step.q_starts, [300], [2700], step.block_tables, page, hk, rep, d, cache.stride(0))
    q = torch.randn(300, hk * rep, d)
    first = attention.attend(
        attention.plan_attention(*args, step.page_ids, step.page_offsets, scratch), q, cache, 0.3
    )
    kept = {name: buf.data_ptr() for name, buf in scratch.items()}
    assert set(kept) == {"k", "v", "s", "sums", "pv"}
    again = attention.attend(
        attention.plan_attention(*args, step.page_ids, step.page_offsets, scratch), q, cache, 0.3
    )
    assert {name: buf.data_ptr() for name, buf in scratch.items()} == kept
    assert torch.equal(_bits(first), _bits(again))
    plan = attention.plan_attention(*args, step.page_ids, step.page_offsets, scratch)
    big = plan.buffer("s", (planning.SCRATCH_KEEP // 4 + 1,), q)
    assert scratch["s"].data_ptr() == kept["s"] and big.data_ptr() != kept["s"]


def _dense_with_sinks(batch, page, hk, rep, q, cache, scale, sinks, window):
    """Oracle per sequence: softmax over the visible keys and the head's sink logit."""
    q_lens, ctx, tables = batch[:3]
    k_view, v_view = attention.kv_views(cache)
    out, at = [], 0
    for n, c, table in zip(q_lens, ctx, tables, strict=True):
        pos = torch.arange(c)
        pages = torch.tensor(table)[pos // page]
        k = k_view[pages, pos % page].repeat_interleave(rep, dim=1).transpose(0, 1)
        v = v_view[pages, pos % page].repeat_interleave(rep, dim=1).transpose(0, 1)
        qs = q[at : at + n].transpose(0, 1)
        q_pos = torch.arange(c - n, c)[:, None]
        visible = pos[None, :] <= q_pos
        if window:
            visible &= pos[None, :] > q_pos - window
        logits = torch.where(visible, qs @ k.transpose(1, 2) * scale, float("-inf"))
        sink = sinks.view(-1, 1, 1).expand(-1, n, 1)
        probs = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
        out.append((probs @ v).transpose(0, 1))
        at += n
    return torch.cat(out)


def _attend_with_sinks(batch, page, hk, rep, d, q, cache, sinks, window):
    plan = _plan(*batch[:3], page, hk, rep, d, cache)
    return attention.attend(plan, q, cache, 0.11, sinks, window)


@pytest.mark.parametrize("plain", list(PLAIN))
def test_sinks_and_a_window_match_the_oracle_and_keep_the_fast_paths_bits(monkeypatch, plain):
    """gpt-oss's attention on the CPU: close to the plain softmax with a sink column, and the
    fast path's switches leave every bit as the plain formulation gives it."""
    rng = random.Random(f"sinks-{plain}")
    monkeypatch.setattr(attention, "CHUNK_BYTES", 1)
    for trial in range(6):
        page = rng.choice([16, 32])
        hk, rep, d = rng.choice([1, 2]), rng.choice([1, 2, 4]), 32
        window = rng.choice([0, 7, 40, 128])
        batch = _batch(rng, page, long=trial % 2 == 0)
        gen = torch.Generator().manual_seed(trial)
        q = torch.randn(sum(batch[0]), hk * rep, d, generator=gen)
        cache = torch.randn(batch[3], 2, hk, page, d, generator=gen)
        sinks = torch.randn(hk * rep, generator=gen) * 3

        args = (batch, page, hk, rep, d, q, cache, sinks, window)
        fast = _attend_with_sinks(*args)
        want = _dense_with_sinks(batch, page, hk, rep, q, cache, 0.11, sinks, window)
        torch.testing.assert_close(fast, want, rtol=1e-4, atol=1e-5)
        with monkeypatch.context() as m:
            if PLAIN[plain] is None:
                m.setattr(planning, "_tail_block", lambda first_pos, num_blocks: 0)
            else:
                m.setattr(attention, *PLAIN[plain])
            slow = _attend_with_sinks(*args)
        assert torch.equal(_bits(fast), _bits(slow)), (plain, page, hk, rep, window, batch[:2])


@pytest.mark.parametrize("plain", list(PLAIN))
def test_a_window_plan_reads_only_the_window_and_keeps_every_bit(monkeypatch, plain):
    """A plan for one sliding window (a sliding layer's window pages, gpt-oss): each unit reads
    from its window's aligned start, table entries before it are -1 and the pages there NaN,
    and every output bit is the one a plan reading from position 0 gives."""
    rng = random.Random(f"window-plan-{plain}")
    monkeypatch.setattr(attention, "CHUNK_BYTES", 1)
    for trial in range(8):
        page = rng.choice([16, 32])
        hk, rep, d = rng.choice([1, 2]), rng.choice([1, 2, 4]), 32
        window = rng.choice([5, 16, 40, 128])
        batch = _batch(rng, page, long=trial % 2 == 0)
        q_lens, ctx, tables = batch[:3]
        gen = torch.Generator().manual_seed(trial)
        q = torch.randn(sum(q_lens), hk * rep, d, generator=gen)
        cache = torch.randn(batch[3], 2, hk, page, d, generator=gen)
        sinks = torch.randn(hk * rep, generator=gen) * 3
        want = _attend_with_sinks(batch, page, hk, rep, d, q, cache, sinks, window)

        cut, gone = [], []
        for n, c, table in zip(q_lens, ctx, tables, strict=True):
            first = max(0, c - n - window + 1) // page
            gone += table[:first]
            cut.append([-1] * first + table[first:])
        cache[gone] = float("nan")
        chunks = [SeqChunk([0] * n, c - n, t) for n, c, t in zip(q_lens, ctx, cut, strict=True)]
        step = build_step(chunks, page, torch.device("cpu"))
        args = (step.q_starts, q_lens, ctx, step.block_tables, page, hk, rep, d, cache.stride(0))
        plan = attention.plan_attention(*args, step.page_ids, step.page_offsets, window=window)
        with monkeypatch.context() as m:
            if PLAIN[plain] is not None:
                m.setattr(attention, *PLAIN[plain])
            got = attention.attend(plan, q, cache, 0.11, sinks, window)
        assert torch.equal(_bits(got), _bits(want)), (plain, page, hk, rep, window, batch[:2])
        with pytest.raises(ValueError, match="a plan for a sliding window of"):
            attention.attend(plan, q, cache, 0.11, sinks, 0)
