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
    over a power-of-two count, zero padded (kern.backend.tree_sum): trailing zero blocks fold
    away exactly, so a row gets the bits it would get with only its own blocks, however many
    blocks its batch had.
  The result differs from transformers' eager softmax-then-matmul by float32 rounding only
  (and by exponents below -87 being clamped there: a weight of 1.6e-38 instead of less).
* Speed without new bits (a long prompt's prefill is nearly all attention on the CPU; each
  point below left every output bit as it was, checked against the plain formulation):
  - Scores are made and used one key chunk at a time (``CHUNK_BYTES``, whole blocks), so a
    chunk is still in cache from its matmul to its values matmul: pass one makes a chunk's
    scores and takes its max, the row's max being the max of the chunks' (exact); pass two
    takes each chunk through exp, the block sums and p @ V. A score's bits do not depend on
    how many keys its matmul had (above), nor an exp's or a block's on their neighbours.
  - The bias and the visibility mask are added and multiplied only from a group's first
    block that hides a key (``tail``): before it they are +0 and 1, exact no-ops (a -0.0
    score made +0.0 by the bias gives the same exp).
  - With few (unit, KV head) pairs, the values matmul reads each block's probabilities in
    place, [NB, M, KB] with a row stride of the chunk's keys, one bmm per pair, where a
    [I, Hk, NB, M, KB] copy of every probability cost as much as the matmuls; the strided
    and the copied operand gave the same bits.
  - Those two are for groups of many keys (``LONG_BLOCKS``); a group of few keys goes through
    the same ops in one pass on tensors of its own (fewer calls, for decode steps).
  - The key and value gathers, scores, block sums and per-block outputs go to buffers the
    backend keeps across groups, layers and steps (up to ``SCRATCH_KEEP`` each), and the
    block tree adds in place: fresh multi-MB tensors cost their page faults every time.
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

import torch
from torch import Tensor

from kern.backend.cpu_attention_plan import (
    KEY_BLOCK,
    CpuAttentionPlan,
    UnitGroup,
    plan_attention,
)
from kern.backend.tree_sum import tree_sum_

__all__ = [
    "CpuAttentionPlan",
    "attend",
    "attend_latent",
    "kv_views",
    "plan_attention",
    "write_kv",
    "write_latent",
]

# From this many key blocks a group takes the long path (key chunks, kept buffers); below
# it the one-pass short path costs fewer calls. On the long path the values matmul reads the
# probabilities in place, one bmm per (unit, KV head), if that is at most STRIDED_MATMULS
# calls; otherwise one batched matmul over a copy costs fewer calls.
LONG_BLOCKS = 64
STRIDED_MATMULS = 32
# Scores are made and used a key chunk at a time, about this many bytes, and at least
# MIN_CHUNK_BLOCKS key blocks a chunk (2, 8 and 64 MiB tried on a 32k-token prefill with a
# 1 MiB L2 a core and a 32 MiB L3: 8 MiB the fastest, by a few percent).
CHUNK_BYTES = 1 << 23
MIN_CHUNK_BLOCKS = 16
_MIN_EXPONENT = -87.0  # exp(-87) = 1.6e-38, the smallest exponent with a normal result


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


def attend(
    plan: CpuAttentionPlan,
    q: Tensor,
    kv_cache: Tensor,
    scale: float,
    sinks: Tensor | None = None,
    window: int = 0,
) -> Tensor:
    """q: [T, Hq, D]; kv_cache: the layer's arena slice (see kv_views), already holding this
    step's keys and values -> [T, Hq, D]. ``sinks`` [Hq]: a logit per query head in each
    row's softmax denominator (gpt-oss); ``window`` > 0: a sliding window of that many keys.
    Pure."""
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
    for g in plan.groups_for(window):
        units = g.rows.shape[0]
        nb = g.num_blocks
        # [I, Hk, D, keys] and [I, Hk, NB, KB, D], each one gather of whole rows
        k_out = plan.buffer("k", (g.k_rows.shape[0], page_tokens), k_rows)
        v_out = plan.buffer("v", (g.v_rows.shape[0], chunk), v_rows)
        k = torch.index_select(k_rows, 0, g.k_rows, out=k_out)
        v = torch.index_select(v_rows, 0, g.v_rows, out=v_out)
        k = k.view(units, hk, head_dim, nb * KEY_BLOCK)
        v = v.view(units, hk, nb, KEY_BLOCK, head_dim)
        _softmax_pv(plan, g, q, k, v, scale, out, sinks)
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
        gathered = plan.buffer("k", (g.pages.shape[0], chunk), rows)
        pages = torch.index_select(rows, 0, g.pages * per_page, out=gathered)
        keys = pages.view(units, nb * KEY_BLOCK, dim)
        k = keys.transpose(1, 2).contiguous().view(units, 1, dim, nb * KEY_BLOCK)
        v = keys[:, :, :v_dim].contiguous().view(units, 1, nb, KEY_BLOCK, v_dim)
        _softmax_pv(plan, g, q, k, v, scale, out)
    return out


