"""Triton write_latent and causal MLA over a paged latent cache; same signatures as
`reference.py`.

Design notes:
- One program per (query tile, head block). A tile packs BT consecutive query rows of one
  sequence times BH heads into BM = BT * BH = BLOCK_M rows. All heads attend to the same
  keys (one shared latent KV head), so a key block is loaded once for the BH heads of the
  program: a decode row (one query row) gets a program of its own holding all its heads
  (up to BLOCK_M of them; more heads take several programs, which read the same keys).
  Prefill tiles are query rows x heads, the same kernel with the same tile shape.
- BM is one fixed constant, and BH, BT are functions of H alone, not of the batch: a row's
  dot products have the same shape in every call, decode or prefill, which is what keeps a
  row's bits independent of the batch and of the chunking (a row's position inside a tile
  does not change its MMA reduction order).
- Scores are split into the latent part (v_dim dims, padded to BV) and the RoPE part
  (C - v_dim dims, padded to BR): 512 + 64 takes no 1024-wide padding. The latent block is
  loaded once and used as both the key's first part and the value.
- Keys are read in blocks of BN absolute positions, in order, with an online softmax in
  float32, up to the block holding the tile's last row. Each key row's page comes from the
  block table, so a block may span pages and page_tokens need not be a power of two. For
  rows that end earlier the later blocks are fully masked: p = 0 and the rescale is
  exp(0) = 1, exact, so they get the bits they would get had they stopped at their block.
- Loads past the context are masked to zero and masked scores set with `where`, so garbage
  (NaN) in unused slots never enters.
- The work list (tiles) is built on the device from query_start_loc with a grid sized from
  the shapes alone (an upper bound; programs past the last tile return at once): no
  device-to-host copy per call.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from .._triton import autotune_configs, block, check_device, dot

BLOCK_M = 16  # query rows (tokens x heads) per program; fixed for batch invariance
BLOCK_N = 32  # keys per online-softmax step, in absolute positions

WRITE_LATENT_CONFIGS = [triton.Config({}, num_warps=w) for w in (1, 2, 4)]
MLA_ATTENTION_CONFIGS = [
    triton.Config({}, num_warps=w, num_stages=s) for w, s in ((4, 2), (4, 3), (8, 2), (2, 2))
]


@triton.autotune(configs=autotune_configs(WRITE_LATENT_CONFIGS), key=["C"])
@triton.jit
def write_latent_kernel(
    entry,
    cache,
    slot_mapping,
    stride_et,
    stride_cp,
    stride_cn,
    C: tl.constexpr,
    PAGE: tl.constexpr,
    BC: tl.constexpr,
):
    i_t = tl.program_id(0)
    b_slot = tl.load(slot_mapping + i_t).to(tl.int64)
    o_c = tl.arange(0, BC)
    m_c = o_c < C
    b_e = tl.load(entry + i_t * stride_et + o_c, mask=m_c)
    p_c = cache + (b_slot // PAGE) * stride_cp + (b_slot % PAGE) * stride_cn
    tl.store(p_c + o_c, b_e.to(cache.dtype.element_ty), mask=m_c)


def write_latent(entry: Tensor, cache: Tensor, slot_mapping: Tensor) -> None:
    """See `reference.write_latent`. Mutates cache (any strides for its first two dims; the
    last dim must be contiguous)."""
    check_device(entry, cache, slot_mapping)
    _check_cache(cache)
    num_tokens, width = entry.shape
    if width != cache.shape[2]:
        raise ValueError(f"entry width {width} != cache width {cache.shape[2]}")
    if num_tokens == 0:
        return
    if entry.stride(-1) != 1:
        entry = entry.contiguous()
    write_latent_kernel[(num_tokens,)](
        entry,
        cache,
        slot_mapping,
        entry.stride(0),
        cache.stride(0),
        cache.stride(1),
        C=width,
        PAGE=cache.shape[1],
        BC=triton.next_power_of_2(width),
    )


def _check_cache(cache: Tensor) -> None:
    if cache.dim() != 3:
        raise ValueError(f"cache must be [P, page_tokens, C], got shape {tuple(cache.shape)}")
    if cache.stride(-1) != 1:
        raise ValueError("the cache's last dim (C) must be contiguous")


@triton.autotune(configs=autotune_configs(MLA_ATTENTION_CONFIGS), key=["H", "V", "R", "PAGE"])
@triton.jit
def mla_attention_kernel(
    q,
    cache,
    o,
    block_tables,
    seq_lens,
    query_start_loc,
    tile_seq,
    tile_start,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cp,
    stride_cn,
    stride_bt,
    H: tl.constexpr,
    V: tl.constexpr,
    R: tl.constexpr,
    PAGE: tl.constexpr,
    BT: tl.constexpr,
    BH: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BV: tl.constexpr,
    BR: tl.constexpr,
):
    i_tile, i_hb = tl.program_id(0), tl.program_id(1)
    i_b = tl.load(tile_seq + i_tile).to(tl.int64)
    if i_b < 0:  # past the last tile (the grid is an upper bound)
        return
    t0 = tl.load(tile_start + i_tile)  # first query row of the tile, within the sequence
    q_start = tl.load(query_start_loc + i_b)
    q_len = tl.load(query_start_loc + i_b + 1) - q_start
    seq_len = tl.load(seq_lens + i_b)
    first_pos = seq_len - q_len

    o_m = tl.arange(0, BM)
    o_v = tl.arange(0, BV)
    o_r = tl.arange(0, BR)
    m_v = o_v < V
    m_r = o_r < R
    r_tok = t0 + o_m // BH  # query row within the sequence
    r_head = i_hb * BH + o_m % BH
    m_row = (o_m < BT * BH) & (r_tok < q_len) & (r_head < H)
    r_pos = first_pos + r_tok  # absolute position of each row
    p_q = q + (q_start + r_tok).to(tl.int64)[:, None] * stride_qt + r_head[:, None] * stride_qh
    b_q_lat = tl.load(p_q + o_v[None, :], mask=m_row[:, None] & m_v[None, :], other=0.0)
    b_q_rope = tl.load(p_q + V + o_r[None, :], mask=m_row[:, None] & m_r[None, :], other=0.0)

    b_m = tl.full([BM], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)
    b_acc = tl.zeros([BM, BV], dtype=tl.float32)
    last_pos = first_pos + tl.minimum(t0 + BT, q_len) - 1
    o_n = tl.arange(0, BN)
    for i_k in range(0, last_pos // BN + 1):
        k_pos = i_k * BN + o_n
        m_key = k_pos < seq_len
        # each key row's page (a block may span pages); none read past the context
        i_page = tl.load(block_tables + i_b * stride_bt + k_pos // PAGE, mask=m_key, other=0)
        p_c = cache + i_page.to(tl.int64)[:, None] * stride_cp
        p_c += (k_pos % PAGE)[:, None] * stride_cn
        b_lat = tl.load(p_c + o_v[None, :], mask=m_key[:, None] & m_v[None, :], other=0.0)
        b_rope = tl.load(p_c + V + o_r[None, :], mask=m_key[:, None] & m_r[None, :], other=0.0)
        b_s = dot(b_q_lat, tl.trans(b_lat)) + dot(b_q_rope, tl.trans(b_rope))
        b_s = b_s * scale
        m_vis = (k_pos[None, :] <= r_pos[:, None]) & m_key[None, :]
        b_s = tl.where(m_vis, b_s, float("-inf"))
        # every row sees key 0 in block 0, so b_m_new is finite from the first block on
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_alpha = tl.exp(b_m - b_m_new)
        b_p = tl.exp(b_s - b_m_new[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_pv = dot(b_p.to(b_lat.dtype), b_lat)  # the value is the latent part
        b_acc = b_acc * b_alpha[:, None] + b_pv
        b_m = b_m_new
    b_o = b_acc / b_l[:, None]
    p_o = o + (q_start + r_tok).to(tl.int64)[:, None] * stride_ot + r_head[:, None] * stride_oh
    tl.store(p_o + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_row[:, None] & m_v[None, :])


def tile_shape(num_heads: int) -> tuple[int, int]:
    """(BT, BH): query rows and heads per program, BT * BH = BLOCK_M. A function of the head
    count alone, so a row's tile shape never depends on the batch."""
    heads = min(triton.next_power_of_2(num_heads), BLOCK_M)
    return BLOCK_M // heads, heads


