import functools

import pytest
import torch
import torch.nn.functional as F

from kern.kernels.paged_attention import paged_attention, reference


class Paged:
    """One layer's paged KV: K and V interleaved in one arena, so both caches are strided
    views (as a pool lays them out), unused slots NaN (as torch.empty may leave them)."""

    def __init__(self, num_pages, page_tokens, num_kv_heads, head_dim, dtype=torch.float32):
        shape = (num_pages, 2, page_tokens, num_kv_heads, head_dim)
        self.arena = torch.full(shape, float("nan"), dtype=dtype)
        self.k_cache, self.v_cache = self.arena[:, 0], self.arena[:, 1]
        self.page_tokens = page_tokens
        self.free = torch.randperm(num_pages).tolist()
        self.pages = {}  # sequence name -> its page ids, in position order

    def slots(self, name, start, stop):
        """Slots of positions [start, stop) of a sequence, allocating pages as needed."""
        pages = self.pages.setdefault(name, [])
        while len(pages) * self.page_tokens < stop:
            pages.append(self.free.pop())
        positions = torch.arange(start, stop)
        return torch.tensor(pages)[positions // self.page_tokens] * self.page_tokens + (
            positions % self.page_tokens
        )

    def block_tables(self, names):
        width = max(len(self.pages[n]) for n in names)
        table = torch.zeros(len(names), width, dtype=torch.int32)
        for b, name in enumerate(names):
            table[b, : len(self.pages[name])] = torch.tensor(self.pages[name])
        return table


class Seq:
    """A sequence's whole K/V and queries, cut into calls as a test wants."""

    def __init__(self, name, length, num_q_heads, num_kv_heads, head_dim, dtype=torch.float32):
        self.name = name
        self.q = torch.randn(length, num_q_heads, head_dim).to(dtype)
        self.k = torch.randn(length, num_kv_heads, head_dim).to(dtype)
        self.v = torch.randn(length, num_kv_heads, head_dim).to(dtype)


def run_step(fns, cache, step, scale):
    """One call: step is a list of (seq, start, stop) rows; write their K/V, then attend."""
    for seq, start, stop in step:
        fns.write_kv(
            seq.k[start:stop],
            seq.v[start:stop],
            cache.k_cache,
            cache.v_cache,
            cache.slots(seq.name, start, stop),
        )
    q = torch.cat([seq.q[start:stop] for seq, start, stop in step])
    q_lens = torch.tensor([stop - start for _, start, stop in step])
    query_start_loc = F.pad(q_lens.cumsum(0), (1, 0)).to(torch.int32)
    seq_lens = torch.tensor([stop for _, _, stop in step], dtype=torch.int32)
    table = cache.block_tables([seq.name for seq, _, _ in step])
    out = fns.paged_attention(
        q, cache.k_cache, cache.v_cache, table, seq_lens, query_start_loc, scale
    )
    return {
        seq.name: out[query_start_loc[b] : query_start_loc[b + 1]]
        for b, (seq, _, _) in enumerate(step)
    }


def dense(seq, start, stop, scale):
    """Oracle: plain causal softmax attention over the sequence's keys [0, stop)."""
    group = seq.q.shape[1] // seq.k.shape[1]
    q = seq.q[start:stop].float().transpose(0, 1)
    k = seq.k[:stop].float().repeat_interleave(group, dim=1).transpose(0, 1)
    v = seq.v[:stop].float().repeat_interleave(group, dim=1).transpose(0, 1)
    mask = torch.arange(stop)[None, :] <= torch.arange(start, stop)[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)


