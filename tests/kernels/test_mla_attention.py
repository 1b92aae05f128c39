import pytest
import torch
import torch.nn.functional as F

from kern.kernels.mla_attention import mla_attention, reference

LAYERS = 3  # the arena holds this many layers' caches; tests use the middle one


class Latent:
    """One layer's paged latent cache: a strided view `arena[:, 1]` of a
    [P, layers, page_tokens, C] arena (as a pool lays it out), unused slots NaN (as
    torch.empty may leave them)."""

    def __init__(self, num_pages, page_tokens, width, dtype=torch.float32):
        shape = (num_pages, LAYERS, page_tokens, width)
        self.arena = torch.full(shape, float("nan"), dtype=dtype)
        self.cache = self.arena[:, 1]
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
    """A sequence's whole latent entries and absorbed queries, cut into calls as a test wants."""

    def __init__(self, name, length, num_heads, v_dim, rope_dim, dtype=torch.float32):
        self.name = name
        self.v_dim = v_dim
        self.q = torch.randn(length, num_heads, v_dim + rope_dim).to(dtype)
        self.entry = torch.randn(length, v_dim + rope_dim).to(dtype)


def run_step(fns, cache, step, scale):
    """One call: step is a list of (seq, start, stop) rows; write their entries, then attend."""
    for seq, start, stop in step:
        fns.write_latent(seq.entry[start:stop], cache.cache, cache.slots(seq.name, start, stop))
    q = torch.cat([seq.q[start:stop] for seq, start, stop in step])
    q_lens = torch.tensor([stop - start for _, start, stop in step])
    query_start_loc = F.pad(q_lens.cumsum(0), (1, 0)).to(torch.int32)
    seq_lens = torch.tensor([stop for _, _, stop in step], dtype=torch.int32)
    table = cache.block_tables([seq.name for seq, _, _ in step])
    v_dim = step[0][0].v_dim
    out = fns.mla_attention(q, cache.cache, table, seq_lens, query_start_loc, scale, v_dim)
    assert out.shape == (q.shape[0], q.shape[1], v_dim)
    return {
        seq.name: out[query_start_loc[b] : query_start_loc[b + 1]]
        for b, (seq, _, _) in enumerate(step)
    }


def dense(cache, seq, start, stop, scale):
    """Oracle in float64: expand the sequence's pages into one [stop, C] tensor, then plain
    causal softmax attention with key = the whole entry, value = its first v_dim values."""
    pages = torch.tensor(cache.pages[seq.name])
    entries = cache.cache[pages].reshape(-1, cache.cache.shape[-1])[:stop].double()
    assert torch.equal(entries, seq.entry[:stop].to(cache.cache.dtype).double())
    q = seq.q[start:stop].double()  # [n, H, C]
    s = torch.einsum("nhc,jc->hnj", q, entries) * scale
    mask = torch.arange(stop)[None, :] <= torch.arange(start, stop)[:, None]
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hnj,jv->nhv", p, entries[:, : seq.v_dim])


# (name, seq_len, q_len). DECODE: one row per sequence. MIXED: a decode row, a prefill from
# position 0, prefills over cached prefixes ending mid-page (23 = 16 + 7, 70 = 64 + 6), a
# sequence with no rows in this call, and a one-token sequence.
DECODE = [("a", 70, 1), ("b", 17, 1), ("c", 1, 1), ("d", 64, 1), ("e", 33, 1)]
MIXED = [
    ("decode", 70, 1),
    ("fresh", 20, 20),
    ("resume", 40, 17),
    ("long", 90, 20),
    ("idle", 9, 0),
    ("one", 1, 1),
]
BATCHES = [pytest.param(DECODE, id="decode"), pytest.param(MIXED, id="mixed")]
# (num_heads, v_dim = kv_lora_rank, rope_dim, page_tokens)
CASES = [
    pytest.param(1, 32, 16, 16, id="H1-L32-R16-P16"),
    pytest.param(4, 64, 16, 64, id="H4-L64-R16-P64"),
    pytest.param(16, 32, 16, 16, id="H16-L32-R16-P16"),
    pytest.param(4, 40, 8, 16, id="H4-L40-R8-P16"),
]


