"""Triton silu_and_mul; same signature as `reference.py`.

Design notes: elementwise over a [BT, BI] tile of gate and the matching tile of up, in
float32. Autotuned over tile shape and warps, keyed on INTER (= I) only.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._triton import autotune_configs, check_device

SILU_AND_MUL_CONFIGS = [
    triton.Config({"BT": bt, "BI": bi}, num_warps=w)
    for bt, bi, w in ((4, 256, 4), (1, 1024, 4), (8, 512, 8), (16, 256, 8))
]


@triton.autotune(configs=autotune_configs(SILU_AND_MUL_CONFIGS), key=["INTER"])
@triton.jit(do_not_specialize=["T"])
def silu_and_mul_kernel(
    x, y, T, INTER: tl.constexpr, stride_x, stride_y, BT: tl.constexpr, BI: tl.constexpr
):
    i_t, i_i = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_i = i_i * BI + tl.arange(0, BI)
    m = (o_t < T)[:, None] & (o_i < INTER)[None, :]
    p_gate = x + o_t[:, None] * stride_x + o_i[None, :]
    b_gate = tl.load(p_gate, mask=m, other=0.0).to(tl.float32)
    b_up = tl.load(p_gate + INTER, mask=m, other=0.0).to(tl.float32)
    b_y = b_gate * tl.sigmoid(b_gate) * b_up
    tl.store(y + o_t[:, None] * stride_y + o_i[None, :], b_y.to(y.dtype.element_ty), mask=m)


def silu_and_mul(x: Tensor) -> Tensor:
    """See `reference.silu_and_mul`. Pure: returns a new [T, I] tensor."""
    check_device(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    y = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(num_tokens, meta["BT"]), triton.cdiv(inter, meta["BI"]))  # noqa: E731
    silu_and_mul_kernel[grid](x, y, num_tokens, inter, x.stride(0), y.stride(0))
    return y
