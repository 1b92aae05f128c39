"""Torch reference for the SwiGLU activation of the MLP: silu(gate) * up."""

import torch.nn.functional as F
from torch import Tensor

from ..pointwise import pointwise


def silu_and_mul(x: Tensor) -> Tensor:
    """[T, 2I] -> [T, I]: silu(x[:, :I]) * x[:, I:], in float32, returned in x.dtype.

    The caller concatenates gate_proj's output before up_proj's (gate first). Elementwise,
    silu goes through `pointwise` so its bits never depend on T. Pure.
    """
    inter = x.shape[-1] // 2
    x32 = x.float()
    return (pointwise(F.silu, x32[..., :inter]) * x32[..., inter:]).to(x.dtype)
