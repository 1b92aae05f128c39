"""Triton depthwise causal conv1d over ragged sequences; same signature as `reference.py`.

Design notes: two launches, because the state is both read (as the left context of a
sequence's first K-1 outputs) and overwritten. (1) conv: one program per (BT tokens, BC
channels); each token finds its sequence in a per-token map built on the device and sums
its K taps in tap order in float32, reading taps before the sequence's first row from the
old state. (2) state: one program per (sequence, BC channels) loads the new last K-1
inputs (from x, or from the old state when the call is shorter than K-1) and only then
stores them, so it reads nothing another program writes. Launch (2) runs after (1) on the
same stream. Autotuned over tile shape and warps, keyed on C and K.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._triton import autotune_configs, check_device

CONV_CONFIGS = [
    triton.Config({"BT": bt, "BC": bc}, num_warps=w)
    for bt, bc, w in ((16, 128, 4), (8, 256, 4), (32, 128, 8), (64, 64, 4))
]
CONV_STATE_CONFIGS = [triton.Config({"BC": bc}, num_warps=w) for bc, w in ((256, 4), (1024, 4))]


@triton.autotune(configs=autotune_configs(CONV_CONFIGS), key=["C", "K", "HAS_BIAS", "SILU"])
@triton.jit(do_not_specialize=["T"])
def causal_conv1d_kernel(
    x,
    w,
    bias,
    y,
    states,
    token_seq,
    slot_ids,
    query_start_loc,
    T,
    C: tl.constexpr,
    K: tl.constexpr,
    stride_xt,
    stride_yt,
    stride_wc,
    stride_ss,
    stride_sc,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
):
    i_t, i_c = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_t = o_t < T
    m_c = o_c < C
    b_seq = tl.load(token_seq + o_t, mask=m_t, other=0)
    b_start = tl.load(query_start_loc + b_seq, mask=m_t, other=0)
    b_slot = tl.load(slot_ids + b_seq, mask=m_t, other=0).to(tl.int64)
    b_acc = tl.zeros([BT, BC], dtype=tl.float32)
    if HAS_BIAS:
        b_acc += tl.load(bias + o_c, mask=m_c, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(K):
        # tap j reads the input K-1-j rows back; before the sequence start it is state
        # column (K-1) + (src - start)
        b_src = o_t - (K - 1) + j
        m_x = (m_t & (b_src >= b_start))[:, None] & m_c[None, :]
        m_st = (m_t & (b_src < b_start))[:, None] & m_c[None, :]
        p_x = x + b_src.to(tl.int64)[:, None] * stride_xt + o_c[None, :]
        p_st = states + b_slot[:, None] * stride_ss + o_c[None, :] * stride_sc
        p_st += (K - 1 + b_src - b_start)[:, None]
        b_in = tl.load(p_x, mask=m_x, other=0.0).to(tl.float32)
        b_in += tl.load(p_st, mask=m_st, other=0.0).to(tl.float32)
        b_w = tl.load(w + o_c * stride_wc + j, mask=m_c, other=0.0).to(tl.float32)
        b_acc += b_w[None, :] * b_in
    if SILU:
        b_acc = b_acc * tl.sigmoid(b_acc)
    p_y = y + o_t.to(tl.int64)[:, None] * stride_yt + o_c[None, :]
    tl.store(p_y, b_acc.to(y.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])


@triton.autotune(configs=autotune_configs(CONV_STATE_CONFIGS), key=["C", "K"])
@triton.jit
def conv_state_kernel(
    x,
    states,
    slot_ids,
    query_start_loc,
    C: tl.constexpr,
    K: tl.constexpr,
    stride_xt,
    stride_ss,
    stride_sc,
    BW: tl.constexpr,
    BC: tl.constexpr,
):
    i_b, i_c = tl.program_id(0), tl.program_id(1)
    seq_start = tl.load(query_start_loc + i_b)
    seq_end = tl.load(query_start_loc + i_b + 1)
    if seq_end > seq_start:
        i_slot = tl.load(slot_ids + i_b).to(tl.int64)
        n = seq_end - seq_start
        o_w = tl.arange(0, BW)  # new state column
        o_c = i_c * BC + tl.arange(0, BC)
        m_c = o_c < C
        m_w = o_w < K - 1
        # new column i holds input seq_end - (K-1) + i: from x, or old column i + n
        b_src = seq_end - (K - 1) + o_w
        m_x = (m_w & (b_src >= seq_start))[:, None] & m_c[None, :]
        m_st = (m_w & (b_src < seq_start))[:, None] & m_c[None, :]
        p_st = states + i_slot * stride_ss + o_c[None, :] * stride_sc
        b_new = tl.load(
            x + b_src.to(tl.int64)[:, None] * stride_xt + o_c[None, :], mask=m_x, other=0.0
        ).to(states.dtype.element_ty)
        b_new += tl.load(p_st + (o_w + n)[:, None], mask=m_st, other=0.0)
        tl.store(p_st + o_w[:, None], b_new, mask=m_w[:, None] & m_c[None, :])


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_states: Tensor,
    slot_ids: Tensor,
    query_start_loc: Tensor,
    *,
    activation: str | None = "silu",
) -> Tensor:
    """See `reference.causal_conv1d`. Mutates conv_states[slot_ids] (slot ids distinct)."""
    check_device(x, weight, conv_states, slot_ids, query_start_loc)
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    num_tokens, channels = x.shape
    width = weight.shape[1]
    if conv_states.shape[1:] != (channels, width - 1):
        raise ValueError(
            f"conv_states {tuple(conv_states.shape)} is not [S, {channels}, {width - 1}]"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty((num_tokens, channels), dtype=x.dtype, device=x.device)
    num_seqs = slot_ids.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return y
    # token -> sequence map, on the device (output_size avoids a host sync)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    token_seq = torch.repeat_interleave(
        torch.arange(num_seqs, dtype=torch.int32, device=x.device), q_lens, output_size=num_tokens
    )
    grid = lambda meta: (  # noqa: E731
        triton.cdiv(num_tokens, meta["BT"]),
        triton.cdiv(channels, meta["BC"]),
    )
    causal_conv1d_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        y,
        conv_states,
        token_seq,
        slot_ids,
        query_start_loc,
        num_tokens,
        channels,
        width,
        x.stride(0),
        y.stride(0),
        weight.stride(0),
        conv_states.stride(0),
        conv_states.stride(1),
        HAS_BIAS=bias is not None,
        SILU=activation == "silu",
    )
    if width > 1:
        if conv_states.stride(2) != 1:
            raise ValueError("conv_states' last dim must be contiguous")
        state_grid = lambda meta: (num_seqs, triton.cdiv(channels, meta["BC"]))  # noqa: E731
        conv_state_kernel[state_grid](
            x,
            conv_states,
            slot_ids,
            query_start_loc,
            channels,
            width,
            x.stride(0),
            conv_states.stride(0),
            conv_states.stride(1),
            BW=triton.next_power_of_2(width - 1),
        )
    return y