# (name, seq_len, q_len): decode rows, a fresh prefill, prefills over cached prefixes
# that end mid-page (23 = 16 + 7, 67 = 64 + 3), and a one-token sequence.
BATCH = [("decode", 130, 1), ("fresh", 7, 7), ("resume", 63, 40), ("long", 130, 63), ("one", 1, 1)]
KERNEL_CASES = [
    pytest.param(2, 2, 64, 16, torch.float32, id="B5-Hq2-Hk2-D64-P16-fp32"),
    pytest.param(8, 2, 128, 16, torch.float32, id="B5-Hq8-Hk2-D128-P16-fp32"),
    pytest.param(8, 1, 64, 64, torch.float32, id="B5-Hq8-Hk1-D64-P64-fp32"),
    pytest.param(1, 1, 128, 64, torch.float32, id="B5-Hq1-Hk1-D128-P64-fp32"),
    pytest.param(4, 1, 64, 64, torch.bfloat16, id="B5-Hq4-Hk1-D64-P64-bf16"),
    pytest.param(8, 1, 128, 16, torch.bfloat16, id="B5-Hq8-Hk1-D128-P16-bf16"),
]


def make_batch(num_q_heads, num_kv_heads, head_dim, page_tokens, dtype):
    cache = Paged(40, page_tokens, num_kv_heads, head_dim, dtype)
    seqs = {n: Seq(n, L, num_q_heads, num_kv_heads, head_dim, dtype) for n, L, _ in BATCH}
    # the cached prefixes, written by an earlier call
    for name, seq_len, q_len in BATCH:
        if seq_len > q_len:
            seq = seqs[name]
            slots = cache.slots(name, 0, seq_len - q_len)
            reference.write_kv(
                seq.k[: seq_len - q_len], seq.v[: seq_len - q_len],
                cache.k_cache, cache.v_cache, slots,
            )  # fmt: skip
    step = [(seqs[n], L - q, L) for n, L, q in BATCH]
    return cache, step


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim", "page_tokens", "dtype"), KERNEL_CASES
)
def test_paged_attention_kernel(
    num_q_heads, num_kv_heads, head_dim, page_tokens, dtype, assert_close, tol
):
    cache, step = make_batch(num_q_heads, num_kv_heads, head_dim, page_tokens, dtype)
    scale = head_dim**-0.5
    arena = cache.arena.clone()
    ref = run_step(reference, cache, step, scale)
    cache.arena.copy_(arena)  # both write this call's K/V themselves
    got = run_step(paged_attention, cache, step, scale)
    for seq, _, _ in step:
        assert got[seq.name].dtype == dtype
        assert_close(f"o[{seq.name}]", ref[seq.name], got[seq.name], tol(dtype))


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim", "page_tokens"),
    [
        pytest.param(4, 1, 128, 16, id="B5-Hq4-Hk1-D128-P16"),
        pytest.param(8, 8, 64, 64, id="B5-Hq8-Hk8-D64-P64"),
    ],
)
def test_reference_matches_dense(num_q_heads, num_kv_heads, head_dim, page_tokens, assert_close):
    cache, step = make_batch(num_q_heads, num_kv_heads, head_dim, page_tokens, torch.float32)
    ref = run_step(reference, cache, step, 0.1)
    for seq, start, stop in step:
        assert_close(f"o[{seq.name}]", dense(seq, start, stop, 0.1), ref[seq.name], 1e-6)


def test_write_kv_kernel_strided():
    cache = Paged(6, 16, 2, 64)
    cache.arena.fill_(-7.0)
    k, v = torch.randn(2, 23, 2, 64).unbind(0)  # strided views themselves
    slots = torch.randperm(6 * 16)[:23]
    want = cache.arena.clone()
    reference.write_kv(k, v, want[:, 0], want[:, 1], slots)
    paged_attention.write_kv(k, v, cache.k_cache, cache.v_cache, slots)
    assert torch.equal(cache.arena, want)
    assert (want == -7.0).sum() == want.numel() - 2 * k.numel()


