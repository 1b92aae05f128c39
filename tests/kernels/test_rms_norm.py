import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

from kern.kernels.rms_norm import reference, rms_norm

EPS = 1e-6
CASES = [
    pytest.param(1, 64, torch.float32, 0.0, id="T1-D64-fp32"),
    pytest.param(7, 100, torch.float32, 1.0, id="T7-D100-fp32-offset1"),
    pytest.param(63, 128, torch.bfloat16, 1.0, id="T63-D128-bf16-offset1"),
    pytest.param(130, 256, torch.float16, 0.0, id="T130-D256-fp16"),
]


@pytest.mark.parametrize(("num_tokens", "dim", "dtype", "offset"), CASES)
def test_rms_norm_kernel(num_tokens, dim, dtype, offset, assert_close, tol):
    x = torch.randn(num_tokens, dim).to(dtype)
    weight = (torch.randn(dim) * 0.1).to(dtype)
    ref = reference.rms_norm(x, weight, EPS, offset=offset)
    got = rms_norm.rms_norm(x, weight, EPS, offset=offset)
    assert got.dtype == dtype
    assert_close("y", ref, got, tol(dtype))


@pytest.mark.parametrize(("num_tokens", "dim", "dtype", "offset"), CASES)
def test_gated_rms_norm_kernel(num_tokens, dim, dtype, offset, assert_close, tol):
    del offset  # the gated norm has none
    x = torch.randn(num_tokens, dim).to(dtype)
    z = torch.randn(num_tokens, dim).to(dtype)
    weight = (1 + torch.randn(dim) * 0.1).to(dtype)
    ref = reference.gated_rms_norm(x, z, weight, EPS)
    got = rms_norm.gated_rms_norm(x, z, weight, EPS)
    assert got.dtype == dtype
    assert_close("y", ref, got, tol(dtype))


def test_kernel_takes_leading_dims(assert_close, tol):
    """q_norm / k_norm are applied per head: [T, H, D] in, same shape out."""
    x = torch.randn(5, 3, 64)
    weight = torch.randn(64)
    got = rms_norm.rms_norm(x, weight, EPS, offset=1.0)
    assert_close("y", reference.rms_norm(x, weight, EPS, offset=1.0), got, tol(torch.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_matches_qwen3_5_norms(dtype):
    """Bitwise: Qwen3.5's zero-centred norm is offset=1.0, its gated norm copies every cast."""
    x = torch.randn(9, 64).to(dtype)
    z = torch.randn(9, 64).to(dtype)
    norm = Qwen3_5RMSNorm(64, eps=EPS).to(dtype)
    gated = Qwen3_5RMSNormGated(64, eps=EPS).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(0, 0.1)
        gated.weight.normal_(1, 0.1)
        want = norm(x)
        want_gated = gated(x, z)
    if dtype == torch.float32:  # in bf16 transformers and the reference round differently
        assert torch.equal(reference.rms_norm(x, norm.weight, EPS, offset=1.0), want)
    assert torch.equal(reference.gated_rms_norm(x, z, gated.weight, EPS), want_gated)


def test_reference_matches_qwen3_norm():
    x = torch.randn(9, 64)
    norm = Qwen3RMSNorm(64, eps=EPS)
    with torch.no_grad():
        norm.weight.normal_(1, 0.1)
        want = norm(x)
    assert torch.equal(reference.rms_norm(x, norm.weight, EPS), want)


@pytest.mark.parametrize("fn", ["rms_norm", "gated_rms_norm"])
def test_reference_row_invariant(fn):
    """A row's bits do not depend on how many rows share the call, nor on its place (D = 100:
    a width where torch's own silu is not row stable)."""
    x = torch.randn(40, 100)
    z = torch.randn(40, 100)
    weight = torch.randn(100)

    def run(rows):
        if fn == "rms_norm":
            return reference.rms_norm(x[rows], weight, EPS, offset=1.0)
        return reference.gated_rms_norm(x[rows], z[rows], weight, EPS)

    want = run(torch.tensor([7]))[0]
    for num_rows in (1, 2, 3, 4, 5, 16, 40):
        rows = torch.randperm(40)[:num_rows]
        rows[num_rows // 2] = 7
        assert torch.equal(run(rows)[num_rows // 2], want), num_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_add_then_the_norm(dtype, assert_close, tol):
    """The fused residual add: the norm kernel on the sum it stores, bit for bit, and the
    reference within rounding. The sum is torch's add bit for bit in float32; in bf16 within
    one rounding here (the interpreter's float32 -> bf16 cast truncates, where torch rounds
    to nearest even, as a GPU does)."""
    x = torch.randn(13, 96).to(dtype)
    r = torch.randn(13, 96).to(dtype)
    weight = torch.randn(96).to(dtype)
    total, y = rms_norm.add_rms_norm(x, r, weight, EPS, offset=1.0)
    assert torch.equal(y, rms_norm.rms_norm(total, weight, EPS, offset=1.0))
    ref_total, ref_y = reference.add_rms_norm(x, r, weight, EPS, offset=1.0)
    if dtype == torch.float32:
        assert torch.equal(total, x + r) and torch.equal(ref_total, total)
    assert_close("sum", ref_total, total, tol(dtype))
    assert_close("y", ref_y, y, tol(dtype))
    with pytest.raises(ValueError, match="residual"):
        rms_norm.add_rms_norm(x, r[:3], weight, EPS)
