"""Causal attention over the paged KV cache on the CPU, batched across sequences.

Design notes
------------
* Why not the reference (``kern.kernels.paged_attention.reference``): it loops per sequence,
  per query tile and per key block in Python, about 15 ops per (sequence, block); a decode
  step of 32 sequences at 256 tokens of context is then ~2000 ops per layer. Here all decode
  sequences of a step share one set of ~15 batched ops per layer, and a prefill chunk takes
  one set per tile of ``Q_TILE`` rows.
* Batch invariance (a row's bits depend on its query, its own keys and values and nothing
  else: not on the batch, not on how the sequence's prefill was chunked, not on whether the
  row is a decode step or part of a prefill):
  - Keys are read in blocks of ``KEY_BLOCK`` absolute positions. Scores are one batched
    matmul per (unit, KV head), [M, D] @ [D, NB * KEY_BLOCK]: a score's bits did not change
    with the number of keys N (up to 4096), with M >= 2, nor with the batch count (D 16-256).
    The values are one matmul per (unit, KV head, block), [M, KEY_BLOCK] @ [KEY_BLOCK, D]:
    a contraction over all keys at once is not stable (zero-padding 300 keys to 512 changed
    bits), one of fixed length is. Few rows take other kernels (M = 1 differed from M >= 2
    on the earlier host; M = 1-3 from M >= 4 on an AMD EPYC one), so a unit has at least
    ``MIN_ROWS`` rows, padded by repeating its last row. A batch of one matmul goes to the
    plain gemm, which on that AMD host at 2 threads split M across threads (rows changed for
    M in 5-11), so a group of one (unit, KV head) is padded with a copy of its unit; every
    batch count from 2 up gave the same bits.
  - The softmax max is taken over all of a row's scores, hidden ones pushed to -1e30: a max
    is exact whatever the order. exp(s - max) is elementwise (exp agrees in torch's vector
    and scalar loops). Hidden keys get p = 0 exactly, so a block past a row's position adds
    exact zeros.
  - Per-block partial sums (denominator and p @ V) are added across blocks by a pairwise tree
    over a power-of-two count, zero padded: trailing zero blocks fold away exactly, so a row
    gets the bits it would get with only its own blocks, however many blocks its batch had.
  The result differs from transformers' eager softmax-then-matmul by float32 rounding only
  (and by exponents below -87 being clamped there: a weight of 1.6e-38 instead of less).
* Latent pages (multi-head latent attention, ``attend_latent``): every query head reads the
  one cached vector per token, the key being the whole vector and the value its first
  ``v_dim`` values. A unit's pages are gathered once as rows of ``page_tokens * C`` values;
  the key operand is that gather transposed into a contiguous [C, keys] copy and the value
  operand its first ``v_dim`` columns made contiguous, so both matmuls see the operands the
  GQA path gives them (copies are exact), and the softmax and block sums are the same code.
  All H heads of a row are the M rows of one matmul (one KV head, group size H).
* Unused cache rows are never NaN (the runner zero-fills its arena) and every cache value is
  finite, so stale keys only shift hidden scores that are discarded, and stale values meet
  p = 0 exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from kern.arith import cdiv

KEY_BLOCK = 32  # keys per block, in absolute positions of a sequence
Q_TILE = 64  # query rows per unit when a sequence brings more than SMALL_ROWS rows
SMALL_ROWS = 8  # sequences with at most this many rows (decode, verify) share one unit group
# Matmul rows per (unit, KV head) at least: fewer take other kernels (see the notes).
MIN_ROWS = 4
# Elements of a group's largest intermediate (about units x KV heads x blocks x rows x
# max(KEY_BLOCK, head_dim)) before prefill tiles go to another group: 8M floats, 32 MB.
GROUP_BUDGET = 1 << 23
_HIDDEN = -1e30  # added to a hidden key's score: below any real score, and finite
_MIN_EXPONENT = -87.0  # exp(-87) = 1.6e-38, the smallest exponent with a normal result


@dataclass(frozen=True, slots=True)
class _Group:
    """Units (sequence, query tile) that go through the same batched ops."""

    rows: Tensor  # [I, R] int64: row of q for each unit row (padding repeats the last row)
    k_rows: Tensor  # [I * Hk * D * NP]: rows of page_tokens keys (see attend), in order
    v_rows: Tensor  # [I * Hk * NP]: rows of page_tokens * D values
    bias: Tensor  # [I, 1, R * n_rep, NB * KEY_BLOCK] float: 0 where visible, -1e30 where not
    visible: Tensor  # same shape, float: 1 where visible, 0 where not
    src: Tensor  # [n] int64: which of the I * R unit rows are real
    dst: Tensor  # [n] int64: the q row each real unit row is
    pages: Tensor  # [I * NP] int64: each unit's pages, in order (latent pages' rows)
    num_blocks: int
    # Gather buffers, allocated by the first layer and reused by the others: every layer's
    # gather has the same shape, and fresh multi-MB buffers cost page faults each time.
    scratch: dict = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CpuAttentionPlan:
    """Index tensors for one forward, shared by every attention layer."""

    groups: tuple[_Group, ...]
    num_kv_heads: int
    group_size: int  # query heads per KV head
    page_ids: Tensor  # [T] int64: where this step's K/V go
    page_offsets: Tensor  # [T] int64


def plan_attention(
    q_starts: list[int],
    q_lens: list[int],
    ctx_lens: list[int],
    block_tables: Tensor,
    page_tokens: int,
    num_kv_heads: int,
    group_size: int,
    head_dim: int,
    page_stride: int,
    page_ids: Tensor,
    page_offsets: Tensor,
) -> CpuAttentionPlan:
    """block_tables: [B, max_pages] int64 (padding entries are never read); page_stride:
    elements from one page to the next in the arena; page_ids and page_offsets [T]: where
    this step's rows write their K/V. page_tokens must be a power of two (so that pages and
    key blocks tile each other).

    Units are (sequence, tile of at most Q_TILE query rows). Short sequences (decode, verify)
    form one group; prefill tiles are sorted by how many key blocks they read and packed
    into groups under GROUP_BUDGET, so a batch of prompts is a few groups, not one per tile.
    Any grouping gives the same bits (see the design notes): it only trades padding for ops.
    """
    if page_tokens & (page_tokens - 1):
        raise ValueError(f"page_tokens must be a power of two, got {page_tokens}")
    min_unit_rows = cdiv(MIN_ROWS, group_size)
    layout = (num_kv_heads, head_dim, page_stride)
    args = (
        q_starts,
        q_lens,
        ctx_lens,
        block_tables,
        page_tokens,
        group_size,
        min_unit_rows,
        layout,
    )
    small = [(b, 0, n) for b, n in enumerate(q_lens) if n <= SMALL_ROWS]
    groups = [_group(small, *args)] if small else []
    tiles = []
    for b, n in enumerate(q_lens):
        if n > SMALL_ROWS:
            for t0 in range(0, n, Q_TILE):
                rows = min(Q_TILE, n - t0)
                last_pos = ctx_lens[b] - n + t0 + rows - 1
                tiles.append((last_pos // KEY_BLOCK + 1, (b, t0, rows)))
    tiles.sort(key=lambda x: x[0])
    head_dim_cost = max(KEY_BLOCK, 128)
    unit_cost = num_kv_heads * Q_TILE * group_size * head_dim_cost
    pack: list[tuple[int, int, int]] = []
    for nb, unit in tiles:
        # Sorted by nb, so this unit's nb is the group's: cost = units * nb * unit_cost.
        if pack and (len(pack) + 1) * nb * unit_cost > GROUP_BUDGET:
            groups.append(_group(pack, *args))
            pack = []
        pack.append(unit)
    if pack:
        groups.append(_group(pack, *args))
    return CpuAttentionPlan(tuple(groups), num_kv_heads, group_size, page_ids, page_offsets)


def _group(
    units,
    q_starts,
    q_lens,
    ctx_lens,
    block_tables,
    page_tokens,
    group_size,
    min_unit_rows,
    layout,
) -> _Group:
    hk, d, page_stride = layout
    if len(units) * hk < 2:
        units = [*units, *units]  # a batch of one matmul takes the plain gemm (see notes)
    r = max(max(n for _, _, n in units), min_unit_rows)
    seq = torch.tensor([b for b, _, _ in units])
    t0 = torch.tensor([t for _, t, _ in units])
    n = torch.tensor([k for _, _, k in units])
    q_start = torch.tensor(q_starts)[seq]
    ctx = torch.tensor(ctx_lens)[seq]
    first_pos = ctx - torch.tensor(q_lens)[seq] + t0  # position of each unit's first row
    local = torch.minimum(torch.arange(r)[None, :], (n - 1)[:, None])  # [I, R]
    rows = q_start[:, None] + t0[:, None] + local
    q_pos = first_pos[:, None] + local
    last_pos = first_pos + n - 1
    num_keys = (int(last_pos.max()) // KEY_BLOCK + 1) * KEY_BLOCK
    # Whole pages are read; with pages longer than a key block the extra keys are masked
    # blocks, which add exact zeros (so the bits do not depend on page_tokens).
    num_pages = cdiv(num_keys, page_tokens)
    num_blocks = num_pages * page_tokens // KEY_BLOCK
    k_pos = torch.arange(num_blocks * KEY_BLOCK)
    # Pages past a unit's context repeat its last page (any real page would do: masked).
    page_idx = torch.minimum(torch.arange(num_pages)[None, :], ((ctx - 1) // page_tokens)[:, None])
    pages = torch.gather(block_tables[seq], 1, page_idx)  # [I, NP]
    # K: row (page, head, dim) of page_tokens keys; V: chunk (page, head) of page_tokens rows
    # of D values, after the K half of the page (see kv_views).
    k_rows = pages[:, None, None, :] * (page_stride // page_tokens) + torch.arange(hk * d).view(
        1, hk, d, 1
    )
    v_rows = (
        pages[:, None, :] * (page_stride // (page_tokens * d))
        + hk
        + torch.arange(hk)[None, :, None]
    )
    hidden = k_pos[None, None, :] > q_pos[:, :, None]  # [I, R, NB*KB]
    hidden = hidden.repeat_interleave(group_size, dim=1).unsqueeze(1)  # [I, 1, M, NB*KB]
    visible = (~hidden).float()
    bias = hidden.float() * _HIDDEN
    real = torch.arange(r)[None, :] < n[:, None]
    src = real.flatten().nonzero().flatten()
    dst = rows.flatten()[src]
    return _Group(
        rows,
        k_rows.flatten(),
        v_rows.flatten(),
        bias,
        visible,
        src,
        dst,
        pages.flatten(),
        num_blocks,
    )


def kv_views(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """A layer's K and V as [P, page_tokens, Hk, D] views (the kernels' logical layout).

    kv_cache is the layer's slice of the arena, [P, 2, Hk, page_tokens * D] per page. V is
    stored [Hk, page_tokens, D], K transposed, [Hk, D, page_tokens]: a unit's keys are then
    gathered as whole pages straight into the [D, keys] operand of the score matmul, whose
    row bits are stable, where a [keys, D] operand (transposed in the matmul) was not: with
    B transposed, rows changed between M = 4 and M = 8 at D = 128.
    """
    num_pages, _, hk, page_tokens, d = kv_cache.shape
    s0 = kv_cache.stride(0)
    base = kv_cache.storage_offset()
    size = (num_pages, page_tokens, hk, d)
    k = kv_cache.as_strided(size, (s0, 1, page_tokens * d, page_tokens), base)
    v = kv_cache.as_strided(size, (s0, d, page_tokens * d, 1), base + hk * page_tokens * d)
    return k, v


def write_kv(plan: CpuAttentionPlan, k: Tensor, v: Tensor, kv_cache: Tensor) -> None:
    """Mutates kv_cache: k, v [T, Hk, D] at the step's positions."""
    k_view, v_view = kv_views(kv_cache)
    k_view[plan.page_ids, plan.page_offsets] = k
    v_view[plan.page_ids, plan.page_offsets] = v


