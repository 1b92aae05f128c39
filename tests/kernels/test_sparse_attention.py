import types

import pytest
import torch

from kern.kernels.sparse_attention import reference, sparse_attention

NAN_ROW = 0  # a table row only invalid slots name: NaN, so reading it would show


def make_case(rows=5, heads=4, dim=64, num_keys=12, dtype=torch.float32, table=40):
    """A batch as the backend builds one: each row's window slots (invalid first, as for a
    young sequence) then its compressed slots (some invalid), over a shared key table.
    Row 1's only valid key is its own entry; row 2 has no valid key; invalid slots name
    the NaN row or -1."""
    keys = torch.randn(table, dim).to(dtype)
    keys[NAN_ROW] = float("nan")
    key_rows = torch.randint(1, table, (rows, num_keys))
    valid = torch.rand(rows, num_keys) < 0.7
    valid[0, : num_keys // 3] = False  # window slots before the sequence's start
    valid[1] = False
    valid[1, num_keys // 2 - 1] = True  # the row's own entry, alone
    valid[2] = False
    key_rows[~valid] = torch.where(torch.rand(int((~valid).sum())) < 0.5, NAN_ROW, -1)
    q = torch.randn(rows, heads, dim).to(dtype)
    sinks = torch.randn(heads)
    return q, keys, key_rows, valid, sinks, dim**-0.5


def dense(q, keys, key_rows, valid, sinks, scale):
    """Oracle in float64: a plain softmax over each row's valid keys and the sink."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for r in range(q.shape[0]):
        k = keys[key_rows[r][valid[r]]].double()  # [n, D]
        s = q[r].double() @ k.T * scale  # [H, n]
        p = torch.softmax(torch.cat([s, sinks.double()[:, None]], dim=1), dim=1)
        out[r] = p[:, :-1] @ k
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_matches_dense(dtype, assert_close, tol):
    case = make_case(rows=6, heads=4, dim=64, num_keys=37, dtype=dtype)
    got = reference.sparse_attention(*case)
    assert got.dtype == dtype
    assert torch.equal(got[2], torch.zeros_like(got[2]))  # only the sink: zeros
    want = dense(*case)
    assert_close("o", want, got, 1e-6 if dtype == torch.float32 else tol(dtype))


# (rows, heads, dim, keys): one key block; several, the first fully invalid; a second,
# partly masked head block; D not a power of two; V4's heads and head dim.
SHAPES = [
    pytest.param(5, 4, 64, 12, id="R5-H4-D64-J12"),
    pytest.param(4, 4, 64, 70, id="R4-H4-D64-J70"),
    pytest.param(3, 20, 32, 12, id="R3-H20-D32-J12"),
    pytest.param(3, 4, 40, 12, id="R3-H4-D40-J12"),
    pytest.param(3, 64, 512, 40, id="R3-H64-D512-J40"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("rows", "heads", "dim", "num_keys"), SHAPES)
def test_kernel_matches_reference(rows, heads, dim, num_keys, dtype, assert_close, tol):
    case = make_case(rows, heads, dim, num_keys, dtype)
    ref = reference.sparse_attention(*case)
    got = sparse_attention.sparse_attention(*case)
    assert got.dtype == dtype
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    assert_close("o", ref, got, tol(dtype))


def test_kernel_strided_inputs(assert_close, tol):
    """q, keys, key_rows and valid as strided views of larger tensors."""
    q, keys, key_rows, valid, sinks, scale = make_case(rows=4, num_keys=20)
    wide_q = torch.randn(4, 2, 4, 64)
    wide_q[:, 1] = q
    wide_keys = torch.randn(keys.shape[0], 2, 64)
    wide_keys[:, 0] = keys
    wide_rows = torch.zeros(4, 40, dtype=torch.long)
    wide_rows[:, ::2] = key_rows
    wide_valid = torch.zeros(4, 40, dtype=torch.bool)
    wide_valid[:, ::2] = valid
    args = (wide_q[:, 1], wide_keys[:, 0], wide_rows[:, ::2], wide_valid[:, ::2], sinks, scale)
    ref = reference.sparse_attention(q, keys, key_rows, valid, sinks, scale)
    assert torch.equal(reference.sparse_attention(*args), ref)
    assert_close("o", ref, sparse_attention.sparse_attention(*args), tol(torch.float32))


def pad_keys(case, extra):
    """The same rows with `extra` more invalid slots after their own (a wider batch)."""
    q, keys, key_rows, valid, sinks, scale = case
    rows = key_rows.shape[0]
    key_rows = torch.cat([key_rows, torch.full((rows, extra), -1)], dim=1)
    valid = torch.cat([valid, torch.zeros(rows, extra, dtype=torch.bool)], dim=1)
    return q, keys, key_rows, valid, sinks, scale


def assert_batch_invariant(fn):
    """Bitwise: each row alone (its own J) equals the same row in a batch, in another order,
    padded to a wider J (20 keys: same power-of-two width; 70: wider, more key blocks)."""
    q, keys, key_rows, valid, sinks, scale = case = make_case(rows=5, num_keys=12)
    one = [(q[r : r + 1], keys, key_rows[r : r + 1], valid[r : r + 1]) for r in range(5)]
    alone = [fn(*args, sinks, scale)[0] for args in one]
    order = torch.tensor([3, 0, 4, 1, 2])
    for extra in (8, 58):
        q, keys, key_rows, valid, sinks, scale = pad_keys(case, extra)
        got = fn(q[order], keys, key_rows[order], valid[order], sinks, scale)
        for i, r in enumerate(order.tolist()):
            assert torch.equal(got[i], alone[r]), f"row {r} differs with {extra} more keys"


def test_reference_batch_invariant():
    assert_batch_invariant(reference.sparse_attention)


def test_kernel_batch_invariant():
    assert_batch_invariant(sparse_attention.sparse_attention)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_equals_attend(dtype):
    """Bitwise: the reference over the flattened table equals the backend's `attend` over
    the window's page view and the gathered compressed entries (the plan's three window
    fields are all `attend` reads)."""
    from kern.models.deepseek_v4.attention import attend

    rows, heads, dim, pages, page_tokens, window, extra_keys = 5, 4, 64, 6, 8, 10, 7
    view = torch.randn(pages, page_tokens, dim).to(dtype)
    plan = types.SimpleNamespace(
        window_pages=torch.randint(0, pages, (rows, window)),
        window_offsets=torch.randint(0, page_tokens, (rows, window)),
        window_valid=torch.rand(rows, window) < 0.8,
    )
    plan.window_valid[0, :6] = False
    extra = torch.randn(rows, extra_keys, dim).to(dtype)
    extra_valid = torch.rand(rows, extra_keys) < 0.6
    q = torch.randn(rows, heads, dim).to(dtype)
    sinks = torch.randn(heads)
    scale = dim**-0.5
    want = attend(plan, q, view, extra, extra_valid, sinks, scale)

    keys = torch.cat([view.reshape(-1, dim), extra.reshape(-1, dim)])
    flat = pages * page_tokens + torch.arange(rows * extra_keys).view(rows, extra_keys)
    key_rows = torch.cat([plan.window_pages * page_tokens + plan.window_offsets, flat], dim=1)
    valid = torch.cat([plan.window_valid, extra_valid], dim=1)
    got = reference.sparse_attention(q, keys, key_rows, valid, sinks, scale)
    assert torch.equal(got, want)


@pytest.mark.parametrize("fns", [reference, sparse_attention], ids=["reference", "triton"])
def test_empty_and_bad_shapes(fns):
    q, keys, key_rows, valid, sinks, scale = make_case(rows=3)
    none = fns.sparse_attention(q, keys, key_rows[:, :0], valid[:, :0], sinks, scale)
    assert torch.equal(none, torch.zeros_like(q))  # no keys: only the sink
    with pytest.raises(ValueError, match="sinks"):
        fns.sparse_attention(q, keys, key_rows, valid, sinks[:3], scale)
    with pytest.raises(ValueError, match="valid"):
        fns.sparse_attention(q, keys, key_rows, valid.int(), sinks, scale)
    with pytest.raises(ValueError, match="keys"):
        fns.sparse_attention(q, keys[:, :32], key_rows, valid, sinks, scale)


def test_an_overlapping_table_over_a_whole_arena():
    """The table kern's CUDA backend passes (``compressed_attention.key_rows``): every
    element of an arena starts a row (stride 1 between rows), rows picked at part offsets
    inside pages; kernel and reference read the same values."""
    dim, heads, rows, num_keys = 64, 4, 3, 10
    arena = torch.randn(6 * 1000 + dim)
    table = arena.as_strided((arena.numel() - dim + 1, dim), (1, 1), 0)
    key_rows = torch.randint(0, 6, (rows, num_keys)) * 1000 + 16 + torch.randint(0, 8, (1,)) * dim
    valid = torch.rand(rows, num_keys) < 0.8
    valid[:, -1] = True
    q = torch.randn(rows, heads, dim)
    sinks = torch.randn(heads)
    want = reference.sparse_attention(q, table, key_rows, valid, sinks, dim**-0.5)
    got = sparse_attention.sparse_attention(q, table, key_rows, valid, sinks, dim**-0.5)
    gathered = arena.unfold(0, dim, 1)[key_rows]  # the same rows, copied out
    assert torch.equal(table[key_rows], gathered)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