def make_batch(batch, num_heads, v_dim, rope_dim, page_tokens, dtype=torch.float32):
    cache = Latent(48, page_tokens, v_dim + rope_dim, dtype)
    seqs = {n: Seq(n, L, num_heads, v_dim, rope_dim, dtype) for n, L, _ in batch}
    # the cached prefixes, written by an earlier call
    for name, seq_len, q_len in batch:
        if seq_len > q_len:
            seq = seqs[name]
            slots = cache.slots(name, 0, seq_len - q_len)
            reference.write_latent(seq.entry[: seq_len - q_len], cache.cache, slots)
    step = [(seqs[n], L - q, L) for n, L, q in batch]
    return cache, step


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize(("num_heads", "v_dim", "rope_dim", "page_tokens"), CASES)
def test_reference_matches_dense(batch, num_heads, v_dim, rope_dim, page_tokens, assert_close):
    cache, step = make_batch(batch, num_heads, v_dim, rope_dim, page_tokens)
    scale = 0.1
    ref = run_step(reference, cache, step, scale)
    for seq, start, stop in step:
        assert_close(f"o[{seq.name}]", dense(cache, seq, start, stop, scale), ref[seq.name], 1e-6)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize(
    ("num_heads", "v_dim", "rope_dim", "page_tokens", "dtype"),
    [pytest.param(*case.values, torch.float32, id=case.id) for case in CASES]
    + [pytest.param(16, 64, 16, 64, torch.bfloat16, id="H16-L64-R16-P64-bf16")],
)
def test_mla_attention_kernel(
    batch, num_heads, v_dim, rope_dim, page_tokens, dtype, assert_close, tol
):
    cache, step = make_batch(batch, num_heads, v_dim, rope_dim, page_tokens, dtype)
    scale = (v_dim + rope_dim) ** -0.5
    arena = cache.arena.clone()
    ref = run_step(reference, cache, step, scale)
    cache.arena.copy_(arena)  # both write this call's entries themselves
    got = run_step(mla_attention, cache, step, scale)
    for seq, _, _ in step:
        assert got[seq.name].dtype == dtype
        assert_close(f"o[{seq.name}]", ref[seq.name], got[seq.name], tol(dtype))


@pytest.mark.parametrize("fns", [reference, mla_attention], ids=["reference", "triton"])
def test_write_latent_strided(fns):
    cache = Latent(6, 16, 48)
    cache.arena.fill_(-7.0)
    entry = torch.randn(23, 2, 48)[:, 1]  # a strided view itself
    slots = torch.randperm(6 * 16)[:23]
    want = cache.arena.clone()
    pages, offsets = slots // 16, slots % 16
    want[pages, 1, offsets] = entry
    fns.write_latent(entry, cache.cache, slots)
    assert torch.equal(cache.arena, want)  # other layers and unnamed slots untouched
    assert (want == -7.0).sum() == want.numel() - entry.numel()


def test_write_latent_casts():
    """float32 entries into a bf16 cache. Values exact in bf16: the interpreter's float32 to
    bf16 cast truncates (triton 3.7) where a GPU rounds to nearest even."""
    cache = Latent(2, 16, 48, torch.bfloat16)
    entry = torch.randn(5, 48).to(torch.bfloat16).float()
    slots = torch.tensor([3, 17, 0, 31, 8])
    want = cache.arena.clone()
    reference.write_latent(entry, want[:, 1], slots)
    mla_attention.write_latent(entry, cache.cache, slots)
    assert torch.equal(cache.arena.isnan(), want.isnan())
    assert torch.equal(cache.arena.nan_to_num(), want.nan_to_num())
    assert torch.equal(want[0, 1, 3], entry[0].to(torch.bfloat16))


def splits(length, cuts):
    bounds = [0, *cuts, length]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def chunked_rows(fns, seq, chunks, *, page_tokens, neighbours, scale):
    """Run seq's rows in the given chunks, each call shared with fresh neighbour rows;
    return seq's output rows in position order."""
    num_heads, width = seq.q.shape[1:]
    rope_dim = width - seq.v_dim
    cache = Latent(128, page_tokens, width)
    rows = []
    for i, (start, stop) in enumerate(chunks):
        step = [(seq, start, stop)]
        for j, (length, q_len) in enumerate(neighbours[i % len(neighbours)]):
            other = Seq(f"n{i}.{j}", length, num_heads, seq.v_dim, rope_dim)
            if length > q_len:
                run_step(fns, cache, [(other, 0, length - q_len)], scale)
            step.insert(j % 2, (other, length - q_len, length))
        rows.append(run_step(fns, cache, step, scale)[seq.name])
    return torch.cat(rows)