def mla_tiles(query_start_loc: Tensor, num_tokens: int, tokens_per_tile: int):
    """The kernel's work list, built on query_start_loc's device (no host copy): per tile its
    sequence (-1 past the last tile) and first query row, as two int32 tensors of a length
    fixed by the shapes, min(T, T // BT + B), an upper bound on the tiles. In sequence order."""
    num_seqs = query_start_loc.numel() - 1
    grid = min(num_tokens, num_tokens // tokens_per_tile + num_seqs)
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    counts = (q_lens + tokens_per_tile - 1) // tokens_per_tile
    ends = counts.cumsum(0)
    ids = torch.arange(grid, device=query_start_loc.device)
    seq = torch.searchsorted(ends, ids, right=True)  # num_seqs past the last tile
    first = F.pad(ends - counts, (0, 1))  # first tile of each sequence; 0 for num_seqs
    start = (ids - first[seq]) * tokens_per_tile
    seq = torch.where(seq < num_seqs, seq, -1)
    return seq.to(torch.int32), start.to(torch.int32)


def mla_attention(
    q: Tensor,
    cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    v_dim: int,
) -> Tensor:
    """See `reference.mla_attention`. Pure: returns a new [T, H, v_dim] tensor in q.dtype.

    The cache's last dim must be contiguous (its first two dims may have any strides);
    page_tokens may be any size.
    """
    check_device(q, cache, block_tables, seq_lens, query_start_loc)
    _check_cache(cache)
    num_tokens, num_heads, width = q.shape
    if width != cache.shape[2]:
        raise ValueError(f"q width {width} != cache width {cache.shape[2]}")
    if not 0 < v_dim < width:
        raise ValueError(f"v_dim = {v_dim} must be in (0, C = {width})")
    if q.dtype != cache.dtype:
        raise ValueError(f"q is {q.dtype} but the cache is {cache.dtype}: tl.dot needs one")
    if q.stride(-1) != 1:
        q = q.contiguous()
    o = torch.empty((num_tokens, num_heads, v_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or seq_lens.numel() == 0:
        return o
    tokens_per_tile, heads_per_tile = tile_shape(num_heads)
    tile_seq, tile_start = mla_tiles(query_start_loc, num_tokens, tokens_per_tile)
    mla_attention_kernel[(tile_seq.numel(), triton.cdiv(num_heads, heads_per_tile))](
        q,
        cache,
        o,
        block_tables,
        seq_lens,
        query_start_loc,
        tile_seq,
        tile_start,
        scale,
        q.stride(0),
        q.stride(1),
        o.stride(0),
        o.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        H=num_heads,
        V=v_dim,
        R=width - v_dim,
        PAGE=cache.shape[1],
        BT=tokens_per_tile,
        BH=heads_per_tile,
        BM=BLOCK_M,
        BN=BLOCK_N,
        BV=block(v_dim),
        BR=block(width - v_dim),
    )
    return o
