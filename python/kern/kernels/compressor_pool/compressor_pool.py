"""Triton softmax pooling over windows of rows; same signature as `reference.py`.

Design notes:
- One program per (window, block of BD dims). It loads the window's start and length,
  opens from the window's init and feeds the rows one at a time, in row order, storing the
  accumulator after each: the reference's update, elementwise in float32.
- Every op is per dim and per window, so a window's bits depend only on its own rows and
  init, never on G, R or the other windows (BD changes only which lanes a program holds).
- Rows in no window are never touched; the output starts as zeros. Masked lanes load
  zeros, so they compute finite junk that is never stored.
- Row indices are int64: R * dim may pass 2^31.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._triton import autotune_configs, check_device
from .reference import check_shapes

BLOCK_D = 128  # dims per program at most; a window's row loop is serial, so keep G * D wide

COMPRESSOR_POOL_CONFIGS = [triton.Config({}, num_warps=w) for w in (1, 2, 4)]


@triton.autotune(configs=autotune_configs(COMPRESSOR_POOL_CONFIGS), key=["D"])
@triton.jit
def compressor_pool_kernel(
    values,
    gate,
    starts,
    lens,
    init,
    hist,
    stride_vr,
    stride_gr,
    stride_ig,
    stride_ik,
    stride_hr,
    stride_hk,
    D: tl.constexpr,
    BD: tl.constexpr,
):
    i_g = tl.program_id(0).to(tl.int64)
    i_d = tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    row0 = tl.load(starts + i_g).to(tl.int64)
    n = tl.load(lens + i_g).to(tl.int64)
    p_init = init + i_g * stride_ig + o_d
    b_m = tl.load(p_init, mask=m_d, other=0.0)
    b_s = tl.load(p_init + stride_ik, mask=m_d, other=0.0)
    b_a = tl.load(p_init + 2 * stride_ik, mask=m_d, other=0.0)
    for k in range(0, n):
        r = row0 + k
        b_v = tl.load(values + r * stride_vr + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_g = tl.load(gate + r * stride_gr + o_d, mask=m_d, other=0.0).to(tl.float32)
        # the reference's update: m = -inf (a fresh window) gives old = 0, never NaN
        b_top = tl.maximum(b_m, b_g)
        b_old = tl.exp(b_m - b_top)
        b_new = tl.exp(b_g - b_top)
        b_s = b_s * b_old + b_new
        b_a = b_a * b_old + b_v * b_new
        b_m = b_top
        p_h = hist + r * stride_hr + o_d
        tl.store(p_h, b_m, mask=m_d)
        tl.store(p_h + stride_hk, b_s, mask=m_d)
        tl.store(p_h + 2 * stride_hk, b_a, mask=m_d)


def compressor_pool(
    values: Tensor, gate: Tensor, starts: Tensor, lens: Tensor, init: Tensor
) -> Tensor:
    """See `reference.compressor_pool`. Pure: returns a new [R, 3, dim] float32 tensor.

    Any row strides; a last dim that is not contiguous is copied. Windows must be disjoint
    runs inside [0, R): the kernel does not check (that would cost a host synchronisation).
    """
    check_device(values, gate, starts, lens, init)
    check_shapes(values, gate, starts, lens, init)
    rows, dim = values.shape
    hist = torch.zeros(rows, 3, dim, device=values.device)
    windows = starts.shape[0]
    if windows == 0 or rows == 0 or dim == 0:
        return hist
    if values.stride(-1) != 1:
        values = values.contiguous()
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    init = init.float()
    if init.stride(-1) != 1:
        init = init.contiguous()
    bd = min(BLOCK_D, triton.next_power_of_2(dim))
    compressor_pool_kernel[(windows, triton.cdiv(dim, bd))](
        values,
        gate,
        starts,
        lens,
        init,
        hist,
        values.stride(0),
        gate.stride(0),
        init.stride(0),
        init.stride(1),
        hist.stride(0),
        hist.stride(1),
        D=dim,
        BD=bd,
    )
    return hist