def splits(length, cuts):
    bounds = [0, *cuts, length]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def chunked_rows(fns, seq, chunks, *, page_tokens, neighbours, scale):
    """Run seq's rows in the given chunks, each call shared with fresh neighbour rows;
    return seq's output rows in position order."""
    num_kv_heads, head_dim = seq.k.shape[1:]
    cache = Paged(128, page_tokens, num_kv_heads, head_dim)
    rows = []
    for i, (start, stop) in enumerate(chunks):
        step = [(seq, start, stop)]
        for j, (length, q_len) in enumerate(neighbours[i % len(neighbours)]):
            other = Seq(f"n{i}.{j}", length, seq.q.shape[1], num_kv_heads, head_dim)
            if length > q_len:
                run_step(fns, cache, [(other, 0, length - q_len)], scale)
            step.insert(j % 2, (other, length - q_len, length))
        rows.append(run_step(fns, cache, step, scale)[seq.name])
    return torch.cat(rows)


def assert_invariant(fns, length, num_q_heads, num_kv_heads, head_dim, page_tokens, ways):
    seq = Seq("s", length, num_q_heads, num_kv_heads, head_dim)
    kw = dict(page_tokens=page_tokens, scale=head_dim**-0.5)
    alone = chunked_rows(fns, seq, [(0, length)], neighbours=[[]], **kw)
    for chunks, neighbours in ways:
        got = chunked_rows(fns, seq, chunks, neighbours=neighbours, **kw)
        same = (got == alone).flatten(1).all(1)
        assert same.all(), f"rows {(~same).nonzero().flatten().tolist()} differ for {chunks}"


def test_reference_batch_and_chunk_invariant():
    """Bitwise: a row's output does not depend on its batch, its chunking, decode vs prefill,
    or which pages hold its keys (D = 128: where a plain matmul's rows are not stable)."""
    length = 110
    decode_tail = [(p, p + 1) for p in range(100, 110)]
    ways = [
        (splits(length, [23, 24, 90]), [[(5, 1), (40, 33)], [(130, 2)]]),
        (splits(length, [1, 2, 3, 67, 100]), [[(3, 3)], [], [(20, 1), (9, 9)]]),
        ([(0, 100), *decode_tail], [[(17, 1), (17, 1), (64, 16)]]),
    ]
    assert_invariant(reference, length, 8, 2, 128, 16, ways)


def test_kernel_batch_and_chunk_invariant():
    """The same for the Triton kernel under the interpreter (smaller: it is slow)."""
    length = 40
    ways = [
        (splits(length, [7, 8, 23]), [[(5, 1)], [(30, 18)]]),
        ([(0, 37), (37, 38), (38, 39), (39, 40)], [[(17, 1), (3, 3)]]),
    ]
    assert_invariant(paged_attention, length, 4, 2, 64, 16, ways)


# gpt-oss: per-head sinks and a sliding window. The oracle is transformers' eager form (the
# sink a last logit column, dropped after the softmax).


def dense_with_sinks(seq, start, stop, scale, sinks, window):
    """Oracle: each row's softmax over its visible keys and its head's sink logit."""
    group = seq.q.shape[1] // seq.k.shape[1]
    q = seq.q[start:stop].float().transpose(0, 1)
    k = seq.k[:stop].float().repeat_interleave(group, dim=1).transpose(0, 1)
    v = seq.v[:stop].float().repeat_interleave(group, dim=1).transpose(0, 1)
    q_pos = torch.arange(start, stop)[:, None]
    k_pos = torch.arange(stop)[None, :]
    visible = k_pos <= q_pos
    if window:
        visible &= k_pos > q_pos - window
    logits = torch.where(visible, q @ k.transpose(1, 2) * scale, float("-inf"))
    sink = sinks.float().view(-1, 1, 1).expand(-1, logits.shape[1], 1)
    probs = F.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return (probs @ v).transpose(0, 1)


class With:
    """A kernel module's functions with sinks and a window bound (what a gpt-oss layer calls)."""

    def __init__(self, fns, sinks, window):
        self.write_kv = fns.write_kv
        self.paged_attention = functools.partial(fns.paged_attention, sinks=sinks, window=window)


