"""DeepSeek-V4's attention over compressed pages (``kern.models.deepseek_v4.pages``): the
sliding window, the compressors' pooling, the lightning indexer's top-k and the attention
with sinks over window and compressed entries, in torch ops on any device.

Design notes
------------
* A row's bits depend on its own tokens only (not on the batch, the chunking, or where a
  prefix hit ended), as for kern's other CPU paths:
  - Dot products are an elementwise product and a sum over the last, fixed-length dim (D,
    index_head_dim or the indexer's heads), never a matmul whose blocking follows the
    batch.
  - Sums over keys are ``tree_sum`` over a zero-padded power-of-two length: a row's keys
    come first, hidden slots and padding add exact zeros, so a longer batch row changes
    nothing. The softmax max is exact in any order.
  - The compressors pool online (``kern.kernels.compressor_pool``): tokens enter a window's
    accumulator one at a time in position order, so an entry's bits do not depend on the
    chunk that closed it. This differs from transformers' softmax-then-sum by float32
    rounding only.
  - Top-k (``kern.kernels.index_topk``) sorts unique keys packing the score above the
    slot: equal scores keep the lower entry first, in prefill, decode and any batch, so
    every path selects the same entries.
* The kernels run through ``ops`` (``compressor_pool``, ``index_topk``,
  ``sparse_attention``): the CPU backend takes their torch references, the CUDA backend
  their Triton versions, reading keys by row from a table over the whole arena
  (:func:`key_rows`).
* Costs: the products are [rows, heads, keys, D] tensors, taken in tiles of rows under
  ``_TILE_ELEMENTS``; a Triton kernel for long contexts is the GPU's part.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from kern.backend.tree_sum import tree_sum
from kern.batch import Step
from kern.kernels.compressor_pool.reference import empty

__all__ = [
    "CompressedPlan",
    "attend",
    "index_topk",
    "key_rows",
    "plan",
    "pool",
    "rewind",
    "rope",
    "rope_tables",
]


@dataclass(slots=True)
class RatePlan:
    """Rows against the windows of one compression rate ``m``."""

    num_windows: int  # windows the step's rows fall in, numbered across the batch
    first: Tensor  # [B'] window id of each resumed sequence's first window
    first_from: Tensor  # [B'] the window page holding that sequence's previous token
    prev_of: Tensor  # [G] the same sequence's previous window id, or -1
    starts: Tensor  # [G] each window's first row (a window's rows are one run)
    lens: Tensor  # [G] and its number of rows in the step
    closing: Tensor  # rows that close their window
    entry_page: Tensor  # [len(closing)] page and slot of the entry they close
    entry_slot: Tensor
    visible_pages: Tensor  # [R, N] entries a row may see: (p + 1) // m of them
    visible_slots: Tensor
    visible: Tensor  # [R, N] bool


@dataclass(slots=True)
class CompressedPlan:
    """A step's indices for every V4 layer (built once by :func:`plan`)."""

    page_tokens: int
    positions: Tensor  # [R]
    row_window: Tensor  # [R] window page and offset of each row's own position
    row_offset: Tensor
    window_pages: Tensor  # [R, W] the row's window, oldest first
    window_offsets: Tensor
    window_valid: Tensor  # [R, W] bool
    state_rows: Tensor  # rows after which their window page's accumulators are written
    rates: dict[int, RatePlan] = field(default_factory=dict)
    keep: Tensor | None = None  # rows whose accumulators are kept for a rewind
    # (a layer's accumulator view, the kept rows' accumulators after them), by pool()
    kept: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    # RoPE tables by (rope set, rate): the same for every layer of a step, made once
    tables: dict[tuple[int, int], tuple[Tensor, Tensor]] = field(default_factory=dict)

    def rope_at(self, which: int, rope: tuple[Tensor, float], rate: int = 0):
        """cos and sin of rope set ``which`` at the rows' positions (``rate`` 0) or at the
        first positions of the windows of ``rate`` the rows close."""
        key = (which, rate)
        if key not in self.tables:
            at = self.positions
            if rate:
                at = at[self.rates[rate].closing] - (rate - 1)
            self.tables[key] = rope_tables(at, *rope)
        return self.tables[key]


