import pytest
import torch
import torch.nn.functional as F

from kern.kernels.silu_and_mul import reference, silu_and_mul


@pytest.mark.parametrize(
    ("num_tokens", "inter", "dtype"),
    [
        pytest.param(1, 64, torch.float32, id="T1-I64-fp32"),
        pytest.param(7, 300, torch.float32, id="T7-I300-fp32"),
        pytest.param(63, 1000, torch.bfloat16, id="T63-I1000-bf16"),
        pytest.param(130, 96, torch.float16, id="T130-I96-fp16"),
    ],
)
def test_silu_and_mul_kernel(num_tokens, inter, dtype, assert_close, tol):
    x = (torch.randn(num_tokens, 2 * inter) * 3).to(dtype)
    got = silu_and_mul.silu_and_mul(x)
    assert got.shape == (num_tokens, inter) and got.dtype == dtype
    assert_close("y", reference.silu_and_mul(x), got, tol(dtype))


@pytest.mark.parametrize("inter", [100, 256])
def test_reference_row_invariant(inter):
    x = torch.randn(700, 2 * inter)
    want = reference.silu_and_mul(x[7:8])[0]
    for num_rows in (2, 3, 5, 16, 700):
        rows = torch.randperm(700)[:num_rows]
        rows[num_rows // 2] = 7
        assert torch.equal(reference.silu_and_mul(x[rows])[num_rows // 2], want), num_rows


def test_reference_matches_mlp_activation():
    """Bitwise the act_fn(gate) * up of transformers' Qwen MLPs, in float32."""
    gate, up = torch.randn(5, 64), torch.randn(5, 64)
    assert torch.equal(reference.silu_and_mul(torch.cat([gate, up], dim=-1)), F.silu(gate) * up)
