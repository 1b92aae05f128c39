import pytest
import torch

from kern.kernels.compressor_pool import compressor_pool, reference


def make_case(lens, prefixes, dim=64, gap=2):
    """Windows of `lens[g]` rows, laid out in reverse order with `gap` rows in no window
    before each (NaN: reading one would show). Window g resumes a partial window of
    `prefixes[g]` earlier rows (its init is their accumulator; 0: a fresh one from
    `empty`). Returns the kernel's arguments and, per window, all its rows (the earlier
    ones first) for the oracle."""
    num = len(lens)
    starts, row = [0] * num, 0
    for g in reversed(range(num)):
        row += gap
        starts[g] = row
        row += lens[g]
    values = torch.full((row + gap, dim), float("nan"))
    gate = torch.full((row + gap, dim), float("nan"))
    init = reference.empty(num, dim)
    whole = []
    for g, (n, p) in enumerate(zip(lens, prefixes, strict=True)):
        v, w = torch.randn(p + n, dim), 3 * torch.randn(p + n, dim)
        values[starts[g] : starts[g] + n], gate[starts[g] : starts[g] + n] = v[p:], w[p:]
        for k in range(p):
            init[g : g + 1] = reference.update(init[g : g + 1], v[k : k + 1], w[k : k + 1])
        whole.append((v, w))
    case = (values, gate, torch.tensor(starts), torch.tensor(lens), init)
    return case, whole


def oracle(case, whole):
    """Float64: each window's (max, sum of weights, weighted sum) after each of its rows,
    a plain softmax over all its rows so far (the earlier ones included)."""
    values, _, starts, lens, init = case
    hist = torch.zeros(values.shape[0], 3, values.shape[1], dtype=torch.float64)
    for g, (v, w) in enumerate(whole):
        p = v.shape[0] - int(lens[g])
        for k in range(int(lens[g])):
            vs, ws = v[: p + k + 1].double(), w[: p + k + 1].double()
            top = ws.amax(0)
            e = torch.exp(ws - top)
            hist[int(starts[g]) + k] = torch.stack([top, e.sum(0), (e * vs).sum(0)])
    return hist


# (lens, prefixes, dim): windows of 1..m rows, fresh and resumed; dim a power of two, not
# one, and wider than a block (several programs per window).
CASES = [
    pytest.param([1, 2, 3, 4, 5], [0, 0, 3, 0, 2], 64, id="D64"),
    pytest.param([3, 1, 4], [1, 0, 0], 40, id="D40"),
    pytest.param([2, 4], [0, 3], 512, id="D512"),
]


def assert_hist_close(name, ref, got, tol, assert_close):
    """The max is exact (no rounding); the two sums to `tol`."""
    assert torch.equal(got[:, 0].double(), ref[:, 0].double()), f"{name}: max differs"
    assert_close(f"{name} sum of weights", ref[:, 1], got[:, 1], tol)
    assert_close(f"{name} weighted sum", ref[:, 2], got[:, 2], tol)


@pytest.mark.parametrize(("lens", "prefixes", "dim"), CASES)
def test_reference_matches_oracle(lens, prefixes, dim, assert_close, tol):
    case, whole = make_case(lens, prefixes, dim)
    got = reference.compressor_pool(*case)
    assert got.dtype == torch.float32
    assert_hist_close("hist", oracle(case, whole), got, tol(torch.float32), assert_close)


@pytest.mark.parametrize(("lens", "prefixes", "dim"), CASES)
def test_kernel_matches_reference(lens, prefixes, dim, assert_close, tol):
    case, _ = make_case(lens, prefixes, dim)
    ref = reference.compressor_pool(*case)
    got = compressor_pool.compressor_pool(*case)
    assert got.dtype == torch.float32
    assert_hist_close("hist", ref, got, tol(torch.float32), assert_close)