def plan(
    step: Step,
    page_tokens: int,
    window: int,
    rates: tuple[int, ...],
    windows: Tensor,
    bases: list[int],
    keep: list[int] | None = None,
) -> CompressedPlan:
    """The indices of ``step`` for pages of ``page_tokens``, window pages of ``window``
    positions (each sequence's ``windows`` [B, J], from its page ``bases[b]`` on) and the
    compression ``rates`` its layers use; the accumulators after rows ``keep`` are kept for
    :func:`rewind`."""
    dev = step.positions.device
    pt, w = page_tokens, window
    pos = step.positions.cpu()
    lens = torch.tensor(step.q_lens)
    seq = torch.repeat_interleave(torch.arange(len(step.q_lens)), lens)
    tables = step.block_tables.cpu()
    base = torch.tensor(bases, dtype=torch.long)
    row_window = windows[seq, pos // w - base[seq]]
    back = torch.arange(w - 1, -1, -1)
    wpos = pos[:, None] - back[None, :]
    valid = wpos >= 0
    wpos = wpos.clamp(min=0)
    # Rows whose window reaches before 0 read (masked) the sequence's first window page.
    wpage = (wpos // w - base[seq][:, None]).clamp(min=0)
    starts = torch.tensor([ctx - n for ctx, n in zip(step.ctx_lens, step.q_lens, strict=True)])
    last = torch.zeros(len(pos), dtype=torch.bool)
    ends = torch.tensor(step.q_starts) + lens - 1
    last[ends] = True
    state_rows = torch.nonzero(last | (pos % w == w - 1)).flatten()
    p = CompressedPlan(
        pt,
        step.positions,
        row_window.to(dev),
        (pos % w).to(dev),
        windows[seq[:, None], wpage].to(dev),
        (wpos % w).to(dev),
        valid.to(dev),
        state_rows.to(dev),
    )
    if keep:
        p.keep = torch.tensor(keep, device=dev)
    first_row = torch.tensor(step.q_starts)
    resumed = torch.nonzero(starts > 0).flatten()
    first_from = windows[resumed, (starts[resumed] - 1) // w - base[resumed]]
    for m in sorted(set(rates)):
        p.rates[m] = _rate_plan(m, pt, pos, seq, tables, first_row, resumed, first_from, dev)
    return p


def _rate_plan(m, pt, pos, seq, tables, first_row, resumed, first_from, dev) -> RatePlan:
    j = pos % m
    opens = j == 0
    opens[first_row] = True
    gid = torch.cumsum(opens.long(), 0) - 1
    num_windows = int(gid[-1]) + 1 if len(gid) else 0
    prev_of = gid[opens] - 1
    prev_of[gid[first_row]] = -1
    first = gid[first_row[resumed]]
    starts = torch.nonzero(opens).flatten()
    lens = torch.diff(starts, append=torch.tensor([len(pos)]))
    closing = torch.nonzero(j == m - 1).flatten()
    cpos = pos[closing]
    entry_page = tables[seq[closing], cpos // pt]
    entry_slot = (cpos % pt) // m
    count = (pos + 1) // m
    n = int(count.max()) if len(count) else 0
    w = torch.arange(n)
    last_token = (w * m + m - 1)[None, :].expand(len(pos), n)
    visible = w[None, :] < count[:, None]
    last_token = torch.where(visible, last_token, 0)
    return RatePlan(
        num_windows,
        first.to(dev),
        first_from.to(dev),
        prev_of.to(dev),
        starts.to(dev),
        lens.to(dev),
        closing.to(dev),
        entry_page.to(dev),
        entry_slot.to(dev),
        tables[seq[:, None], last_token // pt].to(dev),
        ((last_token % pt) // m).to(dev),
        visible.to(dev),
    )


def rope_tables(positions: Tensor, inv_freq: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """cos and sin [n, rope_dim / 2] at ``positions``, times ``scale`` (YaRN's factor)."""
    freqs = positions[:, None].float() * inv_freq.to(positions.device)
    cos, sin = freqs.cos(), freqs.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos, sin


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """V4's interleaved RoPE on the trailing ``2 * cos.shape[-1]`` dims of x [n, ..., D]
    (pairs (2i, 2i + 1) turned by angle i), in float32; pass ``-sin`` to turn back."""
    half = cos.shape[-1]
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    head = x[..., : x.shape[-1] - 2 * half]
    pairs = x[..., x.shape[-1] - 2 * half :].float()
    even, odd = pairs[..., 0::2], pairs[..., 1::2]
    turned = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
    return torch.cat([head, turned.flatten(-2).to(x.dtype)], dim=-1)


def pool(
    ops, p: CompressedPlan, m: int, kv: Tensor, gate: Tensor, state: Tensor, pair: bool
) -> Tensor:
    """Feed the step's rows into their windows' poolings (``ops.compressor_pool``) and return
    the pooled values [len(closing), dim] of the windows they close (before the norm and
    RoPE). ``kv`` and ``gate`` (position bias added) are [R, 2 * dim] (``pair``: CSA's
    Ca | Cb) or [R, dim]. Reads the accumulators of each resumed sequence from ``state``
    [S, A, 3, dim] (window pages) and writes them after every window page end and chunk
    end."""
    rp = p.rates[m]
    kv, gate = kv.float(), gate.float()
    dim = kv.shape[1] // 2 if pair else kv.shape[1]
    dev = kv.device
    init = empty(rp.num_windows, dim, dev)  # the entry each window closes
    if len(rp.first):
        init[rp.first] = state[rp.first_from, 0]
    nxt_hist = None
    if pair:
        # Ca (first half) of a window opens the next window's entry: pooled first, so the
        # entry of window w takes its Ca tokens before its own Cb tokens.
        nxt = empty(rp.num_windows, dim, dev)
        if len(rp.first):
            nxt[rp.first] = state[rp.first_from, 1]
        nxt_hist = ops.compressor_pool(kv[:, :dim], gate[:, :dim], rp.starts, rp.lens, nxt)
        later = torch.nonzero(rp.prev_of >= 0).flatten()
        prev = rp.prev_of[later]
        init[later] = nxt_hist[rp.starts[prev] + rp.lens[prev] - 1]
        kv, gate = kv[:, dim:], gate[:, dim:]
    hist = ops.compressor_pool(kv, gate, rp.starts, rp.lens, init)
    closed = hist[rp.closing]
    pooled = closed[:, 2] / closed[:, 1]
    # After a window closes: CSA's entry of the next window is its Ca so far, HCA is empty.
    if nxt_hist is not None:
        hist[rp.closing] = nxt_hist[rp.closing]
        nxt_hist[rp.closing] = empty(len(rp.closing), dim, dev)
        after = torch.stack([hist, nxt_hist], dim=1)
    else:
        hist[rp.closing] = empty(len(rp.closing), dim, dev)
        after = hist[:, None]
    w = p.state_rows
    state[p.row_window[w]] = after[w]
    if p.keep is not None:
        p.kept.append((state, after[p.keep]))
    return pooled


def rewind(p: CompressedPlan, row: int, page: int) -> None:
    """Write the accumulators every layer had after kept row ``row`` (an index into the
    plan's ``keep``) into window page ``page``: the state a verify's last accepted row
    leaves."""
    for state, kept in p.kept:
        state[page] = kept[row]


def write_entries(p: CompressedPlan, m: int, entries: Tensor, view: Tensor) -> None:
    """Store the entries the step's rows closed (``pool``'s order) in their pages."""
    rp = p.rates[m]
    view[rp.entry_page, rp.entry_slot] = entries.to(view.dtype)


def index_topk(
    ops, p: CompressedPlan, m: int, q: Tensor, weights: Tensor, keys: Tensor, k: int, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """The lightning indexer (``ops.index_topk``): for each row, the ``k`` visible entries
    with the highest ``sum_h weights[h] * relu(q_h . key) * scale`` (ties: the lower entry),
    as (pages, slots, valid) [R, k]."""
    rp = p.rates[m]
    rows = q.shape[0]
    if rp.visible.shape[1] == 0:
        z = torch.zeros(rows, k, dtype=torch.long, device=q.device)
        return z, z, torch.zeros(rows, k, dtype=torch.bool, device=q.device)
    table = _table(keys)
    chosen, ok = ops.index_topk(
        q, weights, table, _rows_of(keys, rp.visible_pages, rp.visible_slots), rp.visible, k, scale
    )
    return rp.visible_pages.gather(1, chosen), rp.visible_slots.gather(1, chosen), ok


def attend(
    p: CompressedPlan,
    q: Tensor,
    window: Tensor,
    extra: Tensor | None,
    extra_valid: Tensor | None,
    sinks: Tensor,
    scale: float,
) -> Tensor:
    """Each row's heads q [R, H, D] over its window's entries and ``extra`` [R, N, D]
    (compressed entries, ``extra_valid`` [R, N]), K = V, with a per-head sink logit in the
    softmax's denominator -> [R, H, D] in q's dtype."""
    out = torch.empty_like(q)
    num_keys = p.window_pages.shape[1] + (0 if extra is None else extra.shape[1])
    sinks = sinks.float()[None, :]
    for a, b in _tiles(q.shape[0], q.shape[1] * num_keys * q.shape[2]):
        keys = window[p.window_pages[a:b], p.window_offsets[a:b]].float()  # [r, W, D]
        valid = p.window_valid[a:b]
        if extra is not None and extra.shape[1]:
            assert extra_valid is not None
            keys = torch.cat([keys, extra[a:b].float()], dim=1)
            valid = torch.cat([valid, extra_valid[a:b]], dim=1)
        # Hidden keys read whatever their slot holds (a chunk's bytes change class: a pooling
        # state's -inf may sit there): zero, so that their exact-zero weights stay zeros.
        keys = torch.where(valid[..., None], keys, 0.0)
        s = (q[a:b].float()[:, :, None, :] * keys[:, None, :, :]).sum(-1) * scale  # [r, H, J]
        s = s.masked_fill(~valid[:, None, :], float("-inf"))
        top = torch.maximum(s.amax(-1), sinks)  # [r, H]
        e = torch.exp(s - top[..., None])
        denom = tree_sum(e, 2) + torch.exp(sinks - top)
        o = tree_sum(e[..., None] * keys[:, None, :, :], 2) / denom[..., None]
        out[a:b] = o.to(q.dtype)
    return out


def key_rows(
    p: CompressedPlan,
    window: Tensor,
    entries: Tensor | None,
    pages: Tensor | None,
    slots: Tensor | None,
    extra_valid: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """For a kernel that reads keys by row (``kern.kernels.sparse_attention``): a table over
    the whole arena whose row ``i`` is the ``head_dim`` values from element ``i`` on (rows
    overlap: any part of any page is a row, with no alignment asked of the layout), each
    query row's key rows (its window, then ``entries[pages, slots]``) and their validity."""

    rows = _rows_of(window, p.window_pages, p.window_offsets)
    valid = p.window_valid
    if pages is not None and pages.shape[1]:
        assert entries is not None and slots is not None and extra_valid is not None
        rows = torch.cat([rows, _rows_of(entries, pages, slots)], dim=1)
        valid = torch.cat([valid, extra_valid], dim=1)
    return _table(window), rows, valid


def _table(view: Tensor) -> Tensor:
    """A [P, S, D] page view's whole arena as overlapping rows: row ``i`` is the D values
    from element ``i`` on."""
    dim = view.shape[-1]
    n = view.untyped_storage().nbytes() // view.element_size() - dim + 1
    return view.as_strided((n, dim), (1, 1), 0)


def _rows_of(view: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """The table rows of ``view[a, b]``."""
    return view.storage_offset() + a * view.stride(0) + b * view.stride(1)


# Elements of a tile's largest product ([rows, heads, keys, dim]): 16M floats, 64 MB.
_TILE_ELEMENTS = 1 << 24


def _tiles(rows: int, per_row: int) -> list[tuple[int, int]]:
    """Row ranges whose products stay under ``_TILE_ELEMENTS`` (a row's bits do not depend
    on its tile: every op is per row)."""
    step = max(1, _TILE_ELEMENTS // max(1, per_row))
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]