def _softmax_pv(
    plan: CpuAttentionPlan,
    g: UnitGroup,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    out: Tensor,
    sinks: Tensor | None = None,
) -> None:
    """One group's rows of ``out``: q [T, Hq, D], k [I, Hk, D, keys], v [I, Hk, NB, KB, Dv];
    ``sinks`` [Hq] or None."""
    num_q_heads, head_dim = q.shape[1:]
    hk, rep = plan.num_kv_heads, plan.group_size
    units, r = g.rows.shape
    m = r * rep
    v_dim = v.shape[-1]
    # [I, Hk, M, D] with unit rows ordered (row, query head within the KV group)
    qg = q[g.rows].view(units, r, hk, rep, head_dim).permute(0, 2, 1, 3, 4)
    qg = qg.reshape(units, hk, m, head_dim)
    # Masking by arithmetic: a bool masked_fill/where ran ~15x slower than a multiply
    # here, and exp(-inf) and denormal results take slow paths (12x and 170x measured).
    # Hidden scores become -1e30 (the max stays a visible score, exactly), exponents
    # are clamped to >= -87 (exp stays a normal float) and hidden p are zeroed exactly.
    # Each unit row's sink logit, [1, Hk, M, 1] in the rows' (row, head in group) order.
    sink = None
    if sinks is not None:
        sink = sinks.view(1, hk, 1, rep).expand(1, hk, r, rep).reshape(1, hk, m, 1)
    if g.num_blocks < LONG_BLOCKS:
        o = _short(g, qg, k, v, scale, sink)
    else:
        o = _long(plan, g, qg, k, v, scale, sink)
    o = o.view(units, hk, r, rep, v_dim).permute(0, 2, 1, 3, 4)
    out[g.dst] = o.reshape(units * r, num_q_heads, v_dim)[g.src]


def _short(
    g: UnitGroup, qg: Tensor, k: Tensor, v: Tensor, scale: float, sink: Tensor | None
) -> Tensor:
    """A group of few keys in one pass, on tensors of its own -> [I, Hk, M, Dv]."""
    units, hk, m, _ = qg.shape
    tail = g.tail * KEY_BLOCK
    s = torch.matmul(qg, k)
    s.mul_(scale)
    s[..., tail:].add_(g.bias)
    peak = _with_sink(s.amax(-1, keepdim=True), sink)
    s.sub_(peak).clamp_(min=_MIN_EXPONENT).exp_()
    s[..., tail:].mul_(g.visible)
    p = s.view(units, hk, m, g.num_blocks, KEY_BLOCK)
    denom = _sink_denominator(tree_sum_(p.sum(-1), 3), peak, sink)
    return tree_sum_(torch.matmul(p.transpose(2, 3), v), 2) / denom.unsqueeze(-1)


def _with_sink(peak: Tensor, sink: Tensor | None) -> Tensor:
    """A row's softmax max over its scores and its sink logit (exact, in any order)."""
    return peak if sink is None else torch.maximum(peak, sink)


def _sink_denominator(denom: Tensor, peak: Tensor, sink: Tensor | None) -> Tensor:
    """[I, Hk, M] sums of the visible keys' weights, plus the sink's exp(sink - max)."""
    return denom if sink is None else denom + (sink - peak).exp_().squeeze(-1)


def _long(
    plan: CpuAttentionPlan,
    g: UnitGroup,
    qg: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    sink: Tensor | None,
) -> Tensor:
    """A group of many keys a key chunk at a time, in the backend's buffers (see the design
    notes) -> [I, Hk, M, Dv]."""
    units, hk, m, _ = qg.shape
    nb, rows = g.num_blocks, units * hk * m
    chunks = _key_chunks(rows, nb)
    scores = plan.buffer("s", (rows * nb * KEY_BLOCK,), qg)
    tail = g.tail * KEY_BLOCK
    views, peak = [], None
    for c0, c1 in chunks:
        s = scores[rows * c0 : rows * c1].view(units, hk, m, c1 - c0)
        torch.matmul(qg, k[..., c0:c1], out=s)
        s.mul_(scale)
        if c1 > tail:
            a = max(tail, c0)
            s[..., a - c0 :].add_(g.bias[..., a - tail : c1 - tail])
        top = s.amax(-1, keepdim=True)
        peak = top if peak is None else torch.maximum(peak, top, out=peak)
        views.append(s)
    peak = _with_sink(peak, sink)
    sums = plan.buffer("sums", (units, hk, m, nb), qg)
    blocks = plan.buffer("pv", (units, hk, nb, m, v.shape[-1]), qg)
    strided = units * hk <= STRIDED_MATMULS
    for (c0, c1), s in zip(chunks, views, strict=True):
        s.sub_(peak).clamp_(min=_MIN_EXPONENT).exp_()
        if c1 > tail:
            a = max(tail, c0)
            s[..., a - c0 :].mul_(g.visible[..., a - tail : c1 - tail])
        b0, b1 = c0 // KEY_BLOCK, c1 // KEY_BLOCK
        p = s.view(units, hk, m, b1 - b0, KEY_BLOCK)
        torch.sum(p, -1, out=sums[..., b0:b1])
        if strided:
            for i in range(units):
                for h in range(hk):
                    torch.bmm(p[i, h].transpose(0, 1), v[i, h, b0:b1], out=blocks[i, h, b0:b1])
        else:
            blocks[:, :, b0:b1] = torch.matmul(p.transpose(2, 3), v[:, :, b0:b1])
    denom = _sink_denominator(tree_sum_(sums, 3), peak, sink)
    return tree_sum_(blocks, 2) / denom.unsqueeze(-1)


def _key_chunks(rows: int, num_blocks: int) -> list[tuple[int, int]]:
    """[start, end) key ranges of whole blocks whose scores, ``rows`` a key, fill about
    CHUNK_BYTES: a chunk's scores stay in cache from the matmul to the values matmul."""
    per_chunk = max(CHUNK_BYTES // (4 * rows * KEY_BLOCK), MIN_CHUNK_BLOCKS)
    return [
        (b * KEY_BLOCK, min(b + per_chunk, num_blocks) * KEY_BLOCK)
        for b in range(0, num_blocks, per_chunk)
    ]