@pytest.mark.parametrize("window", [0, 5, 16, 40])
def test_reference_matches_the_dense_oracle(window, assert_close):
    cache, step = make_batch(8, 2, 64, 16, torch.float32)
    sinks = torch.randn(8) * 2
    got = run_step(With(reference, sinks, window), cache, step, 0.125)
    for seq, start, stop in step:
        want = dense_with_sinks(seq, start, stop, 0.125, sinks, window)
        assert_close(f"o[{seq.name}]", want, got[seq.name], 1e-5)


@pytest.mark.parametrize("window", [0, 24])
def test_a_window_without_sinks_matches_the_oracle(window, assert_close):
    """No sink: a windowed row meets whole hidden blocks first (m must start finite)."""
    cache, step = make_batch(4, 2, 64, 16, torch.float32)
    got = run_step(With(reference, None, window), cache, step, 0.125)
    neg_inf = torch.full((4,), -1e4)  # exp(-1e4 - x) = 0: no sink
    for seq, start, stop in step:
        assert_close(f"o[{seq.name}]", dense_with_sinks(seq, start, stop, 0.125, neg_inf, window),
                     got[seq.name], 1e-5)  # fmt: skip


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim", "page_tokens", "dtype"), KERNEL_CASES[1:5:3]
)
@pytest.mark.parametrize(("with_sinks", "window"), [(True, 0), (True, 20), (False, 20)])
def test_kernel_matches_the_reference(
    num_q_heads, num_kv_heads, head_dim, page_tokens, dtype, with_sinks, window, assert_close, tol
):
    cache, step = make_batch(num_q_heads, num_kv_heads, head_dim, page_tokens, dtype)
    sinks = torch.randn(num_q_heads) if with_sinks else None
    arena = cache.arena.clone()
    ref = run_step(With(reference, sinks, window), cache, step, head_dim**-0.5)
    cache.arena.copy_(arena)
    got = run_step(With(paged_attention, sinks, window), cache, step, head_dim**-0.5)
    for seq, _, _ in step:
        assert_close(f"o[{seq.name}]", ref[seq.name], got[seq.name], tol(dtype))


def test_reference_rows_are_batch_and_chunk_invariant_with_a_window():
    """Bitwise: leading blocks a tile skips are the no-ops its other rows fold."""
    length = 110
    ways = [
        (splits(length, [23, 24, 90]), [[(5, 1), (40, 33)], [(130, 2)]]),
        ([(0, 100), *[(p, p + 1) for p in range(100, 110)]], [[(17, 1), (64, 16)]]),
    ]
    fns = With(reference, torch.randn(8), 37)
    assert_invariant(fns, length, 8, 2, 128, 16, ways)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_pages_before_the_window_are_never_read(impl):
    """A sliding layer's window pages (gpt-oss): the table holds -1 for the pages a sequence
    gave back and their bytes are NaN; every row keeps the bits of a read through the whole
    table."""
    fns = {"reference": reference, "triton": paged_attention}[impl]
    window, sinks = 20, torch.randn(8)
    cache, step = make_batch(8, 2, 64, 16, torch.float32)
    want = run_step(With(fns, sinks, window), cache, step, 0.125)
    names = [seq.name for seq, _, _ in step]
    table = cache.block_tables(names)
    for b, (_, start, _) in enumerate(step):
        first = max(0, start - window + 1) // cache.page_tokens
        cache.arena[table[b, :first].long()] = float("nan")
        table[b, :first] = -1
    assert (table < 0).sum() >= 6
    q = torch.cat([seq.q[start:stop] for seq, start, stop in step])
    q_lens = torch.tensor([stop - start for _, start, stop in step])
    query_start_loc = F.pad(q_lens.cumsum(0), (1, 0)).to(torch.int32)
    seq_lens = torch.tensor([stop for _, _, stop in step], dtype=torch.int32)
    out = fns.paged_attention(
        q, cache.k_cache, cache.v_cache, table, seq_lens, query_start_loc, 0.125,
        sinks=sinks, window=window,
    )  # fmt: skip
    for b, name in enumerate(names):
        got = out[query_start_loc[b] : query_start_loc[b + 1]]
        assert torch.equal(got.view(torch.int32), want[name].view(torch.int32)), name
