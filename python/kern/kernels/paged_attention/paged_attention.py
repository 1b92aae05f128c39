"""Triton write_kv and causal paged attention; same signatures as `reference.py`.

Design notes:
- One program per (query tile, KV head). A tile packs BT consecutive query tokens of one
  sequence times the G = Hq / Hk query heads sharing the KV head into BM = BT * G rows, so
  a K/V page is loaded once per group, and decode (1 token) still fills G rows.
- BM is one fixed constant (BLOCK_M), not sized to the batch: a row's dot products then
  have the same shape in every call, which is what keeps a row's bits independent of the
  batch and of the chunking (a row's position inside a tile does not change its MMA
  reduction order). 16 is the smallest M tl.dot takes.
- Keys are read one page (PAGE = page_tokens, a power of two) at a time, in page order,
  with an online softmax in float32, up to the page holding the tile's last row. For rows
  that end earlier the later pages are fully masked: p = 0 and the rescale is exp(0) = 1,
  exact, so they get the bits they would get had they stopped at their own page.
- Loads past the context are masked to zero, so garbage (NaN) in unused slots never enters.
- Tiles are listed on the host from query_start_loc (one device-to-host copy per call).
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._triton import autotune_configs, block, check_device, dot

BLOCK_M = 16  # query rows (tokens x grouped heads) per program; fixed for batch invariance

WRITE_KV_CONFIGS = [triton.Config({}, num_warps=w) for w in (1, 2, 4)]
PAGED_ATTENTION_CONFIGS = [
    triton.Config({}, num_warps=w, num_stages=s) for w, s in ((4, 2), (4, 3), (8, 2), (2, 2))
]


@triton.autotune(configs=autotune_configs(WRITE_KV_CONFIGS), key=["H", "D"])
@triton.jit
def write_kv_kernel(
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcp,
    stride_kcn,
    stride_kch,
    stride_vcp,
    stride_vcn,
    stride_vch,
    H: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BH: tl.constexpr,
    BD: tl.constexpr,
):
    i_t = tl.program_id(0)
    b_slot = tl.load(slot_mapping + i_t).to(tl.int64)
    i_page = b_slot // PAGE
    i_off = b_slot % PAGE
    o_h = tl.arange(0, BH)
    o_d = tl.arange(0, BD)
    m = (o_h < H)[:, None] & (o_d < D)[None, :]
    p_k = k + i_t * stride_kt + o_h[:, None] * stride_kh + o_d[None, :]
    p_v = v + i_t * stride_vt + o_h[:, None] * stride_vh + o_d[None, :]
    p_kc = k_cache + i_page * stride_kcp + i_off * stride_kcn + o_h[:, None] * stride_kch
    p_vc = v_cache + i_page * stride_vcp + i_off * stride_vcn + o_h[:, None] * stride_vch
    b_k = tl.load(p_k, mask=m).to(k_cache.dtype.element_ty)
    b_v = tl.load(p_v, mask=m).to(v_cache.dtype.element_ty)
    tl.store(p_kc + o_d[None, :], b_k, mask=m)
    tl.store(p_vc + o_d[None, :], b_v, mask=m)


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """See `reference.write_kv`. Mutates k_cache and v_cache (any strides; the last dim must
    be contiguous). page_tokens must be a power of two."""
    check_device(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_heads, head_dim = k.shape
    page_tokens = k_cache.shape[1]
    _check_cache(k_cache, v_cache)
    if num_tokens == 0:
        return
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    write_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        H=num_heads,
        D=head_dim,
        PAGE=page_tokens,
        BH=triton.next_power_of_2(num_heads),
        BD=triton.next_power_of_2(head_dim),
    )


def _check_cache(k_cache: Tensor, v_cache: Tensor) -> None:
    page_tokens = k_cache.shape[1]
    if page_tokens & (page_tokens - 1):
        raise ValueError(f"page_tokens must be a power of two, got {page_tokens}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches' last dim (head_dim) must be contiguous")


@triton.autotune(configs=autotune_configs(PAGED_ATTENTION_CONFIGS), key=["G", "D", "PAGE"])
@triton.jit
def paged_attention_kernel(
    q,
    k_cache,
    v_cache,
    o,
    block_tables,
    seq_lens,
    query_start_loc,
    tile_seq,
    tile_start,
    sinks,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kcp,
    stride_kcn,
    stride_kch,
    stride_vcp,
    stride_vcn,
    stride_vch,
    stride_bt,
    G: tl.constexpr,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BT: tl.constexpr,
    BM: tl.constexpr,
    BD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    WINDOW: tl.constexpr,
):
    i_tile, i_hk = tl.program_id(0), tl.program_id(1)
    i_b = tl.load(tile_seq + i_tile).to(tl.int64)
    t0 = tl.load(tile_start + i_tile)  # first query row of the tile, within the sequence
    q_start = tl.load(query_start_loc + i_b)
    q_len = tl.load(query_start_loc + i_b + 1) - q_start
    seq_len = tl.load(seq_lens + i_b)
    first_pos = seq_len - q_len

    o_m = tl.arange(0, BM)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    r_tok = t0 + o_m // G  # query row within the sequence
    r_head = i_hk * G + o_m % G  # query head
    m_row = (o_m < BT * G) & (r_tok < q_len)
    r_pos = first_pos + r_tok  # absolute position of each row
    p_q = q + (q_start + r_tok).to(tl.int64)[:, None] * stride_qt
    p_q += r_head[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_row[:, None] & m_d[None, :], other=0.0)

    if HAS_SINKS:
        # the sink opens the softmax: m = sink, l = exp(0) = 1, nothing added to acc
        b_m = tl.load(sinks + r_head).to(tl.float32)
        b_l = tl.full([BM], 1.0, dtype=tl.float32)
    elif WINDOW > 0:
        # a windowed row may meet whole hidden pages first: m starts finite (no 0/0)
        b_m = tl.full([BM], -1e30, dtype=tl.float32)
        b_l = tl.zeros([BM], dtype=tl.float32)
    else:
        b_m = tl.full([BM], float("-inf"), dtype=tl.float32)
        b_l = tl.zeros([BM], dtype=tl.float32)
    b_acc = tl.zeros([BM, BD], dtype=tl.float32)
    last_pos = first_pos + tl.minimum(t0 + BT, q_len) - 1
    o_n = tl.arange(0, PAGE)
    first_page = 0
    if WINDOW > 0:
        # pages before the tile's first row's window are hidden from every row: exact no-ops
        first_page = tl.maximum(first_pos + t0 - WINDOW + 1, 0) // PAGE
    for i_p in range(first_page, last_pos // PAGE + 1):
        i_page = tl.load(block_tables + i_b * stride_bt + i_p).to(tl.int64)
        k_pos = i_p * PAGE + o_n
        m_key = k_pos < seq_len
        m_kd = m_key[:, None] & m_d[None, :]
        p_k = k_cache + i_page * stride_kcp + o_n[:, None] * stride_kcn + i_hk * stride_kch
        p_v = v_cache + i_page * stride_vcp + o_n[:, None] * stride_vcn + i_hk * stride_vch
        b_k = tl.load(p_k + o_d[None, :], mask=m_kd, other=0.0)
        b_v = tl.load(p_v + o_d[None, :], mask=m_kd, other=0.0)
        b_s = dot(b_q, tl.trans(b_k)) * scale
        m_vis = (k_pos[None, :] <= r_pos[:, None]) & m_key[None, :]
        if WINDOW > 0:
            m_vis = m_vis & (k_pos[None, :] > r_pos[:, None] - WINDOW)
        b_s = tl.where(m_vis, b_s, float("-inf"))
        # every row sees key 0 in page 0 (or m starts finite), so b_m_new is finite
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_alpha = tl.exp(b_m - b_m_new)
        b_p = tl.exp(b_s - b_m_new[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_pv = dot(b_p.to(b_v.dtype), b_v)
        b_acc = b_acc * b_alpha[:, None] + b_pv
        b_m = b_m_new
    b_o = b_acc / b_l[:, None]
    p_o = o + (q_start + r_tok).to(tl.int64)[:, None] * stride_ot
    p_o += r_head[:, None] * stride_oh + o_d[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_row[:, None] & m_d[None, :])


def attention_tiles(
    query_start_loc: list[int], group: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """The kernel's work list for a call: per tile, its sequence and first query token (host
    values in, two int32 device tensors out; the tiles are in sequence order)."""
    if group > BLOCK_M:
        raise ValueError(f"GQA group {group} exceeds BLOCK_M = {BLOCK_M}")
    per_tile = BLOCK_M // group
    tile_seq, tile_start = [], []
    for b in range(len(query_start_loc) - 1):
        for t0 in range(0, query_start_loc[b + 1] - query_start_loc[b], per_tile):
            tile_seq.append(b)
            tile_start.append(t0)
    return (
        torch.tensor(tile_seq, dtype=torch.int32, device=device),
        torch.tensor(tile_start, dtype=torch.int32, device=device),
    )


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    tiles: tuple[Tensor, Tensor] | None = None,
    *,
    sinks: Tensor | None = None,
    window: int = 0,
) -> Tensor:
    """See `reference.paged_attention`. Pure: returns a new [T, Hq, D] tensor in q.dtype.

    page_tokens must be a power of two; the caches' last dim must be contiguous. ``tiles``
    is `attention_tiles` of the same query_start_loc, made once per step by a caller that
    calls this for every layer; without it each call reads query_start_loc back to the host
    (a device synchronisation per layer). ``sinks`` and ``window``: see the reference; no page
    before a tile's first row's window is read (table entries there may be -1).
    """
    check_device(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    _check_cache(k_cache, v_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"Hq = {num_q_heads} is not a multiple of Hk = {num_kv_heads}")
    group = num_q_heads // num_kv_heads
    if group > BLOCK_M:
        raise ValueError(f"GQA group {group} exceeds BLOCK_M = {BLOCK_M}")
    tokens_per_tile = BLOCK_M // group
    if q.stride(-1) != 1:
        q = q.contiguous()
    o = torch.empty((num_tokens, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if tiles is None:
        tiles = attention_tiles(query_start_loc.tolist(), group, q.device)
    tile_seq_t, tile_start_t = tiles
    if tile_seq_t.numel() == 0:
        return o
    paged_attention_kernel[(tile_seq_t.numel(), num_kv_heads)](
        q,
        k_cache,
        v_cache,
        o,
        block_tables,
        seq_lens,
        query_start_loc,
        tile_seq_t,
        tile_start_t,
        sinks.float().contiguous() if sinks is not None else q,
        scale,
        q.stride(0),
        q.stride(1),
        o.stride(0),
        o.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        G=group,
        D=head_dim,
        PAGE=k_cache.shape[1],
        BT=tokens_per_tile,
        BM=BLOCK_M,
        BD=block(head_dim),
        HAS_SINKS=sinks is not None,
        WINDOW=window,
    )
    return o
