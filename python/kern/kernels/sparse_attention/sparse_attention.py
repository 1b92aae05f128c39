"""Triton shared-KV attention with per-head sinks over gathered entries; same signature as
`reference.py`.

Design notes:
- One program per (row, head block). The heads of a row share its keys (one KV head, K =
  V), so a key block is loaded once for the BH heads of the program and serves as both the
  key and the value. BH is one constant (tl.dot wants M >= 16); heads past H are masked.
- Keys go in blocks of BN slots j, ascending, with an online softmax in float32. The block
  layout is fixed by j alone, so a row's bits do not depend on the batch: a wider J (other
  rows' keys) only adds fully invalid blocks, which add exact zeros (p = 0, rescale
  exp(0) = 1).
- The sink opens the softmax (m = sink, l = exp(0) = 1, acc = 0): the same max over the
  scores and the sink as adding it at the end, and m is finite from the start, so a block
  of only invalid keys (a young sequence's window slots come first) never takes
  exp(-inf - -inf).
- Invalid keys are never read (their row index may be anything) and their scores are set
  with `where`, so garbage in `keys` cannot leak in.
- A row's key indices are int64: the table may be larger than 2^31 elements.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._triton import autotune_configs, block, check_device, dot
from .reference import check_shapes

BLOCK_H = 16  # heads per program; fixed so a row's tile shape never depends on the batch
BLOCK_N = 32  # keys per online-softmax step, in slot order j

SPARSE_ATTENTION_CONFIGS = [
    triton.Config({}, num_warps=w, num_stages=s) for w, s in ((4, 2), (8, 2), (4, 3), (2, 2))
]


@triton.autotune(configs=autotune_configs(SPARSE_ATTENTION_CONFIGS), key=["H", "D"])
@triton.jit
def sparse_attention_kernel(
    q,
    keys,
    key_rows,
    valid,
    sinks,
    o,
    scale,
    J,
    stride_qr,
    stride_qh,
    stride_kn,
    stride_rr,
    stride_rj,
    stride_vr,
    stride_vj,
    stride_or,
    stride_oh,
    H: tl.constexpr,
    D: tl.constexpr,
    BH: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
):
    i_r = tl.program_id(0).to(tl.int64)
    i_hb = tl.program_id(1)
    o_h = i_hb * BH + tl.arange(0, BH)
    m_h = o_h < H
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    p_q = q + i_r * stride_qr + o_h[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_h[:, None] & m_d[None, :], other=0.0)

    # the sink opens the softmax: its weight exp(sink - m) is l's starting 1
    b_m = tl.load(sinks + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_l = tl.full([BH], 1.0, dtype=tl.float32)
    b_acc = tl.zeros([BH, BD], dtype=tl.float32)
    o_n = tl.arange(0, BN)
    for i_k in range(0, tl.cdiv(J, BN)):
        o_j = i_k * BN + o_n
        m_j = o_j < J
        b_ok = tl.load(valid + i_r * stride_vr + o_j * stride_vj, mask=m_j, other=0) != 0
        b_row = tl.load(key_rows + i_r * stride_rr + o_j * stride_rj, mask=b_ok, other=0)
        p_k = keys + b_row.to(tl.int64)[:, None] * stride_kn + o_d[None, :]
        b_k = tl.load(p_k, mask=b_ok[:, None] & m_d[None, :], other=0.0)
        b_s = dot(b_q, tl.trans(b_k)) * scale
        b_s = tl.where(b_ok[None, :], b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_alpha = tl.exp(b_m - b_m_new)
        b_p = tl.exp(b_s - b_m_new[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None] + dot(b_p.to(b_k.dtype), b_k)  # K = V
        b_m = b_m_new
    b_o = b_acc / b_l[:, None]
    p_o = o + i_r * stride_or + o_h[:, None] * stride_oh + o_d[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_h[:, None] & m_d[None, :])


def sparse_attention(
    q: Tensor, keys: Tensor, key_rows: Tensor, valid: Tensor, sinks: Tensor, scale: float
) -> Tensor:
    """See `reference.sparse_attention`. Pure: returns a new [R, H, D] tensor in q.dtype.

    q and keys must share a dtype (tl.dot takes one); keys' last dim is made contiguous if
    it is not (the caller's flattened table usually is). Valid key_rows must lie in
    [0, N_total): the kernel does not check (that would cost a host synchronisation).
    """
    check_device(q, keys, key_rows, valid, sinks)
    check_shapes(q, keys, key_rows, valid, sinks)
    if q.dtype != keys.dtype:
        raise ValueError(f"q is {q.dtype} but keys are {keys.dtype}: tl.dot needs one")
    rows, heads, dim = q.shape
    o = torch.empty((rows, heads, dim), dtype=q.dtype, device=q.device)
    if rows == 0 or heads == 0:
        return o
    if q.stride(-1) != 1:
        q = q.contiguous()
    if keys.stride(-1) != 1:
        keys = keys.contiguous()
    sinks = sinks.float().contiguous()
    flags = valid.view(torch.uint8)  # same storage; the kernel tests != 0
    sparse_attention_kernel[(rows, triton.cdiv(heads, BLOCK_H))](
        q,
        keys,
        key_rows,
        flags,
        sinks,
        o,
        scale,
        key_rows.shape[1],
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        key_rows.stride(0),
        key_rows.stride(1),
        flags.stride(0),
        flags.stride(1),
        o.stride(0),
        o.stride(1),
        H=heads,
        D=dim,
        BH=BLOCK_H,
        BN=BLOCK_N,
        BD=block(dim),
    )
    return o
