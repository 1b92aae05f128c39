import pytest
import torch

from kern.kernels.matmul import matmul, reference


@pytest.mark.parametrize(
    ("m", "n", "k", "dtype", "bias"),
    [
        pytest.param(1, 96, 80, torch.float32, False, id="M1-N96-K80-fp32"),
        pytest.param(5, 300, 130, torch.float32, True, id="M5-N300-K130-fp32-bias"),
        pytest.param(70, 2048, 64, torch.bfloat16, False, id="M70-N2048-K64-bf16"),
        pytest.param(3, 40, 24, torch.bfloat16, True, id="M3-N40-K24-bf16-bias"),
        pytest.param(9, 64, 8300, torch.float32, True, id="M9-N64-K8300-fp32-bias-split"),
    ],
)
def test_linear_kernel(m, n, k, dtype, bias, assert_close, tol):
    x = torch.randn(m, k).to(dtype)
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    got = matmul.linear(x, w, b)
    assert got.shape == (m, n) and got.dtype == dtype
    assert_close("y", reference.linear(x, w, b), got, tol(dtype))


SPLIT = (64, 32, 64, 4, 3, 3)  # K cut in 3: the split-K path, whatever tile() picks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("n", "k", "tile"),
    [(96, 80, None), (512, 128, None), (64, 1024, SPLIT)],
    ids=["96x80", "512x128", "64x1024-split3"],
)
def test_a_rows_bits_do_not_depend_on_its_batch(n, k, tile, dtype):
    """The same row alone, among 3, 16, 64 and 130 rows, at the first, a middle and the last
    place of its batch, and as row 0 of a strided view: the same bits every time."""
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    tile = tile or matmul.tile(n, k)

    def linear(x):
        return matmul.linear_tiled(x.contiguous(), w, None, tile)

    pool = torch.randn(200, k).to(dtype)
    row = pool[7:8]
    want = linear(row)
    torch.testing.assert_close(want, reference.linear(row, w), rtol=2e-2, atol=2e-2)
    for m in (3, 16, 64, 130):
        for place in (0, m // 2, m - 1):
            batch = pool[20 : 20 + m].clone()
            batch[place] = row[0]
            got = linear(batch)[place : place + 1]
            assert torch.equal(got, want), (m, place)
    wide = torch.cat([pool[7:8], pool[7:8]], dim=1)[:, :k]  # row stride 2k
    assert torch.equal(matmul.linear(wide, w), matmul.linear(row, w))


def test_tile_depends_on_the_weight_only():
    assert matmul.tile(3072, 1024) == matmul.tile(3072, 1024)
    for n, k in ((96, 80), (2048, 1024), (151936, 1024), (64, 1024), (2560, 9728)):
        bm, bn, bk, warps, stages, splits = matmul.tile(n, k)
        assert bm >= 16 and bn >= 16 and bk >= 16 and warps in (1, 2, 4, 8) and stages >= 1
        assert 1 <= splits <= max(1, k // bk)
    assert matmul.tile(64, 8300)[5] > 1  # the split-K path, as the kernel test above runs it


def test_mistakes_are_named():
    with pytest.raises(ValueError, match=r"want \[M, K\], \[N, K\]"):
        matmul.linear(torch.randn(2, 8), torch.randn(4, 9))
    with pytest.raises(ValueError, match="same dtype"):
        matmul.linear(torch.randn(2, 8), torch.randn(4, 8).bfloat16())
    assert matmul.linear(torch.randn(0, 8), torch.randn(4, 8)).shape == (0, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("m", "inter", "k"),
    [(1, 48, 80), (5, 128, 130), (70, 40, 64), (3, 32, 8300)],
    ids=["M1-I48", "M5-I128", "M70-I40-tile-across-gate-and-up", "M3-K8300-split"],
)
def test_linear_silu_and_mul_is_the_two_launches_bit_for_bit(m, inter, k, dtype):
    """The fused gate_up linear and SwiGLU give the unfused pair's bits (the gate_up linear at
    its own tile, then silu_and_mul), and the references' within rounding."""
    from kern.kernels.silu_and_mul import silu_and_mul

    x = torch.randn(m, k).to(dtype)
    w = (torch.randn(2 * inter, k) / k**0.5).to(dtype)
    got = matmul.linear_silu_and_mul(x, w)
    assert got.shape == (m, inter) and got.dtype == dtype
    assert torch.equal(got, silu_and_mul.silu_and_mul(matmul.linear(x, w)))
    want = reference.linear_silu_and_mul(x, w)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="want \\[M, K\\], \\[2 I, K\\]"):
        matmul.linear_silu_and_mul(x, w[:-1])
