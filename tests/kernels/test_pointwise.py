import pytest
import torch
import torch.nn.functional as F

from kern.kernels.pointwise import pointwise, sigmoid, silu, softplus


@pytest.mark.parametrize("cols", [1, 24, 100, 64, 40000])
@pytest.mark.parametrize("fn", [F.silu, torch.exp, torch.cos], ids=["silu", "exp", "cos"])
def test_pointwise_row_invariant(fn, cols):
    """A row's bits are those it gets alone, for any row count (also past ATen's grain)."""
    x = torch.randn(1500 if cols < 1000 else 4, cols)
    alone = [pointwise(fn, x[i : i + 1])[0] for i in range(3)]
    for num_rows in (2, 3, 17, x.shape[0]):
        got = pointwise(fn, x[:num_rows])
        for i in range(min(num_rows, 3)):
            assert torch.equal(got[i], alone[i]), (num_rows, i)


def test_pointwise_is_fn():
    x = torch.randn(3, 5, 70)
    assert torch.allclose(pointwise(F.silu, x), F.silu(x), rtol=1e-6, atol=0)
    assert pointwise(F.silu, x[:, :, 3:]).shape == (3, 5, 67)


COMPOSED = [(sigmoid, torch.sigmoid), (silu, F.silu), (softplus, F.softplus)]


@pytest.mark.parametrize("cols", [1, 24, 48, 100, 64])
@pytest.mark.parametrize("ours, _", COMPOSED, ids=["sigmoid", "silu", "softplus"])
def test_composed_row_invariant(ours, _, cols):
    """The CPU backend's composed functions: a row's bits are those it gets alone, for any
    row count, with no padding (widths that leave a scalar tail included)."""
    gen = torch.Generator().manual_seed(cols)
    x = torch.randn(1500, cols, generator=gen, device="cpu").to(torch.get_default_device()) * 8
    alone = [ours(x[i : i + 1])[0] for i in range(3)]
    for num_rows in (2, 3, 17, x.shape[0]):
        got = ours(x[:num_rows])
        for i in range(3 if num_rows >= 3 else num_rows):
            assert torch.equal(got[i], alone[i]), (num_rows, i)
    # and the same element wherever it sits: the last row alone equals its place in the batch
    assert torch.equal(ours(x)[-1], ours(x[-1:])[0])


@pytest.mark.parametrize("ours, theirs", COMPOSED, ids=["sigmoid", "silu", "softplus"])
def test_composed_is_fn(ours, theirs):
    x = torch.cat([torch.randn(4000) * 8, torch.tensor([-100.0, -20.0, 0.0, 20.0, 20.5, 90.0])])
    torch.testing.assert_close(ours(x), theirs(x), rtol=2e-6, atol=1e-7)
    assert not ours(x).isnan().any()
