"""Triton batch-invariant linear; same signature as `reference.py`.

Design notes:
- A row's bits must not depend on how many rows share the call (kern's identity promise):
  cuBLAS picks its kernel, tiling and split-K by M, so the CUDA backend does not use it.
- The tile (BM, BN, BK, warps, stages, splits) is a pure function of (N, K) (:func:`tile`),
  never of M, and never timed: an autotuner keyed without M still picks by timing, which
  differs between processes (``kern run`` against the server). A row's place inside its BM
  tile does not change its MMA reduction order.
- Split-K, fixed by (N, K) too: long-K weights with few BN columns cut K into ``splits``
  ranges, each program writes its float32 partial sum, and a second kernel adds the
  partials in range order. Each output element is thus the same float32 sums in the same
  order whatever M is. On an H200 it paid only at K = 9728 (a second launch costs more
  than it saves on shorter K).
- Bias is added in float32 after the K sums; one rounding to x.dtype at the store.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._triton import check_device, dot

# A weight with this many BN columns or more never splits K (an H200 has 132 SMs).
TARGET_PROGRAMS = 256
REDUCE_BLOCK = 1024

Tile = tuple[int, int, int, int, int, int]  # BM, BN, BK, num_warps, num_stages, splits


def tile(n: int, k: int) -> Tile:
    """(BM, BN, BK, num_warps, num_stages, splits) for an [N, K] weight: a function of the
    weight's shape only (see the notes). Read off the tiles timed on an H200 at M = 1 and 64
    on qwen3 ~0.6B and ~4B linears (docs/performance.md): BK 128; BN 32 for small weights,
    64 from 8M elements and for vocabulary-sized N; K split in 4 from K = 8192 (the ~4B down
    projection: 0.030 ms split against 0.045 whole at M = 1)."""
    bk = 128 if k >= 1024 else 64 if k >= 64 else 32
    bn = 64 if n * k >= 8 * 2**20 or n > 24576 else 32
    splits = 4 if k >= 8192 and triton.cdiv(n, bn) < TARGET_PROGRAMS else 1
    return 64, bn, bk, 4, 3, splits


@triton.jit(do_not_specialize=["M"])
def linear_kernel(
    x,
    w,
    b,
    y,
    M,
    N,
    K,
    K_PER,
    stride_x,
    stride_w,
    stride_y,
    stride_s,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    i_m, i_n, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    m_m, m_n = o_m < M, o_n < N
    k_lo = i_s * K_PER
    k_hi = tl.minimum(K, k_lo + K_PER)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < k_hi
        p_x = x + o_m[:, None] * stride_x + o_k[None, :]
        b_x = tl.load(p_x, mask=m_m[:, None] & m_k[None, :], other=0.0)
        p_w = w + o_n[None, :] * stride_w + o_k[:, None]
        b_w = tl.load(p_w, mask=m_k[:, None] & m_n[None, :], other=0.0)
        acc += dot(b_x, b_w)
    m_y = m_m[:, None] & m_n[None, :]
    if PARTIAL:
        # float32 partial sums of this K range: [splits, M, N], rows of stride_y
        tl.store(y + i_s * stride_s + o_m[:, None] * stride_y + o_n[None, :], acc, mask=m_y)
    else:
        if HAS_BIAS:
            acc += tl.load(b + o_n, mask=m_n, other=0.0).to(tl.float32)[None, :]
        tl.store(y + o_m[:, None] * stride_y + o_n[None, :], acc.to(y.dtype.element_ty), mask=m_y)


@triton.jit(do_not_specialize=["M"])
def linear_silu_and_mul_kernel(
    x,
    w,
    y,
    M,
    INTER,
    K,
    stride_x,
    stride_w,
    stride_y,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    # linear_kernel's sums for BN gate columns and the matching BN up columns (rows INTER
    # on of w), each rounded to y's dtype as the linear stores it, then silu(gate) * up in
    # float32 as silu_and_mul_kernel computes it: the two launches' bits in one
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    m_m, m_n = o_m < M, o_n < INTER
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        m_k = o_k < K
        p_x = x + o_m[:, None] * stride_x + o_k[None, :]
        b_x = tl.load(p_x, mask=m_m[:, None] & m_k[None, :], other=0.0)
        m_w = m_k[:, None] & m_n[None, :]
        p_w = w + o_n[None, :] * stride_w + o_k[:, None]
        acc_g += dot(b_x, tl.load(p_w, mask=m_w, other=0.0))
        acc_u += dot(b_x, tl.load(p_w + INTER * stride_w, mask=m_w, other=0.0))
    b_g = acc_g.to(y.dtype.element_ty).to(tl.float32)
    b_u = acc_u.to(y.dtype.element_ty).to(tl.float32)
    b_y = b_g * tl.sigmoid(b_g) * b_u
    m_y = m_m[:, None] & m_n[None, :]
    tl.store(y + o_m[:, None] * stride_y + o_n[None, :], b_y.to(y.dtype.element_ty), mask=m_y)


def linear_silu_and_mul(x: Tensor, w: Tensor) -> Tensor:
    """See `reference.linear_silu_and_mul`: x [M, K] by the gate-then-up weight w [2 I, K]
    -> [M, I], one launch where `linear` then `silu_and_mul` take two, with their bits (the
    tile is the gate_up linear's, :func:`tile` of [2 I, K]; a weight whose tile splits K
    takes the two launches)."""
    check_device(x, w)
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or w.shape[0] % 2:
        raise ValueError(
            f"linear_silu_and_mul of x {tuple(x.shape)} by w {tuple(w.shape)}: want [M, K], "
            "[2 I, K]"
        )
    if x.dtype != w.dtype:
        raise ValueError(f"linear of {x.dtype} x by {w.dtype} w: the same dtype is required")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w.stride(-1) != 1:
        w = w.contiguous()
    m, k = x.shape
    inter = w.shape[0] // 2
    bm, bn, bk, warps, stages, splits = tile(w.shape[0], k)
    if splits > 1:
        from ..silu_and_mul.silu_and_mul import silu_and_mul

        return silu_and_mul(linear_tiled(x, w, None, (bm, bn, bk, warps, stages, splits)))
    y = torch.empty((m, inter), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    linear_silu_and_mul_kernel[(triton.cdiv(m, bm), triton.cdiv(inter, bn))](
        x, w, y, m, inter, k, x.stride(0), w.stride(0), inter,
        BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


@triton.jit(do_not_specialize=["MN"])
def add_partials_kernel(
    parts, b, y, MN, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr
):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < MN
    acc = tl.load(parts + o, mask=m, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(parts + s * MN + o, mask=m, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b + o % N, mask=m, other=0.0).to(tl.float32)
    tl.store(y + o, acc.to(y.dtype.element_ty), mask=m)


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


def linear_tiled(x: Tensor, w: Tensor, bias: Tensor | None, tile_: Tile) -> Tensor:
    """`linear` with a given tile: for timing other tiles (tools/gpu/bench.py); kern itself
    runs `tile(N, K)` only. x and w as `linear` leaves them."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, bk, warps, stages, splits = tile_
    k_per = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    splits = triton.cdiv(k, k_per)
    has_bias = bias is not None
    out = y if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), splits)](
        x,
        w,
        bias if has_bias else y,
        out,
        m,
        n,
        k,
        k_per,
        x.stride(0),
        w.stride(0),
        n,
        m * n,
        HAS_BIAS=has_bias,
        PARTIAL=splits > 1,
        BM=bm,
        BN=bn,
        BK=bk,
        num_warps=warps,
        num_stages=stages,
    )
    if splits > 1:
        add_partials_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            out, bias if has_bias else y, y, m * n, n,
            SPLITS=splits, HAS_BIAS=has_bias, BLOCK=REDUCE_BLOCK,
        )  # fmt: skip
    return y
