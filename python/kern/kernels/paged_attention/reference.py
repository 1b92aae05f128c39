"""Torch reference for the paged KV cache: write_kv and causal paged attention.

Design notes (batch invariance, see README.md for the guarantee):
- Loop per sequence, so no row ever shares a reduction with another sequence's rows.
- A sequence's keys are read in fixed blocks of `kv_block` absolute positions
  ([0, kv_block), [kv_block, 2 kv_block), ...) and folded with an online softmax in block
  order. A query row's visible keys end in the block holding its own position; blocks past
  it are fully masked for that row and contribute exact zeros (p = 0, rescale factor
  exp(m - m) = 1), so every row gets the bits it would get had it stopped at its own block,
  however the sequence's queries were chunked across calls.
- Queries go through the matmuls in tiles of exactly `q_block` rows (the last one zero
  padded). Measured on torch 2.13 CPU: a row of a float32 matmul is NOT bitwise stable as
  the row count varies at these small shapes (K = 128 rows changed between M = 4 and M = 6),
  but with a fixed [q_block, D] @ [D, kv_block] shape a row's bits did not depend on its
  place in the tile nor on the other rows. So every matmul here has one fixed shape.
- exp runs on [Hq, q_block, kv_block] and [Hq, q_block, 1]: torch's SIMD steps (16 or 32
  floats, see pointwise.py) never split one head's q_block rows between the SIMD and the
  scalar path, so a row takes the same path at any place in its tile.
- A sequence's K/V are gathered once per call into contiguous blocks (`_blocks`).
- Masked scores are set with `where` (never added), and values past the context are zeroed,
  so garbage in unused cache slots (NaN from torch.empty) cannot leak through 0 * NaN.
"""

import torch
from torch import Tensor

from kern.arith import cdiv

