"""Triton q/k RMSNorm + RoPE in one kernel; same signature as `reference.py`.

Design notes: one program takes BT tokens of one head. It loads the head's whole row for the
mean of squares (one tl.sum in float32, as the rms_norm kernel), then the two rotary halves
and the dims past rotary_dim again by offset; each is normalised and multiplied by
``offset + w`` in float32 and rounded to x.dtype (where the unfused path stores the norm's
output), then the halves rotate in float32 with cos/sin of position * inv_freq (as the
rotary kernel) and are rounded once more. A row's reduction never mixes with another's, so
its bits do not depend on T or its place. It replaces, per attention layer, the per-head
norm's kernel per weight run with its copies and the rotary kernel.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._triton import autotune_configs, check_device
from ..rotary.reference import inv_freq

QK_NORM_ROPE_CONFIGS = [triton.Config({"BT": bt}, num_warps=w) for bt, w in ((4, 4), (1, 2))]


@triton.autotune(configs=autotune_configs(QK_NORM_ROPE_CONFIGS), key=["D", "R"])
@triton.jit(do_not_specialize=["T"])
def qk_norm_rope_kernel(
    x,
    w,
    y,
    positions,
    freqs,
    T,
    D: tl.constexpr,
    R: tl.constexpr,
    stride_xt,
    stride_xh,
    stride_yt,
    stride_yh,
    eps,
    offset,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    stride_vt,
    stride_vh,
    stride_kcp,
    stride_kcn,
    stride_kch,
    stride_vcp,
    stride_vcn,
    stride_vch,
    HQ,
    BD: tl.constexpr,
    BR: tl.constexpr,
    BP: tl.constexpr,
    BT: tl.constexpr,
    WRITE_KV: tl.constexpr,
    PAGE: tl.constexpr,
):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    half = R // 2
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    p_x = x + o_t[:, None] * stride_xt + i_h * stride_xh
    p_y = y + o_t[:, None] * stride_yt + i_h * stride_yh
    p_w = w + i_h * D
    o_d = tl.arange(0, BD)
    b_x = tl.load(p_x + o_d[None, :], mask=m_t[:, None] & (o_d < D)[None, :], other=0.0)
    b_x = b_x.to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)[:, None]
    # the two rotary halves, normalised and rounded as the norm's output would be
    o_r = tl.arange(0, BR)
    m_r = m_t[:, None] & (o_r < half)[None, :]
    b_x1 = tl.load(p_x + o_r[None, :], mask=m_r, other=0.0).to(tl.float32)
    b_x2 = tl.load(p_x + half + o_r[None, :], mask=m_r, other=0.0).to(tl.float32)
    b_w1 = tl.load(p_w + o_r, mask=o_r < half, other=0.0).to(tl.float32)
    b_w2 = tl.load(p_w + half + o_r, mask=o_r < half, other=0.0).to(tl.float32)
    b_n1 = ((b_x1 * b_rstd) * (offset + b_w1)[None, :]).to(y.dtype.element_ty).to(tl.float32)
    b_n2 = ((b_x2 * b_rstd) * (offset + b_w2)[None, :]).to(y.dtype.element_ty).to(tl.float32)
    b_pos = tl.load(positions + o_t, mask=m_t, other=0).to(tl.float32)
    b_freq = tl.load(freqs + o_r, mask=o_r < half, other=0.0)
    b_angle = b_pos[:, None] * b_freq[None, :]
    b_cos = tl.cos(b_angle)
    b_sin = tl.sin(b_angle)
    b_y1 = b_n1 * b_cos + (-b_n2) * b_sin
    b_y2 = b_n2 * b_cos + b_n1 * b_sin
    tl.store(p_y + o_r[None, :], b_y1.to(y.dtype.element_ty), mask=m_r)
    tl.store(p_y + half + o_r[None, :], b_y2.to(y.dtype.element_ty), mask=m_r)
    if R < D:
        # dims past rotary_dim: normalised only
        o_p = R + tl.arange(0, BP)
        m_p = m_t[:, None] & (o_p < D)[None, :]
        b_xp = tl.load(p_x + o_p[None, :], mask=m_p, other=0.0).to(tl.float32)
        b_wp = tl.load(p_w + o_p, mask=o_p < D, other=0.0).to(tl.float32)
        b_yp = ((b_xp * b_rstd) * (offset + b_wp)[None, :]).to(y.dtype.element_ty)
        tl.store(p_y + o_p[None, :], b_yp, mask=m_p)
    if WRITE_KV:
        if i_h >= HQ:
            # a key head's program also writes its key and its value into the paged caches:
            # the values just stored in y, cast to the caches' dtype, as write_kv stores them
            b_slot = tl.load(slot_mapping + o_t, mask=m_t, other=0).to(tl.int64)
            i_kh = i_h - HQ
            p_kc = k_cache + (b_slot // PAGE)[:, None] * stride_kcp
            p_kc += (b_slot % PAGE)[:, None] * stride_kcn + i_kh * stride_kch
            kc_ty = k_cache.dtype.element_ty
            tl.store(p_kc + o_r[None, :], b_y1.to(y.dtype.element_ty).to(kc_ty), mask=m_r)
            tl.store(p_kc + half + o_r[None, :], b_y2.to(y.dtype.element_ty).to(kc_ty), mask=m_r)
            if R < D:
                o_q = R + tl.arange(0, BP)
                m_q = m_t[:, None] & (o_q < D)[None, :]
                b_xq = tl.load(p_x + o_q[None, :], mask=m_q, other=0.0).to(tl.float32)
                b_wq = tl.load(p_w + o_q, mask=o_q < D, other=0.0).to(tl.float32)
                b_yq = ((b_xq * b_rstd) * (offset + b_wq)[None, :]).to(y.dtype.element_ty)
                tl.store(p_kc + o_q[None, :], b_yq.to(kc_ty), mask=m_q)
            p_vc = v_cache + (b_slot // PAGE)[:, None] * stride_vcp
            p_vc += (b_slot % PAGE)[:, None] * stride_vcn + i_kh * stride_vch
            m_d = m_t[:, None] & (o_d < D)[None, :]
            p_v = v + o_t[:, None] * stride_vt + i_kh * stride_vh + o_d[None, :]
            b_v = tl.load(p_v, mask=m_d, other=0.0).to(v_cache.dtype.element_ty)
            tl.store(p_vc + o_d[None, :], b_v, mask=m_d)


def qk_norm_rope(
    x: Tensor,
    weight: Tensor,
    eps: float,
    offset: float,
    positions: Tensor,
    theta: float,
    rotary_dim: int,
    freqs: Tensor | None = None,
    *,
    kv: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
) -> Tensor:
    """See `reference.qk_norm_rope`: returns a new tensor, and with ``kv`` also writes the
    keys and values into the caches (one launch, not two; page_tokens a power of two, the
    caches' last dim contiguous). rotary_dim must be even."""
    check_device(x, weight, positions)
    num_tokens, num_heads, head_dim = x.shape
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, {head_dim}], got {rotary_dim}")
    if tuple(weight.shape) != (num_heads, head_dim):
        raise ValueError(f"weight must be [{num_heads}, {head_dim}], got {list(weight.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if freqs is None:
        freqs = inv_freq(theta, rotary_dim).to(x.device)
    y = torch.empty((num_tokens, num_heads, head_dim), dtype=x.dtype, device=x.device)
    grid = lambda meta: (triton.cdiv(num_tokens, meta["BT"]), num_heads)  # noqa: E731
    if kv is not None:
        v, k_cache, v_cache, slot_mapping = kv
        check_device(v, k_cache, v_cache, slot_mapping)
        if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
            raise ValueError("the caches' last dim (head_dim) must be contiguous")
        if v.stride(-1) != 1:
            v = v.contiguous()
        page = k_cache.shape[1]
        if page & (page - 1):
            raise ValueError(f"page_tokens must be a power of two, got {page}")
        num_q = num_heads - v.shape[1]
        caches = (v, k_cache, v_cache, slot_mapping, v.stride(0), v.stride(1))
        caches += (*k_cache.stride()[:3], *v_cache.stride()[:3], num_q)
    else:
        page, caches = 1, (x, x, x, positions, 0, 0, 0, 0, 0, 0, 0, 0, num_heads)
    qk_norm_rope_kernel[grid](
        x,
        weight.contiguous(),
        y,
        positions,
        freqs,
        num_tokens,
        head_dim,
        rotary_dim,
        x.stride(0),
        x.stride(1),
        y.stride(0),
        y.stride(1),
        eps,
        offset,
        *caches,
        BD=triton.next_power_of_2(head_dim),
        BR=triton.next_power_of_2(rotary_dim // 2),
        BP=triton.next_power_of_2(max(head_dim - rotary_dim, 1)),
        WRITE_KV=kv is not None,
        PAGE=page,
    )
    return y
