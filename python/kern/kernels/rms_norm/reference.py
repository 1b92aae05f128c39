"""Torch reference for RMSNorm and the gated RMSNorm of Qwen3.5's gated DeltaNet.

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


def gated_rms_norm(x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3.5's `Qwen3_5RMSNormGated`: rms_norm(x) * weight * silu(z), per head.

    x, z: [T, D] (D = linear_value_head_dim; flatten heads into T), weight: [D] (stored as is,
    no offset). Copies transformers' casts exactly: the normalised x is rounded to x.dtype
    before the weight multiplies it, silu(z) is taken in float32, the product is returned in
    x.dtype. In float32 every cast is a no-op. Pure.
    """
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    normed = x32 * torch.rsqrt(variance + eps)
    y = weight * normed.to(x.dtype)
    y = y * pointwise(F.silu, z.float())
    return y.to(x.dtype)