def attend(plan: CpuAttentionPlan, q: Tensor, kv_cache: Tensor, scale: float) -> Tensor:
    """q: [T, Hq, D]; kv_cache: the layer's arena slice (see kv_views), already holding this
    step's keys and values -> [T, Hq, D]. Pure."""
    num_tokens, num_q_heads, head_dim = q.shape
    hk = plan.num_kv_heads
    num_pages, page_tokens = kv_cache.shape[0], kv_cache.shape[3]
    page_stride = kv_cache.stride(0)
    chunk = page_tokens * head_dim
    # The layer's slice of the arena as rows, from its first element: rows of page_tokens
    # (K, stored [Hk, D, page_tokens]) and rows of page_tokens * D (V). Rows of other
    # layers lie in between and are never indexed.
    k_rows = kv_cache.as_strided(
        ((num_pages - 1) * page_stride // page_tokens + 2 * hk * head_dim, page_tokens),
        (page_tokens, 1),
    )
    v_rows = kv_cache.as_strided(
        ((num_pages - 1) * page_stride // chunk + 2 * hk, chunk), (chunk, 1)
    )
    out = q.new_empty(num_tokens, num_q_heads, head_dim)
    for g in plan.groups:
        units = g.rows.shape[0]
        nb = g.num_blocks
        # [I, Hk, D, keys] and [I, Hk, NB, KB, D], each one gather of whole rows
        if not g.scratch:
            g.scratch["k"] = k_rows.new_empty(g.k_rows.shape[0], page_tokens)
            g.scratch["v"] = v_rows.new_empty(g.v_rows.shape[0], chunk)
        k = torch.index_select(k_rows, 0, g.k_rows, out=g.scratch["k"])
        v = torch.index_select(v_rows, 0, g.v_rows, out=g.scratch["v"])
        k = k.view(units, hk, head_dim, nb * KEY_BLOCK)
        v = v.view(units, hk, nb, KEY_BLOCK, head_dim)
        _softmax_pv(plan, g, q, k, v, scale, out)
    return out


def write_latent(plan: CpuAttentionPlan, entry: Tensor, cache: Tensor) -> None:
    """Mutates cache ([P, page_tokens, C], a layer's latent pages): entry [T, C] at the
    step's positions."""
    cache[plan.page_ids, plan.page_offsets] = entry


def attend_latent(
    plan: CpuAttentionPlan, q: Tensor, cache: Tensor, scale: float, v_dim: int
) -> Tensor:
    """q: [T, H, C] (queries in the latent space); cache: the layer's latent pages [P,
    page_tokens, C], already holding this step's entries -> [T, H, v_dim]: softmax of
    q . entry over the visible entries, times each entry's first v_dim values. Pure."""
    num_tokens, num_heads, dim = q.shape
    num_pages, page_tokens = cache.shape[:2]
    chunk = page_tokens * dim
    # The layer's pages as rows of page_tokens * C values from its first element; page p is
    # row p * (page stride / chunk) (rows of other layers in between are never indexed).
    per_page = cache.stride(0) // chunk
    rows = cache.as_strided(((num_pages - 1) * per_page + 1, chunk), (chunk, 1))
    out = q.new_empty(num_tokens, num_heads, v_dim)
    for g in plan.groups:
        units = g.rows.shape[0]
        nb = g.num_blocks
        if not g.scratch:
            g.scratch["k"] = rows.new_empty(g.pages.shape[0], chunk)
        pages = torch.index_select(rows, 0, g.pages * per_page, out=g.scratch["k"])
        keys = pages.view(units, nb * KEY_BLOCK, dim)
        k = keys.transpose(1, 2).contiguous().view(units, 1, dim, nb * KEY_BLOCK)
        v = keys[:, :, :v_dim].contiguous().view(units, 1, nb, KEY_BLOCK, v_dim)
        _softmax_pv(plan, g, q, k, v, scale, out)
    return out


def _softmax_pv(
    plan: CpuAttentionPlan, g: _Group, q: Tensor, k: Tensor, v: Tensor, scale: float, out: Tensor
) -> None:
    """One group's rows of ``out``: q [T, Hq, D], k [I, Hk, D, keys], v [I, Hk, NB, KB, Dv]."""
    num_q_heads, head_dim = q.shape[1:]
    hk, rep = plan.num_kv_heads, plan.group_size
    units, r = g.rows.shape
    nb = g.num_blocks
    m = r * rep
    v_dim = v.shape[-1]
    # [I, Hk, M, D] with unit rows ordered (row, query head within the KV group)
    qg = q[g.rows].view(units, r, hk, rep, head_dim).permute(0, 2, 1, 3, 4)
    qg = qg.reshape(units, hk, m, head_dim)
    s = torch.matmul(qg, k)  # [I, Hk, M, NB*KB]
    # Masking by arithmetic: a bool masked_fill/where ran ~15x slower than a multiply
    # here, and exp(-inf) and denormal results take slow paths (12x and 170x measured).
    # Hidden scores become -1e30 (the max stays a visible score, exactly), exponents
    # are clamped to >= -87 (exp stays a normal float) and hidden p are zeroed exactly.
    s.mul_(scale).add_(g.bias)
    s.sub_(s.amax(-1, keepdim=True)).clamp_(min=_MIN_EXPONENT)
    p = s.exp_().mul_(g.visible).view(units, hk, m, nb, KEY_BLOCK)
    denom = _tree_sum(p.sum(-1), 3)  # [I, Hk, M]
    o = _tree_sum(torch.matmul(p.transpose(2, 3), v), 2)  # [I, Hk, M, Dv]
    o = o / denom.unsqueeze(-1)
    o = o.view(units, hk, r, rep, v_dim).permute(0, 2, 1, 3, 4)
    out[g.dst] = o.reshape(units * r, num_q_heads, v_dim)[g.src]


def _tree_sum(x: Tensor, dim: int) -> Tensor:
    """Sum over ``dim`` by halving a zero-padded power-of-two length (see design notes)."""
    n = x.shape[dim]
    width = 1 << (n - 1).bit_length()
    if width != n:
        pad = list(x.shape)
        pad[dim] = width - n
        x = torch.cat([x, x.new_zeros(pad)], dim=dim)
    while width > 1:
        width //= 2
        x = x.narrow(dim, 0, width) + x.narrow(dim, width, width)
    return x.squeeze(dim)
