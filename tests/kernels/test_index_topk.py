import pytest
import torch

from kern.kernels.index_topk import index_topk, reference

NAN_ROW = 0  # a table row only invalid slots name: NaN, so reading it would show


def make_case(rows=5, heads=4, dim=32, num_keys=40, dtype=torch.float32, table=60):
    """A batch over a shared key table: some invalid slots (naming the NaN row or -1), row 1
    with a single valid slot, row 2 with none."""
    keys = torch.randn(table, dim).to(dtype)
    keys[NAN_ROW] = float("nan")
    key_rows = torch.randint(1, table, (rows, num_keys))
    valid = torch.rand(rows, num_keys) < 0.7
    valid[0, : num_keys // 3] = False
    valid[1] = False
    valid[1, num_keys // 2] = True
    valid[2] = False
    key_rows[~valid] = torch.where(torch.rand(int((~valid).sum())) < 0.5, NAN_ROW, -1)
    q = torch.randn(rows, heads, dim).to(dtype)
    weights = torch.randn(rows, heads) * heads**-0.5
    return q, weights, keys, key_rows, valid, dim**-0.5


def oracle_scores(q, weights, keys, key_rows, valid, scale):
    """float64, row by row, over the valid slots only."""
    out = torch.full(key_rows.shape, float("-inf"), dtype=torch.float64)
    for r in range(q.shape[0]):
        k = keys[key_rows[r][valid[r]]].double()  # [n, D]
        s = torch.relu(q[r].double() @ k.T) * scale * weights[r].double()[:, None]
        out[r][valid[r]] = s.sum(0)
    return out


def oracle_select(score, k):
    """A stable descending sort's first k (equal scores keep slot order), padded with slot 0."""
    rows, n = score.shape
    slots = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :k]
    ok = score.gather(1, slots) > float("-inf")
    pad = k - slots.shape[1]
    slots = torch.cat([slots, slots.new_zeros(rows, pad)], 1)
    return slots, torch.cat([ok, ok.new_zeros(rows, pad)], 1)


def assert_scores_close(ref, got, valid, tol):
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert torch.equal(got[~valid], torch.full_like(got[~valid], float("-inf")))
    assert torch.isfinite(got[valid]).all()
    a, b = ref[valid].double(), got[valid].double()
    err = ((a - b).norm() / a.norm().clamp_min(1e-30)).item()
    assert err <= tol, f"scores: relative error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_scores_match_float64(dtype):
    case = make_case(rows=6, heads=8, dim=32, num_keys=50, dtype=dtype)
    got = reference.scores(*case)
    assert_scores_close(oracle_scores(*case), got, case[4], 1e-6)
    assert torch.equal(got[2], torch.full_like(got[2], float("-inf")))


def tied_scores(rows=6, n=70):
    """Scores with many exact ties: few distinct values, -0.0 beside 0.0, -inf (invalid)."""
    values = torch.tensor([1.5, 0.0, -0.0, -2.0, 3.25, float("-inf")])
    score = values[torch.randint(0, len(values), (rows, n))]
    score[1] = float("-inf")  # fewer than k valid slots
    score[1, 5:8] = torch.tensor([0.0, 1.5, -0.0])
    score[2] = float("-inf")  # no valid slot
    score[3] = torch.where(torch.arange(n) % 2 == 0, 0.0, -0.0)  # only zeros of both signs
    return score


@pytest.mark.parametrize("k", [1, 4, 16, 64, 70, 100])
def test_reference_select_is_a_stable_sort(k):
    score = tied_scores()
    slots, ok = reference.select(score, k)
    want_slots, want_ok = oracle_select(score, k)
    assert slots.dtype == torch.int64 and slots.shape == (6, k) and ok.shape == (6, k)
    assert torch.equal(slots, want_slots)
    assert torch.equal(ok, want_ok)
    assert not ok[2].any()
    assert int(ok[1].sum()) == min(k, 3)


def test_reference_index_topk_on_random_scores():
    case = make_case(rows=5, heads=4, dim=32, num_keys=60)
    for k in (4, 17, 64, 80):
        slots, ok = reference.index_topk(*case[:5], k, case[5])
        want = oracle_select(reference.scores(*case), k)
        assert torch.equal(slots, want[0]) and torch.equal(ok, want[1])
        assert torch.equal(ok.sum(1), case[4].sum(1).clamp_max(k))


# (rows, heads, dim, slots): one block; several, partly masked; V4's 64 index heads at
# D = 128 with N ~ 300; H not a power of two (masked heads).
SHAPES = [
    pytest.param(5, 4, 32, 40, id="R5-H4-D32-N40"),
    pytest.param(4, 8, 32, 150, id="R4-H8-D32-N150"),
    pytest.param(3, 64, 128, 300, id="R3-H64-D128-N300"),
    pytest.param(3, 6, 40, 70, id="R3-H6-D40-N70"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("rows", "heads", "dim", "num_keys"), SHAPES)
def test_kernel_scores_match_reference(rows, heads, dim, num_keys, dtype, tol):
    case = make_case(rows, heads, dim, num_keys, dtype, table=2 * num_keys)
    ref = reference.scores(*case)
    got = index_topk.scores(*case)
    assert_scores_close(ref, got, case[4], tol(dtype))
    assert torch.equal(got[2], torch.full_like(got[2], float("-inf")))  # no valid slot


def separated_case(rows=4, heads=8, dim=32, num_keys=200):
    """Scores c_n * S with distinct c_n (a permutation, some negative: relu ties at exact 0),
    every key a multiple of one vector: gaps far above float32 rounding."""
    base = torch.randn(dim)
    q = torch.randn(rows, heads, dim).abs() * base.sign()  # q_h . base > 0
    weights = torch.rand(rows, heads) + 0.5
    c = torch.randperm(num_keys).float() - num_keys // 4
    keys = c[:, None] * base[None, :]
    key_rows = torch.stack([torch.randperm(num_keys) for _ in range(rows)])
    valid = torch.rand(rows, num_keys) < 0.8
    valid[1, 5:] = False  # fewer valid slots than most k
    return q, weights, keys, key_rows, valid, dim**-0.5


@pytest.mark.parametrize("k", [4, 16, 64, 250])
def test_kernel_selection_on_separated_scores(k):
    case = separated_case()
    want = reference.index_topk(*case[:5], k, case[5])
    got = index_topk.index_topk(*case[:5], k, case[5])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def integer_case(rows=4, heads=4, dim=32, num_keys=130, table=6):
    """Small integers, weights and scale powers of two: every sum is exact in float32 in any
    order, so kernel and reference scores are equal bit for bit, and a table of 6 rows makes
    duplicated keys (and relu zeros) tie exactly."""
    q = torch.randint(-3, 4, (rows, heads, dim)).float()
    keys = torch.randint(-3, 4, (table, dim)).float()
    keys[1] = 0.0  # scores exactly zero for every row
    weights = 2.0 ** torch.randint(-2, 2, (rows, heads)).float()
    weights[0] = -weights[0]  # row 0 scores <= 0: its relu zeros tie with the zero key's
    key_rows = torch.randint(0, table, (rows, num_keys))
    valid = torch.rand(rows, num_keys) < 0.9
    return q, weights, keys, key_rows, valid, 0.25


@pytest.mark.parametrize("k", [4, 40, 64, 200])
def test_kernel_selection_on_exact_ties(k):
    case = integer_case()
    ref = reference.scores(*case)
    got = index_topk.scores(*case)
    assert torch.equal(got, ref)
    want = oracle_select(ref, k)
    assert torch.equal(reference.select(ref, k)[0], want[0])
    # a path that summed its zeros to -0.0 (other order, other padding) selects the same
    flipped = torch.where(ref == 0, -0.0, ref)
    assert torch.equal(reference.select(flipped, k)[0], want[0])
    slots, ok = index_topk.index_topk(*case[:5], k, case[5])
    assert torch.equal(slots, want[0]) and torch.equal(ok, want[1])


@pytest.mark.parametrize("fns", [reference, index_topk], ids=["reference", "triton"])
def test_invalid_slots_never_read(fns, tol):
    """Invalid slots naming the NaN row, -1, or rows far outside the table (a read would
    fault) score -inf and change no valid score."""
    q, weights, keys, key_rows, valid, scale = make_case(rows=4, num_keys=70)
    junk = torch.tensor([NAN_ROW, -1, 1 << 40, -(1 << 40)])
    far = key_rows.clone()
    far[~valid] = junk[torch.randint(0, 4, (int((~valid).sum()),))]
    ref = reference.scores(q, weights, keys, torch.where(valid, key_rows, 1), valid, scale)
    got = fns.scores(q, weights, keys, far, valid, scale)
    assert_scores_close(ref, got, valid, tol(torch.float32))


def test_kernel_batch_invariant():
    """Bitwise: each row alone (its own N) equals the same row in a batch, in another order,
    padded with invalid slots (10 more: same last block; 150 more: more blocks)."""
    q, weights, keys, key_rows, valid, scale = make_case(rows=5, heads=8, num_keys=40)
    alone = [
        index_topk.scores(q[r : r + 1], weights[r : r + 1], keys, key_rows[r : r + 1],
                          valid[r : r + 1], scale)[0]
        for r in range(5)
    ]  # fmt: skip
    order = torch.tensor([3, 0, 4, 1, 2])
    for extra in (10, 150):
        wide_rows = torch.cat([key_rows, torch.full((5, extra), -1)], dim=1)[order]
        wide_valid = torch.cat([valid, torch.zeros(5, extra, dtype=torch.bool)], dim=1)[order]
        got = index_topk.scores(q[order], weights[order], keys, wide_rows, wide_valid, scale)
        for i, r in enumerate(order.tolist()):
            assert torch.equal(got[i, :40], alone[r]), f"row {r} differs with {extra} more"


def test_kernel_strided_inputs(tol):
    """q, weights, keys, key_rows and valid as strided views of larger tensors."""
    q, weights, keys, key_rows, valid, scale = make_case(rows=4, num_keys=30)
    wide_q = torch.randn(4, 2, 4, 32)
    wide_q[:, 1] = q
    wide_w = torch.randn(4, 4, 2)
    wide_w[..., 0] = weights
    wide_keys = torch.randn(keys.shape[0], 3, 32)
    wide_keys[:, 2] = keys
    wide_rows = torch.full((4, 60), -1)
    wide_rows[:, ::2] = key_rows
    wide_valid = torch.zeros(4, 60, dtype=torch.bool)
    wide_valid[:, ::2] = valid
    args = (wide_q[:, 1], wide_w[..., 0], wide_keys[:, 2], wide_rows[:, ::2], wide_valid[:, ::2])
    ref = reference.scores(q, weights, keys, key_rows, valid, scale)
    assert torch.equal(reference.scores(*args, scale), ref)
    assert_scores_close(ref, index_topk.scores(*args, scale), valid, tol(torch.float32))


@pytest.mark.parametrize("fns", [reference, index_topk], ids=["reference", "triton"])
def test_empty_and_bad_shapes(fns):
    q, weights, keys, key_rows, valid, scale = make_case(rows=3)
    slots, ok = fns.index_topk(q, weights, keys, key_rows[:, :0], valid[:, :0], 4, scale)
    assert slots.shape == (3, 4) and not ok.any()  # no slot: all padding
    slots, ok = fns.index_topk(q[:0], weights[:0], keys, key_rows[:0], valid[:0], 4, scale)
    assert slots.shape == (0, 4) and ok.shape == (0, 4)
    bad = {
        "q": (q[0], weights, keys, key_rows, valid),
        "weights": (q, weights[:, :2], keys, key_rows, valid),
        "keys": (q, weights, keys[:, :16], key_rows, valid),
        "valid": (q, weights, keys, key_rows, valid[:, :5]),
        "key_rows": (q, weights, keys, key_rows[:2], valid),
    }
    for name, args in bad.items():
        with pytest.raises(ValueError, match=name):
            fns.index_topk(*args, 4, scale)


def test_kernel_bad_dtypes():
    q, weights, keys, key_rows, valid, scale = make_case(rows=3)
    with pytest.raises(ValueError, match="keys"):
        index_topk.index_topk(q, weights, keys.bfloat16(), key_rows, valid, 4, scale)
    with pytest.raises(ValueError, match="valid"):
        index_topk.index_topk(q, weights, keys, key_rows, valid.int(), 4, scale)


def test_an_overlapping_table_over_a_whole_arena(tol):
    """The table kern's CUDA backend passes (``compressed_attention._table``): every element
    of an arena starts a row (stride 1 between rows); kernel and reference read the same."""
    dim, heads, rows, num_keys = 32, 8, 3, 20
    arena = torch.randn(6 * 500 + dim)
    table = arena.as_strided((arena.numel() - dim + 1, dim), (1, 1), 0)
    key_rows = torch.randint(0, 6, (rows, num_keys)) * 500 + torch.randint(0, 8, (1,)) * dim
    valid = torch.rand(rows, num_keys) < 0.8
    q, weights = torch.randn(rows, heads, dim), torch.rand(rows, heads)
    ref = reference.scores(q, weights, table, key_rows, valid, dim**-0.5)
    got = index_topk.scores(q, weights, table, key_rows, valid, dim**-0.5)
    assert_scores_close(ref, got, valid, tol(torch.float32))
