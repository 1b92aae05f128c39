"""Torch reference for RMSNorm and the gated RMSNorm of the delta-rule mixers (Qwen3.5, Kimi).

Float32 throughout, one rounding to the output dtype at the end (except where the gated
norm copies transformers' own cast, see `gated_rms_norm`). Every reduction runs along the
last dim of one row (rsqrt is correctly rounded on every path), and silu goes through
`pointwise`, so a row's result does not depend on which rows share the call.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from ..pointwise import pointwise


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, offset: float = 0.0) -> Tensor:
    """y = x * rsqrt(mean(x^2, -1) + eps) * (offset + weight), in float32, returned in x.dtype.

    x: [T, D] (any leading dims work), weight: [D]. `offset=1.0` is Qwen3.5's zero-centred
    norm, whose checkpoints store w - 1 (`Qwen3_5RMSNorm`); Qwen3 uses `offset=0.0`.
    Pure: nothing is mutated.
    """
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    # Same op order as transformers' Qwen3_5RMSNorm (norm first, then the weight): bitwise
    # equal to it in float32.
    y = x32 * torch.rsqrt(variance + eps)
    return (y * (offset + weight.float())).to(x.dtype)


def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, *, offset: float = 0.0
) -> tuple[Tensor, Tensor]:
    """(x + residual, rms_norm of it): the residual add rounded to x.dtype as torch's add
    stores it, then :func:`rms_norm` of that sum. Pure."""
    total = x + residual
    return total, rms_norm(total, weight, eps, offset=offset)


def gated_rms_norm(
    x: Tensor, z: Tensor, weight: Tensor, eps: float, *, gate: str = "silu"
) -> Tensor:
    """rms_norm(x) * weight * act(z), per head: Qwen3.5's `Qwen3_5RMSNormGated` (``gate``
    "silu") or Kimi's delta attention output norm (``gate`` "sigmoid").

    x, z: [T, D] (D = the head dim; flatten heads into T), weight: [D] (stored as is, no
    offset). Copies transformers' casts exactly: Qwen3.5 rounds the normalised x to x.dtype
    before the weight multiplies it; Kimi keeps everything in float32; both take the gate in
    float32 and return the product in x.dtype. In float32 every cast is a no-op. Pure.
    """
    if gate not in ("silu", "sigmoid"):
        raise ValueError(f"gate must be 'silu' or 'sigmoid', got {gate!r}")
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    normed = x32 * torch.rsqrt(variance + eps)
    if gate == "silu":
        y = weight * normed.to(x.dtype)
        y = y * pointwise(F.silu, z.float())
    else:
        y = weight.float() * normed
        y = y * pointwise(torch.sigmoid, z.float())
    return y.to(x.dtype)
