"""Triton lightning-indexer scores and top-k; same signature as `reference.py`.

Design notes:
- One program per (row, block of BN slots). The row's heads are one block (BH = block(H),
  heads past H masked), so a key block is loaded once and scored for every head with one
  `tl.dot` [BH, BD] x [BD, BN] accumulating in float32; relu, times the head's weight and
  the scale, then a sum over the heads gives the block's BN scores.
- The block layout is fixed by the slot index alone and a program reads only its own row,
  so a row's bits do not depend on the other rows or on N: a wider batch only adds blocks
  (or, in the row's last block, columns that were masked and stay zeros).
- Invalid slots are never read (their row index may be anything, -1 included): the gather
  is masked by `valid` and their scores set to -inf with `where`.
- Key row indices are int64: the table may be larger than 2^31 elements.
- The selection is the reference's `select` (torch.topk on packed (score, slot) keys), so
  ties go to the lower slot exactly as in the reference.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._triton import autotune_configs, block, check_device, dot
from .reference import check_shapes, select

BLOCK_N = 64  # slots per program; fixed so a row's block layout never depends on the batch

INDEX_SCORES_CONFIGS = [
    triton.Config({}, num_warps=w, num_stages=s) for w, s in ((4, 2), (8, 2), (4, 3), (2, 2))
]


@triton.autotune(configs=autotune_configs(INDEX_SCORES_CONFIGS), key=["H", "D"])
@triton.jit
def index_scores_kernel(
    q,
    weights,
    keys,
    key_rows,
    valid,
    out,
    scale,
    N,
    stride_qr,
    stride_qh,
    stride_wr,
    stride_wh,
    stride_kn,
    stride_rr,
    stride_rn,
    stride_vr,
    stride_vn,
    stride_or,
    H: tl.constexpr,
    D: tl.constexpr,
    BH: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    i_n = tl.program_id(1)
    o_h = tl.arange(0, BH)
    m_h = o_h < H
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    p_q = q + i_r * stride_qr + o_h[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_h[:, None] & m_d[None, :], other=0.0)
    b_w = tl.load(weights + i_r * stride_wr + o_h * stride_wh, mask=m_h, other=0.0)

    o_n = i_n * BN + tl.arange(0, BN)
    m_n = o_n < N
    b_ok = tl.load(valid + i_r * stride_vr + o_n * stride_vn, mask=m_n, other=0) != 0
    b_row = tl.load(key_rows + i_r * stride_rr + o_n * stride_rn, mask=b_ok, other=0)
    p_k = keys + b_row.to(tl.int64)[:, None] * stride_kn + o_d[None, :]
    b_k = tl.load(p_k, mask=b_ok[:, None] & m_d[None, :], other=0.0)
    b_s = tl.maximum(dot(b_q, tl.trans(b_k)), 0.0)  # [BH, BN]; masked heads give 0
    b_s = b_s * scale * b_w.to(tl.float32)[:, None]
    b_o = tl.sum(b_s, axis=0)
    b_o = tl.where(b_ok, b_o, float("-inf"))
    tl.store(out + i_r * stride_or + o_n, b_o, mask=m_n)


def scores(
    q: Tensor, weights: Tensor, keys: Tensor, key_rows: Tensor, valid: Tensor, scale: float
) -> Tensor:
    """See `reference.scores`: [R, N] float32, -inf at invalid slots.

    q and keys must share a dtype (tl.dot takes one); last dims are made contiguous if they
    are not. Valid key_rows must lie in [0, N_total): the kernel does not check (that would
    cost a host synchronisation).
    """
    check_device(q, weights, keys, key_rows, valid)
    check_shapes(q, weights, keys, key_rows, valid)
    if q.dtype != keys.dtype:
        raise ValueError(f"q is {q.dtype} but keys are {keys.dtype}: tl.dot needs one")
    if valid.dtype != torch.bool:
        raise ValueError(f"valid is {valid.dtype}: want torch.bool")
    if key_rows.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"key_rows is {key_rows.dtype}: want torch.int64")
    rows, heads, dim = q.shape
    n = key_rows.shape[1]
    out = torch.empty((rows, n), dtype=torch.float32, device=q.device)
    if rows == 0 or n == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    weights = weights.float()
    flags = valid.view(torch.uint8)  # same storage; the kernel tests != 0
    index_scores_kernel[(rows, triton.cdiv(n, BLOCK_N))](
        q,
        weights,
        keys,
        key_rows,
        flags,
        out,
        scale,
        n,
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        weights.stride(1),
        keys.stride(0),
        key_rows.stride(0),
        key_rows.stride(1),
        flags.stride(0),
        flags.stride(1),
        out.stride(0),
        H=heads,
        D=dim,
        BH=block(heads),
        BN=BLOCK_N,
        BD=block(dim),
    )
    return out


def index_topk(
    q: Tensor,
    weights: Tensor,
    keys: Tensor,
    key_rows: Tensor,
    valid: Tensor,
    k: int,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """See `reference.index_topk`: (slots [R, k] int64, ok [R, k] bool), ties to the lower
    slot; the scores from the Triton kernel, the selection the reference's `select`."""
    if k < 0:
        raise ValueError(f"k = {k}: want k >= 0")
    return select(scores(q, weights, keys, key_rows, valid, scale), k)