def assert_invariant(fns, length, num_heads, v_dim, rope_dim, page_tokens, ways):
    seq = Seq("s", length, num_heads, v_dim, rope_dim)
    kw = dict(page_tokens=page_tokens, scale=(v_dim + rope_dim) ** -0.5)
    alone = chunked_rows(fns, seq, [(0, length)], neighbours=[[]], **kw)
    for chunks, neighbours in ways:
        got = chunked_rows(fns, seq, chunks, neighbours=neighbours, **kw)
        same = (got == alone).flatten(1).all(1)
        assert same.all(), f"rows {(~same).nonzero().flatten().tolist()} differ for {chunks}"


def test_reference_two_chunks_equal_one_call():
    """Bitwise: a prompt run in one call equals the same prompt run in two chunks (the second
    starting mid-page and mid-tile), alone in the call."""
    seq = Seq("s", 75, 4, 64, 16)
    kw = dict(page_tokens=16, neighbours=[[]], scale=80**-0.5)
    alone = chunked_rows(reference, seq, [(0, 75)], **kw)
    for cut in (1, 23, 64, 74):
        assert torch.equal(chunked_rows(reference, seq, [(0, cut), (cut, 75)], **kw), alone)


def test_reference_batch_and_chunk_invariant():
    """Bitwise: a row's output does not depend on the other sequences in its call, on its
    chunking, on decode vs prefill, or on which pages hold its keys."""
    length = 110
    decode_tail = [(p, p + 1) for p in range(100, 110)]
    ways = [
        (splits(length, [23, 24, 90]), [[(5, 1), (40, 33)], [(130, 2)]]),
        (splits(length, [1, 2, 3, 67, 100]), [[(3, 3)], [], [(20, 1), (9, 9)]]),
        ([(0, 100), *decode_tail], [[(17, 1), (17, 1), (64, 16)], []]),
    ]
    assert_invariant(reference, length, 16, 64, 16, 16, ways)


def test_reference_decode_row_batch_invariant():
    """Bitwise: a decode row's output is the same alone and beside other sequences' decode
    and prefill rows, in any order."""
    cache = Latent(64, 16, 48)
    seqs = [Seq(f"s{i}", 30 + 7 * i, 4, 32, 16) for i in range(4)]
    for seq in seqs:
        run_step(reference, cache, [(seq, 0, seq.q.shape[0] - 1)], 0.2)
    base = cache.arena.clone()

    def decode(order, extra=()):
        cache.arena.copy_(base)
        step = [(seqs[i], seqs[i].q.shape[0] - 1, seqs[i].q.shape[0]) for i in order]
        return run_step(reference, cache, [*step, *extra], 0.2)

    alone = {seq.name: decode([i])[seq.name] for i, seq in enumerate(seqs)}
    prefill = Seq("p", 40, 4, 32, 16)
    for order, extra in [([0, 1, 2, 3], ()), ([3, 1, 0, 2], ((prefill, 0, 40),))]:
        got = decode(order, extra)
        for seq in seqs:
            assert torch.equal(got[seq.name], alone[seq.name]), seq.name


def test_kernel_batch_and_chunk_invariant():
    """The same for the Triton kernel under the interpreter (smaller: it is slow), with heads
    that fill a tile (H = 16: one row per tile) and heads that share it (H = 4)."""
    length = 40
    ways = [
        (splits(length, [7, 8, 23]), [[(5, 1)], [(30, 18)]]),
        ([(0, 37), (37, 38), (38, 39), (39, 40)], [[(17, 1), (3, 3)]]),
    ]
    assert_invariant(mla_attention, length, 4, 32, 16, 16, ways)
    assert_invariant(mla_attention, length, 16, 40, 8, 16, ways[1:])
