"""Torch reference for a linear layer: x @ w.T (+ bias), accumulated in float32."""

from torch import Tensor


def linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """[M, K] x [N, K] (+ [N]) -> [M, N] in x.dtype: the products summed in float32, then the
    bias added in float32, then one rounding to x.dtype (what the kernel does)."""
    out = x.float() @ w.float().t()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


def linear_silu_and_mul(x: Tensor, w: Tensor) -> Tensor:
    """x [M, K] by the gate-then-up weight w [2 I, K] -> [M, I]: :func:`linear`, then
    ``silu_and_mul``'s reference on it (what the fused kernel computes)."""
    from ..silu_and_mul.reference import silu_and_mul

    return silu_and_mul(linear(x, w))
