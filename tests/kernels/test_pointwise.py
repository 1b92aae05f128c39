import pytest
import torch
import torch.nn.functional as F

from kern.kernels.pointwise import pointwise


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