@pytest.mark.parametrize("fns", [reference, compressor_pool], ids=["reference", "triton"])
def test_rows_in_no_window_stay_zero(fns):
    """Gap rows (NaN values, never read), an empty window and G = 0 leave zeros."""
    case, _ = make_case([2, 0, 3], [0, 0, 1], dim=40)
    values, gate, starts, lens, init = case
    hist = fns.compressor_pool(*case)
    inside = torch.zeros(values.shape[0], dtype=torch.bool)
    for s, n in zip(starts.tolist(), lens.tolist(), strict=True):
        inside[s : s + n] = True
    assert int(inside.sum()) == 5
    assert torch.isfinite(hist[inside]).all()
    assert torch.equal(hist[~inside], torch.zeros_like(hist[~inside]))
    none = fns.compressor_pool(values, gate, starts[:0], lens[:0], init[:0])
    assert torch.equal(none, torch.zeros(values.shape[0], 3, 40))


def test_kernel_batch_invariant():
    """Bitwise: a window's rows are the same among the others (G = 4, in any order) as
    alone over its own rows (G = 1, R = its length)."""
    case, _ = make_case([3, 1, 5, 2], [2, 0, 0, 4], dim=40)
    values, gate, starts, lens, init = case
    order = torch.tensor([2, 0, 3, 1])
    together = compressor_pool.compressor_pool(
        values, gate, starts[order], lens[order], init[order]
    )
    for g in range(4):
        s, n = int(starts[g]), int(lens[g])
        alone = compressor_pool.compressor_pool(
            values[s : s + n], gate[s : s + n], torch.tensor([0]), lens[g : g + 1], init[g : g + 1]
        )
        assert torch.equal(together[s : s + n], alone), f"window {g} differs in the batch"


def test_kernel_strided_inputs(assert_close, tol):
    """values, gate and init as views: a row stride past dim, a transposed last dim, a
    strided init (the wrapper copies what it must)."""
    case, _ = make_case([2, 3], [1, 0], dim=40)
    values, gate, starts, lens, init = case
    wide = torch.randn(values.shape[0], 2, 40)
    wide[:, 1] = values
    gate_t = gate.T.contiguous().T  # last dim stride R
    init_wide = torch.randn(2, 3, 2, 40)
    init_wide[:, :, 0] = init
    args = (wide[:, 1], gate_t, starts, lens, init_wide[:, :, 0])
    ref = reference.compressor_pool(*case)
    assert torch.equal(reference.compressor_pool(*args), ref)
    assert_hist_close(
        "hist", ref, compressor_pool.compressor_pool(*args), tol(torch.float32), assert_close
    )


@pytest.mark.parametrize("fns", [reference, compressor_pool], ids=["reference", "triton"])
def test_bad_shapes(fns):
    case, _ = make_case([2, 1], [0, 0], dim=64)
    values, gate, starts, lens, init = case
    bad = [
        ("values", (values[None], gate, starts, lens, init)),
        ("gate", (values, gate[:, :32], starts, lens, init)),
        ("starts", (values, gate, starts[None], lens, init)),
        ("starts", (values, gate, starts[0], lens[0], init)),  # 0-d
        ("lens", (values, gate, starts, lens[:1], init)),
        ("init", (values, gate, starts, lens, init[:, :2])),
    ]
    for name, args in bad:
        with pytest.raises(ValueError, match=name):
            fns.compressor_pool(*args)


@pytest.mark.parametrize("fns", [reference, compressor_pool], ids=["reference", "triton"])
def test_chunked_equals_one_shot(fns):
    """Bitwise: a window fed in two calls (the second resumes from the first's last row)
    equals the same window fed in one, at every split."""
    case, _ = make_case([5], [2], dim=40)
    values, gate, starts, lens, init = case
    whole = fns.compressor_pool(*case)
    s = int(starts[0])
    for cut in range(1, 5):
        first = fns.compressor_pool(values, gate, starts, torch.tensor([cut]), init)
        rest = fns.compressor_pool(
            values, gate, starts + cut, torch.tensor([5 - cut]), first[s + cut - 1][None]
        )
        assert torch.equal(first[s : s + cut], whole[s : s + cut]), f"split at {cut}"
        assert torch.equal(rest[s + cut : s + 5], whole[s + cut : s + 5]), f"split at {cut}"
