"""Triton batch-invariant linear; same signature as `reference.py`.

Design notes:
- A row's bits must not depend on how many rows share the call (kern's identity promise):
  cuBLAS picks its kernel, tiling and split-K by M, so the CUDA backend does not use it.
- The tile (BM, BN, BK, warps, stages) is a pure function of (N, K) (:func:`tile`), never of
  M, and never timed: an autotuner keyed without M still picks by timing, which differs
  between processes (``kern run`` against the server). No split-K: each output element is
  one program's float32 accumulation over K in BK steps, in order; a row's place inside its
  BM tile does not change its MMA reduction order.
- Bias is added in float32 after the K loop; one rounding to x.dtype at the store.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._triton import check_device, dot


def tile(n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages) for an [N, K] weight: fixed per shape. Narrow
    weights take narrow BN so that decode, which reads the weight once, spreads over more
    programs."""
    bn = 128 if n >= 16384 else 64 if n >= 2048 else 32
    return 64, bn, 64 if k >= 64 else 32, 4, 4


@triton.jit(do_not_specialize=["M"])
def linear_kernel(
    x,
    w,
    b,
    y,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_y,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    m_m, m_n = o_m < M, o_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        b_x = tl.load(
            x + o_m[:, None] * stride_x + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0
        )
        b_w = tl.load(
            w + o_n[None, :] * stride_w + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0.0
        )
        acc += dot(b_x, b_w)
    if HAS_BIAS:
        acc += tl.load(b + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
    p_y = y + o_m[:, None] * stride_y + o_n[None, :]
    tl.store(p_y, acc.to(y.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


def linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """See `reference.linear`: x [M, K] (any row stride), w [N, K] contiguous rows, bias [N]."""
    check_device(x, w)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear of x {tuple(x.shape)} by w {tuple(w.shape)}: want [M, K], [N, K]")
    if x.dtype != w.dtype:
        raise ValueError(f"linear of {x.dtype} x by {w.dtype} w: the same dtype is required")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    return linear_tiled(x, w, bias, tile(w.shape[0], x.shape[1]))


def linear_tiled(
    x: Tensor, w: Tensor, bias: Tensor | None, tile_: tuple[int, int, int, int, int]
) -> Tensor:
    """`linear` with a given (BM, BN, BK, num_warps, num_stages): for timing other tiles
    (tools/gpu/bench.py); kern itself runs `tile(N, K)` only. x and w as `linear` leaves them."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, bk, warps, stages = tile_
    has_bias = bias is not None
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    linear_kernel[grid](
        x,
        w,
        bias if has_bias else y,
        y,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        HAS_BIAS=has_bias,
        BM=bm,
        BN=bn,
        BK=bk,
        num_warps=warps,
        num_stages=stages,
    )
    return y