Q_BLOCK = 16  # query rows per matmul tile; fixed so every matmul has one shape
KV_BLOCK = 64  # keys per online-softmax step, in absolute positions of the sequence
_HIDDEN = -1e30  # a windowed row's starting max: below any score, and finite


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Mutates k_cache, v_cache: row t of k/v goes to page slot_mapping[t] // page_tokens,
    offset slot_mapping[t] % page_tokens (cast to the cache dtype).

    k, v: [T, Hk, D]; caches: [P, page_tokens, Hk, D], any strides (views of a larger arena
    are written through). Raises IndexError for a slot past the cache.
    """
    page_tokens = k_cache.shape[1]
    slot_mapping = slot_mapping.to(device=k_cache.device, dtype=torch.long)
    page_ids = slot_mapping // page_tokens
    offsets = slot_mapping % page_tokens
    # Advanced indexing on both leading dims writes through any strides (no view(-1) that
    # would need a contiguous arena).
    k_cache[page_ids, offsets] = k.to(k_cache.dtype)
    v_cache[page_ids, offsets] = v.to(v_cache.dtype)


def _blocks(
    cache: Tensor, block_table: Tensor, seq_len: int, kv_block: int, group: int, lo: int = 0
):
    """A sequence's keys (or values) as float32 [num_blocks, Hq, kv_block, D], zero before
    position ``lo`` (a window's start: the table may hold -1 for the pages before it, which
    are not read) and past seq_len, each KV head repeated over its `group` query heads.
    Gathered once per sequence; each block is contiguous, so every matmul sees the same
    layout."""
    page_tokens, num_kv_heads, head_dim = cache.shape[1:]
    num_blocks = cdiv(seq_len, kv_block)
    positions = torch.arange(lo, seq_len, device=cache.device)
    pages = block_table[positions // page_tokens].long()
    out = torch.zeros(num_blocks * kv_block, num_kv_heads, head_dim, device=cache.device)
    # Advanced indexing on (page, offset) reads through any strides.
    out[lo:seq_len] = cache[pages, positions % page_tokens].float()
    out = out.view(num_blocks, kv_block, num_kv_heads, head_dim).transpose(1, 2)
    return out.repeat_interleave(group, dim=1).contiguous()


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    *,
    q_block: int = Q_BLOCK,
    kv_block: int = KV_BLOCK,
    sinks: Tensor | None = None,
    window: int = 0,
) -> Tensor:
    """Causal attention of each sequence's last q_len positions over its paged KV. Pure.

    q: [T, Hq, D]; k_cache, v_cache: [P, page_tokens, Hk, D] (already holding this call's
    K/V: call write_kv first); block_tables: [B, max_pages] int32; seq_lens: [B] int32,
    context length including this call's rows; query_start_loc: [B+1] int32, rows
    query_start_loc[b]:query_start_loc[b+1] of q are positions seq_len - q_len .. seq_len - 1
    of sequence b. Query head h reads KV head h // (Hq // Hk). Returns [T, Hq, D] in q.dtype.

    q_block and kv_block (keyword-only) are the tile sizes of the invariance guarantee: a
    row's bits are fixed for a fixed pair; changing either changes rounding.

    ``sinks`` ([Hq] float, gpt-oss's): a learned logit per query head that joins each row's
    softmax denominator and adds no value. ``window`` > 0: a row at position p sees only keys
    at p - window + 1 .. p (a sliding-window layer); blocks before a tile's window are still
    folded, as exact no-ops, so a row's bits do not depend on its place in the tile, and
    pages before the window of the call's first row are not read (their table entries may be
    -1: window pages given back).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // k_cache.shape[2]
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        q_start, q_end, seq_len = starts[b], starts[b + 1], lens[b]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        first_pos = seq_len - q_len  # absolute position of this call's first query row
        # A window's first key: no row of the call reads an earlier one.
        lo = max(first_pos - window + 1, 0) if window else 0
        k_blocks = _blocks(k_cache, block_tables[b], seq_len, kv_block, group, lo)
        v_blocks = _blocks(v_cache, block_tables[b], seq_len, kv_block, group, lo)
        for t0 in range(0, q_len, q_block):
            rows = min(q_block, q_len - t0)
            # [Hq, q_block, D], zero padded past `rows`
            q_tile = torch.zeros(num_q_heads, q_block, head_dim, device=q.device)
            q_tile[:, :rows] = q[q_start + t0 : q_start + t0 + rows].float().transpose(0, 1)
            q_pos = first_pos + t0 + torch.arange(q_block, device=q.device)  # [q_block]
            # The sink opens the softmax (m = sink, denominator exp(0) = 1); without one, a
            # windowed row may meet whole hidden blocks first, so m starts finite there.
            if sinks is not None:
                m = sinks.float().view(num_q_heads, 1, 1).expand(-1, q_block, 1).to(q.device)
                denom = torch.ones(num_q_heads, q_block, 1, device=q.device)
            else:
                start = _HIDDEN if window else float("-inf")
                m = torch.full((num_q_heads, q_block, 1), start, device=q.device)
                denom = torch.zeros(num_q_heads, q_block, 1, device=q.device)
            acc = torch.zeros(num_q_heads, q_block, head_dim, device=q.device)
            # Keys up to the last real row's position; later blocks are masked for all rows.
            last_pos = first_pos + t0 + rows - 1
            # Blocks before the tile's first row's window are hidden from every row: no-ops.
            first_blk = max(first_pos + t0 - window + 1, 0) // kv_block if window else 0
            for i_blk in range(first_blk, last_pos // kv_block + 1):
                k_pos = i_blk * kv_block + torch.arange(kv_block, device=q.device)
                visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < seq_len)
                if window:
                    visible &= k_pos[None, :] > q_pos[:, None] - window
                s = torch.matmul(q_tile, k_blocks[i_blk].transpose(1, 2)) * scale
                s = torch.where(visible, s, float("-inf"))
                m_new = torch.maximum(m, s.amax(-1, keepdim=True))
                # Every row sees key 0 in block 0 (or m starts finite), so m_new is finite.
                alpha = torch.exp(m - m_new)
                p = torch.exp(s - m_new)
                denom = denom * alpha + p.sum(-1, keepdim=True)
                acc = acc * alpha + torch.matmul(p, v_blocks[i_blk])
                m = m_new
            o = acc / denom  # [Hq, q_block, D]
            out[q_start + t0 : q_start + t0 + rows] = o[:, :rows].transpose(0, 1)
    return out.to(q.dtype)
