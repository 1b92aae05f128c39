"""Triton gated delta rule: a chunked kernel (prefill) and a recurrent one (decode).

Same signatures and state contract as `reference.py`: states[slot_ids[b]] is read as the
initial state and overwritten with the final one (slot ids in one call must be distinct).

Design notes:
- One program per (sequence, value head, BV block of Dv). It owns its [Dk, BV] slice of
  the state in float32 registers for the whole sequence and writes it back once, so no two
  programs touch the same memory. Dk is never split (BK >= Dk): l2norm and k.k^T need the
  whole key.
- Chunked: per chunk of BT = chunk_size tokens, the UT transform's unit lower triangular
  system is inverted in registers by forward substitution (one row per step, as in
  transformers' export path and fla's solve_tril), then chunks are scanned in order. Padded
  tokens load as g = 0, beta = 0, k = 0 and change nothing. This is one kernel instead of
  fla's six (cumsum, kkt, solve_tril, wy, chunk_h, chunk_o); it trades parallelism over
  chunks for simplicity, which is fine at serving batch sizes but is the first thing to
  split if prefill of long prompts turns out slow.
- Per-channel g ([T, H, Dk], Kimi Delta Attention; PER_CHANNEL): the decay can no longer
  be factored out of the chunk's k.k^T and q.k^T dots, so `_channel_decays` builds them a
  column at a time from running products of exp(g) (factors <= 1: safe and precise for any
  gate; see there). That is BT passes over a [BT, BK] tile per chunk instead of two dots;
  the first thing to speed up (sub-chunk dots off the diagonal) if KDA prefill is slow.
  The per-head code is what it was (its PTX for sm_90 is unchanged but for the new stride
  parameter).
- Recurrent: token by token, exactly the reference's op order, in float32.
- Autotuned over warps and BV only, keyed on the head dims; restore_value keeps the timing
  runs from advancing the states.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._triton import autotune_configs, block, check_device, dot

GDR_CHUNK_CONFIGS = [
    triton.Config({"BV": bv}, num_warps=w) for bv, w in ((32, 4), (16, 4), (32, 8), (64, 8))
]
GDR_RECURRENT_CONFIGS = [
    triton.Config({"BV": bv}, num_warps=w) for bv, w in ((32, 4), (16, 2), (64, 4), (128, 8))
]


@triton.jit
def _l2norm(b_x, eps):
    return b_x * tl.rsqrt(tl.sum(b_x * b_x, axis=1) + eps)[:, None]


@triton.jit
def _channel_decays(b_q, b_k, b_kb, b_g, BT: tl.constexpr, BK: tl.constexpr):
    """One chunk's decays with a per-channel g [BT, BK]: A = (kb . k) and attn = (q . k),
    [BT, BT], each term decayed by decay[i, j, d] = prod exp(g_t[d]), t = j+1..i (0 above
    the diagonal), and the decay from the chunk start to each token (inclusive) and from
    each token (exclusive) to the chunk end, [BT, BK].

    The decay no longer factors out of the dots; splitting it as exp(G_i) exp(-G_j) would
    overflow (KDA's gates reach -50 a token), and a difference of cumulative sums far below
    -1000 is off by up to ~1e-4 (their float32 spacing). So the columns are built one at a
    time, last to first, with a running product of factors <= 1 per row: float32's relative
    precision however small it gets, as in the recurrent form.
    """
    o_t = tl.arange(0, BT)
    b_step = tl.exp(b_g)
    b_run = tl.full((BT, BK), 1.0, tl.float32)  # rows i >= j: decay from token j to i
    b_tail = tl.full((BK,), 1.0, tl.float32)  # decay from token j to the chunk end
    b_to_end = tl.zeros((BT, BK), dtype=tl.float32)
    b_a = tl.zeros((BT, BT), dtype=tl.float32)
    b_attn = tl.zeros((BT, BT), dtype=tl.float32)
    for r in range(BT):
        j = BT - 1 - r
        m_j = o_t == j
        m_from_j = (o_t >= j)[:, None]
        b_kj = tl.sum(tl.where(m_j[:, None], b_k, 0.0), axis=0)
        b_kd = tl.where(m_from_j, b_run, 0.0) * b_kj[None, :]
        b_a = tl.where(m_j[None, :], tl.sum(b_kb * b_kd, axis=1)[:, None], b_a)
        b_attn = tl.where(m_j[None, :], tl.sum(b_q * b_kd, axis=1)[:, None], b_attn)
        b_to_end = tl.where(m_j[:, None], b_tail[None, :], b_to_end)
        b_step_j = tl.sum(tl.where(m_j[:, None], b_step, 0.0), axis=0)
        b_run = tl.where(m_from_j, b_run * b_step_j[None, :], b_run)
        b_tail = b_tail * b_step_j
    # every row has now taken the factors of all tokens up to its own
    return b_a, b_attn, b_run, b_to_end


@triton.autotune(
    configs=autotune_configs(GDR_CHUNK_CONFIGS),
    key=["DK", "DV", "BT", "PER_CHANNEL"],
    restore_value=["states"],
)
@triton.jit
def gated_delta_rule_chunk_kernel(
    q,
    k,
    v,
    g,
    beta,
    o,
    states,
    slot_ids,
    query_start_loc,
    scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_ss,
    stride_sh,
    stride_sk,
    DK: tl.constexpr,
    DV: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    L2NORM: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    i_b, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # int64 bounds: the token loop variable then indexes rows without int32 overflow
    seq_start = tl.load(query_start_loc + i_b).to(tl.int64)
    seq_end = tl.load(query_start_loc + i_b + 1).to(tl.int64)
    if seq_end > seq_start:
        i_slot = tl.load(slot_ids + i_b).to(tl.int64)
        o_t = tl.arange(0, BT)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k = o_k < DK
        m_v = o_v < DV
        p_s = states + i_slot * stride_ss + i_h * stride_sh
        p_s += o_k[:, None] * stride_sk + o_v[None, :]
        m_s = m_k[:, None] & m_v[None, :]
        b_s = tl.load(p_s, mask=m_s, other=0.0)  # [BK, BV] float32
        m_lower = o_t[:, None] >= o_t[None, :]
        m_strict = o_t[:, None] > o_t[None, :]
        for c0 in range(seq_start, seq_end, BT):
            r_t = c0 + o_t
            m_t = r_t < seq_end
            m_tk = m_t[:, None] & m_k[None, :]
            p_q = q + r_t[:, None] * stride_qt + i_h * stride_qh + o_k[None, :]
            p_k = k + r_t[:, None] * stride_kt + i_h * stride_kh + o_k[None, :]
            p_v = v + r_t[:, None] * stride_vt + i_h * stride_vh + o_v[None, :]
            b_q = tl.load(p_q, mask=m_tk, other=0.0).to(tl.float32)
            b_k = tl.load(p_k, mask=m_tk, other=0.0).to(tl.float32)
            b_v = tl.load(p_v, mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
            if PER_CHANNEL:
                p_g = g + r_t[:, None] * stride_gt + i_h * stride_gh + o_k[None, :]
                b_g = tl.load(p_g, mask=m_tk, other=0.0).to(tl.float32)
            else:
                b_g = tl.load(g + r_t * stride_gt + i_h, mask=m_t, other=0.0).to(tl.float32)
            b_beta = tl.load(beta + r_t * stride_bt + i_h, mask=m_t, other=0.0).to(tl.float32)
            if L2NORM:
                b_q = _l2norm(b_q, 1e-6)
                b_k = _l2norm(b_k, 1e-6)
            b_q = b_q * scale
            if PER_CHANNEL:
                b_kb = b_k * b_beta[:, None]
                b_a, b_attn, b_from_start, b_to_end = _channel_decays(b_q, b_k, b_kb, b_g, BT, BK)
            else:
                b_cum = tl.cumsum(b_g, axis=0)  # log decay from the chunk start
                # padded rows have g = 0, so the last row carries the whole chunk's decay
                b_cum_last = tl.sum(tl.where(o_t == BT - 1, b_cum, 0.0), axis=0)
                b_decay = tl.exp(tl.where(m_lower, b_cum[:, None] - b_cum[None, :], float("-inf")))
                b_kb = b_k * b_beta[:, None]
                b_a = dot(b_kb, tl.trans(b_k)) * b_decay
            # invert I + strictly_lower(A) by forward substitution: row i of the inverse's
            # strict part is -(A_i + sum_j A_ij X_j) over rows j < i already solved
            b_x = -tl.where(m_strict, b_a, 0.0)
            for i in range(1, BT):
                b_row = tl.sum(tl.where(o_t[:, None] == i, b_x, 0.0), axis=0)
                b_row = b_row + tl.sum(b_row[:, None] * b_x, axis=0)
                b_x = tl.where(o_t[:, None] == i, b_row[None, :], b_x)
            b_x = b_x + tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
            b_u = dot(b_x, b_v * b_beta[:, None])  # [BT, BV]
            if PER_CHANNEL:
                b_w = dot(b_x, b_kb * b_from_start)
                b_vn = b_u - dot(b_w, b_s)
                b_o = dot(b_q * b_from_start, b_s)
                b_o += dot(b_attn, b_vn)
                # padded rows decay by 1, so the last row carries the whole chunk's decay
                b_whole = tl.sum(tl.where(o_t[:, None] == BT - 1, b_from_start, 0.0), axis=0)
                b_s = b_s * b_whole[:, None] + dot(tl.trans(b_k * b_to_end), b_vn)
            else:
                b_w = dot(b_x, b_kb * tl.exp(b_cum)[:, None])
                b_vn = b_u - dot(b_w, b_s)
                b_attn = dot(b_q, tl.trans(b_k)) * b_decay
                b_o = dot(b_q * tl.exp(b_cum)[:, None], b_s)
                b_o += dot(b_attn, b_vn)
                b_kd = b_k * tl.exp(b_cum_last - b_cum)[:, None]
                b_s = b_s * tl.exp(b_cum_last) + dot(tl.trans(b_kd), b_vn)
            p_o = o + r_t[:, None] * stride_ot + i_h * stride_oh + o_v[None, :]
            tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])
        tl.store(p_s, b_s, mask=m_s)


@triton.autotune(
    configs=autotune_configs(GDR_RECURRENT_CONFIGS),
    key=["DK", "DV", "PER_CHANNEL"],
    restore_value=["states"],
)
@triton.jit
def gated_delta_rule_recurrent_kernel(
    q,
    k,
    v,
    g,
    beta,
    o,
    states,
    slot_ids,
    query_start_loc,
    scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_ss,
    stride_sh,
    stride_sk,
    DK: tl.constexpr,
    DV: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    L2NORM: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    i_b, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # int64 bounds: the token loop variable then indexes rows without int32 overflow
    seq_start = tl.load(query_start_loc + i_b).to(tl.int64)
    seq_end = tl.load(query_start_loc + i_b + 1).to(tl.int64)
    if seq_end > seq_start:
        i_slot = tl.load(slot_ids + i_b).to(tl.int64)
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        m_k = o_k < DK
        m_v = o_v < DV
        p_s = states + i_slot * stride_ss + i_h * stride_sh
        p_s += o_k[:, None] * stride_sk + o_v[None, :]
        m_s = m_k[:, None] & m_v[None, :]
        b_s = tl.load(p_s, mask=m_s, other=0.0)  # [BK, BV] float32
        for i_t in range(seq_start, seq_end):
            b_q = tl.load(q + i_t * stride_qt + i_h * stride_qh + o_k, mask=m_k, other=0.0)
            b_k = tl.load(k + i_t * stride_kt + i_h * stride_kh + o_k, mask=m_k, other=0.0)
            b_v = tl.load(v + i_t * stride_vt + i_h * stride_vh + o_v, mask=m_v, other=0.0)
            b_q = b_q.to(tl.float32)
            b_k = b_k.to(tl.float32)
            b_v = b_v.to(tl.float32)
            if PER_CHANNEL:
                p_g = g + i_t * stride_gt + i_h * stride_gh + o_k
                b_g = tl.load(p_g, mask=m_k, other=0.0).to(tl.float32)
            else:
                b_g = tl.load(g + i_t * stride_gt + i_h).to(tl.float32)
            b_beta = tl.load(beta + i_t * stride_bt + i_h).to(tl.float32)
            if L2NORM:
                b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
                b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
            b_q = b_q * scale
            if PER_CHANNEL:
                b_s = b_s * tl.exp(b_g)[:, None]  # row d of the state decays by exp(g[d])
            else:
                b_s = b_s * tl.exp(b_g)
            b_mem = tl.sum(b_s * b_k[:, None], axis=0)
            b_delta = (b_v - b_mem) * b_beta
            b_s = b_s + b_k[:, None] * b_delta[None, :]
            b_o = tl.sum(b_s * b_q[:, None], axis=0)
            tl.store(
                o + i_t * stride_ot + i_h * stride_oh + o_v, b_o.to(o.dtype.element_ty), mask=m_v
            )
        tl.store(p_s, b_s, mask=m_s)


def _launch(kernel, q, k, v, g, beta, states, slot_ids, query_start_loc, scale, l2norm, **meta):
    check_device(q, k, v, g, beta, states, slot_ids, query_start_loc)
    if states.dtype != torch.float32:
        raise TypeError(f"states must be float32, got {states.dtype}")
    num_heads, k_dim, v_dim = states.shape[1:]
    if q.shape[1:] != (num_heads, k_dim) or v.shape[1:] != (num_heads, v_dim):
        raise ValueError(
            f"shapes disagree: q {tuple(q.shape)}, v {tuple(v.shape)}, states "
            f"{tuple(states.shape)} (repeat q/k heads to the value heads first)"
        )
    if g.shape not in (q.shape[:2], q.shape):
        raise ValueError(f"g {tuple(g.shape)}: want [T, H] or [T, H, Dk] as q {tuple(q.shape)}")
    per_channel = g.dim() == 3
    q, k, v, g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, g, beta))
    if states.stride(-1) != 1:
        raise ValueError("states' last dim must be contiguous")
    o = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    num_seqs = slot_ids.shape[0]
    if num_seqs == 0 or q.shape[0] == 0:
        return o
    grid = lambda meta: (num_seqs, num_heads, triton.cdiv(v_dim, meta["BV"]))  # noqa: E731
    kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        o,
        states,
        slot_ids,
        query_start_loc,
        scale,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        o.stride(0),
        o.stride(1),
        *states.stride()[:3],
        DK=k_dim,
        DV=v_dim,
        PER_CHANNEL=per_channel,
        L2NORM=l2norm,
        BK=block(k_dim),
        **meta,
    )
    return o


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    states: Tensor,
    slot_ids: Tensor,
    query_start_loc: Tensor,
    *,
    scale: float,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> Tensor:
    """See `reference.gated_delta_rule`. Mutates states[slot_ids]; chunk_size must be a power
    of two >= 16 (tl.dot's smallest dim)."""
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    return _launch(
        gated_delta_rule_chunk_kernel,
        q, k, v, g, beta, states, slot_ids, query_start_loc, scale, use_qk_l2norm,
        BT=chunk_size,
    )  # fmt: skip


def gated_delta_rule_recurrent(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    states: Tensor,
    slot_ids: Tensor,
    query_start_loc: Tensor,
    *,
    scale: float,
    use_qk_l2norm: bool = True,
) -> Tensor:
    """See `reference.gated_delta_rule_recurrent`. Mutates states[slot_ids]."""
    return _launch(
        gated_delta_rule_recurrent_kernel,
        q, k, v, g, beta, states, slot_ids, query_start_loc, scale, use_qk_l2norm,
    )  # fmt: skip
