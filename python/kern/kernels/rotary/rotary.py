"""Triton rotary embedding (neox / rotate_half, partial); same signature as `reference.py`.

Design notes: one program rotates BT tokens of one head: it loads both halves of the first
rotary_dim dims, rotates them in float32 with cos/sin of position * inv_freq, and copies the
dims past rotary_dim through. inv_freq comes from `reference.inv_freq` (a [rotary_dim/2] vector
built on the host, so bitwise the one transformers builds; a caller may pass it already on
the device, as the CUDA backend does once per (theta, rotary_dim)); cos/sin are Triton's
(libdevice on a GPU), within an ulp of torch's. Autotuned over warps and BT, keyed on the
head shape.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._triton import autotune_configs, check_device
from .reference import inv_freq

ROTARY_CONFIGS = [triton.Config({"BT": bt}, num_warps=w) for bt, w in ((4, 4), (1, 2), (16, 4))]


@triton.autotune(configs=autotune_configs(ROTARY_CONFIGS), key=["D", "R"])
@triton.jit(do_not_specialize=["T"])
def rotary_kernel(
    x,
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
    BR: tl.constexpr,
    BP: tl.constexpr,
    BT: tl.constexpr,
):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    half = R // 2
    o_t = i_t * BT + tl.arange(0, BT)
    o_r = tl.arange(0, BR)
    m_t = o_t < T
    m_r = m_t[:, None] & (o_r < half)[None, :]
    b_pos = tl.load(positions + o_t, mask=m_t, other=0).to(tl.float32)
    b_freq = tl.load(freqs + o_r, mask=o_r < half, other=0.0)
    b_angle = b_pos[:, None] * b_freq[None, :]
    b_cos = tl.cos(b_angle)
    b_sin = tl.sin(b_angle)
    p_x = x + o_t[:, None] * stride_xt + i_h * stride_xh + o_r[None, :]
    p_y = y + o_t[:, None] * stride_yt + i_h * stride_yh + o_r[None, :]
    b_x1 = tl.load(p_x, mask=m_r, other=0.0).to(tl.float32)
    b_x2 = tl.load(p_x + half, mask=m_r, other=0.0).to(tl.float32)
    b_y1 = b_x1 * b_cos + (-b_x2) * b_sin
    b_y2 = b_x2 * b_cos + b_x1 * b_sin
    tl.store(p_y, b_y1.to(y.dtype.element_ty), mask=m_r)
    tl.store(p_y + half, b_y2.to(y.dtype.element_ty), mask=m_r)
    if R < D:
        # dims past rotary_dim pass through unchanged
        o_p = R + tl.arange(0, BP)
        m_p = m_t[:, None] & (o_p < D)[None, :]
        p_xp = x + o_t[:, None] * stride_xt + i_h * stride_xh + o_p[None, :]
        p_yp = y + o_t[:, None] * stride_yt + i_h * stride_yh + o_p[None, :]
        tl.store(p_yp, tl.load(p_xp, mask=m_p, other=0.0), mask=m_p)


def apply_rotary(
    x: Tensor, positions: Tensor, theta: float, rotary_dim: int, freqs: Tensor | None = None
) -> Tensor:
    """See `reference.apply_rotary`. Pure: returns a new tensor. rotary_dim must be even."""
    check_device(x, positions)
    if rotary_dim % 2 or not 0 < rotary_dim <= x.shape[-1]:
        raise ValueError(f"rotary_dim must be even and in (0, {x.shape[-1]}], got {rotary_dim}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_tokens, num_heads, head_dim = x.shape
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if freqs is None:
        freqs = inv_freq(theta, rotary_dim).to(x.device)
    grid = lambda meta: (triton.cdiv(num_tokens, meta["BT"]), num_heads)  # noqa: E731
    rotary_kernel[grid](
        x,
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
        BR=triton.next_power_of_2(rotary_dim // 2),
        BP=triton.next_power_of_2(max(head_dim - rotary_dim, 1)),
    )
    return y
