"""Torch reference for multi-head latent attention (MLA) over a paged latent cache.

One shared KV "head" per layer: a token's cache entry is its C = v_dim + rope_dim vector
(normalised latent, then rotated RoPE key). The key is the whole entry, the value its first
v_dim values; queries come already absorbed into that space ([T, H, C]).

Design notes (batch invariance, as in paged_attention's reference; see README.md):
- Loop per sequence, so no row ever shares a reduction with another sequence's rows.
- A sequence's entries are read in fixed blocks of `KV_BLOCK` absolute positions
  ([0, KV_BLOCK), [KV_BLOCK, 2 KV_BLOCK), ...) and folded with an online softmax in block
  order. A query row's visible keys end in the block holding its own position; blocks past
  it are fully masked for that row and contribute exact zeros (p = 0, rescale factor
  exp(m - m) = 1), so every row gets the bits it would get had it stopped at its own block,
  however the sequence's queries were chunked across calls.
- Queries go through the matmuls in tiles of exactly `Q_BLOCK` rows per head (the last tile
  zero padded): every matmul has one shape, [H, Q_BLOCK, C] @ [C, KV_BLOCK] and
  [H, Q_BLOCK, KV_BLOCK] @ [KV_BLOCK, v_dim], whatever the batch or the chunking. A float32
  matmul row is not bitwise stable as the row count varies (measured for paged_attention on
  torch 2.13 CPU); with one fixed shape a row's bits do not depend on its place in the tile
  (asserted by the tests).
- exp runs on [H, Q_BLOCK, KV_BLOCK] and [H, Q_BLOCK, 1] tensors of fixed shapes, so an
  element always takes the same SIMD or scalar path (see pointwise.py).
- A sequence's entries are gathered once per call into contiguous float32 blocks (`_blocks`).
- Masked scores are set with `where` (never added), and entries past the context are
  zeroed, so garbage in unused cache slots (NaN from torch.empty) cannot leak through 0 * NaN.
"""

import torch
from torch import Tensor

from kern.arith import cdiv

Q_BLOCK = 16  # query rows (per head) per matmul tile; fixed so every matmul has one shape
KV_BLOCK = 64  # keys per online-softmax step, in absolute positions of the sequence


def write_latent(entry: Tensor, cache: Tensor, slot_mapping: Tensor) -> None:
    """Mutates cache: row t of entry goes to page slot_mapping[t] // page_tokens, offset
    slot_mapping[t] % page_tokens (cast to the cache dtype).

    entry: [T, C]; cache: [P, page_tokens, C], any strides (a view of a larger arena is
    written through); slot_mapping: [T] int64. Raises IndexError for a slot past the cache.
    """
    page_tokens = cache.shape[1]
    slot_mapping = slot_mapping.to(device=cache.device, dtype=torch.long)
    # Advanced indexing on both leading dims writes through any strides.
    cache[slot_mapping // page_tokens, slot_mapping % page_tokens] = entry.to(cache.dtype)


def _blocks(cache: Tensor, block_table: Tensor, seq_len: int) -> Tensor:
    """A sequence's entries as float32 [num_blocks, KV_BLOCK, C], zero past seq_len.
    Gathered once per sequence; each block is contiguous, so every matmul sees one layout."""
    page_tokens, width = cache.shape[1:]
    num_blocks = cdiv(seq_len, KV_BLOCK)
    positions = torch.arange(seq_len, device=cache.device)
    pages = block_table[positions // page_tokens].long()
    out = torch.zeros(num_blocks * KV_BLOCK, width, device=cache.device)
    # Advanced indexing on (page, offset) reads through any strides.
    out[:seq_len] = cache[pages, positions % page_tokens].float()
    return out.view(num_blocks, KV_BLOCK, width)


def mla_attention(
    q: Tensor,
    cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    v_dim: int,
) -> Tensor:
    """Causal MLA of each sequence's last q_len positions over its paged latent cache. Pure.

    q: [T, H, C], absorbed queries (first v_dim dims q_nope @ W_UK, last C - v_dim the
    rotated q_pe); cache: [P, page_tokens, C] (already holding this call's entries: call
    write_latent first); block_tables: [B, max_pages] int32; seq_lens: [B] int32, context
    length including this call's rows; query_start_loc: [B+1] int32, rows
    query_start_loc[b]:query_start_loc[b+1] of q are positions seq_len - q_len .. seq_len - 1
    of sequence b. Returns [T, H, v_dim] in q.dtype:

        out[t, h] = sum_{j <= pos(t)} softmax_j(scale * q[t, h] . cache_j) cache_j[:v_dim]
    """
    num_tokens, num_heads, width = q.shape
    out = torch.zeros(num_tokens, num_heads, v_dim, dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b in range(len(lens)):
        q_start, q_end, seq_len = starts[b], starts[b + 1], lens[b]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        first_pos = seq_len - q_len  # absolute position of this call's first query row
        keys = _blocks(cache, block_tables[b], seq_len)  # [num_blocks, KV_BLOCK, C]
        values = keys[:, :, :v_dim].contiguous()  # [num_blocks, KV_BLOCK, v_dim]
        for t0 in range(0, q_len, Q_BLOCK):
            rows = min(Q_BLOCK, q_len - t0)
            # [H, Q_BLOCK, C], zero padded past `rows`
            q_tile = torch.zeros(num_heads, Q_BLOCK, width, device=q.device)
            q_tile[:, :rows] = q[q_start + t0 : q_start + t0 + rows].float().transpose(0, 1)
            q_pos = first_pos + t0 + torch.arange(Q_BLOCK, device=q.device)  # [Q_BLOCK]
            m = torch.full((num_heads, Q_BLOCK, 1), float("-inf"), device=q.device)
            denom = torch.zeros(num_heads, Q_BLOCK, 1, device=q.device)
            acc = torch.zeros(num_heads, Q_BLOCK, v_dim, device=q.device)
            # Keys up to the last real row's position; later blocks are masked for all rows.
            last_pos = first_pos + t0 + rows - 1
            for i_blk in range(last_pos // KV_BLOCK + 1):
                k_pos = i_blk * KV_BLOCK + torch.arange(KV_BLOCK, device=q.device)
                visible = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < seq_len)
                s = torch.matmul(q_tile, keys[i_blk].T) * scale  # [H, Q_BLOCK, KV_BLOCK]
                s = torch.where(visible, s, float("-inf"))
                m_new = torch.maximum(m, s.amax(-1, keepdim=True))
                # Every row sees key 0 in block 0, so m_new is finite from the first block on.
                alpha = torch.exp(m - m_new)
                p = torch.exp(s - m_new)
                denom = denom * alpha + p.sum(-1, keepdim=True)
                acc = acc * alpha + torch.matmul(p, values[i_blk])
                m = m_new
            o = acc / denom  # [H, Q_BLOCK, v_dim]
            out[q_start + t0 : q_start + t0 + rows] = o[:, :rows].transpose(0, 1)
    return out.to(q.dtype)
