"""Which query rows meet which keys in one CPU attention step: the plan every attention layer
of a forward shares (units, groups, masks, gathers), and the buffers its groups reuse. The
batch-invariance rules it serves are kern.backend.cpu_attention's design notes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import Tensor

from kern.arith import cdiv

__all__ = ["KEY_BLOCK", "CpuAttentionPlan", "UnitGroup", "plan_attention"]

KEY_BLOCK = 32  # keys per block, in absolute positions of a sequence
Q_TILE = 64  # query rows per unit when a sequence brings more than SMALL_ROWS rows
SMALL_ROWS = 8  # sequences with at most this many rows (decode, verify) share one unit group
# Matmul rows per (unit, KV head) at least: fewer take other kernels (see the notes).
MIN_ROWS = 4
# Elements of a group's largest intermediate (about units x KV heads x blocks x rows x
# max(KEY_BLOCK, head_dim)) before prefill tiles go to another group: 8M floats, 32 MB.
GROUP_BUDGET = 1 << 23
# Bytes of one scratch buffer a backend keeps between steps at most (a larger one, a
# decode batch of long contexts, is allocated for its step only, as before).
SCRATCH_KEEP = 1 << 26
_HIDDEN = -1e30  # added to a hidden key's score: below any real score, and finite


@dataclass(frozen=True, slots=True)
class UnitGroup:
    """Units (sequence, query tile) that go through the same batched ops."""

    rows: Tensor  # [I, R] int64: row of q for each unit row (padding repeats the last row)
    k_rows: Tensor  # [I * Hk * D * NP]: rows of page_tokens keys (see attend), in order
    v_rows: Tensor  # [I * Hk * NP]: rows of page_tokens * D values
    tail: int  # first key block that hides a key from some row (masks start there)
    bias: Tensor  # [I, 1, R * n_rep, (NB - tail) * KEY_BLOCK]: 0 where visible, -1e30 not
    visible: Tensor  # same shape, float: 1 where visible, 0 where not
    src: Tensor  # [n] int64: which of the I * R unit rows are real
    dst: Tensor  # [n] int64: the q row each real unit row is
    pages: Tensor  # [I * NP] int64: each unit's pages, in order (latent pages' rows)
    num_blocks: int
    q_pos: Tensor  # [I, R] int64: each unit row's position (a windowed layer's masks)


@dataclass(frozen=True, slots=True)
class CpuAttentionPlan:
    """Index tensors for one forward, shared by every attention layer."""

    groups: tuple[UnitGroup, ...]
    num_kv_heads: int
    group_size: int  # query heads per KV head
    page_ids: Tensor  # [T] int64: where this step's K/V go
    page_offsets: Tensor  # [T] int64
    # Gathers, scores, block sums and block outputs: buffers reused by every group and layer,
    # and by later steps when the backend hands the plan its own dict (see the design notes).
    scratch: dict = field(default_factory=dict)
    # Window -> the groups with that sliding window's masks, made by the first layer that asks.
    windowed: dict = field(default_factory=dict)
    # A plan made for one sliding window (plan_attention's ``window``): its groups read only
    # the pages that window reaches, so only layers with that window may use it.
    window: int = 0

    def groups_for(self, window: int) -> tuple[UnitGroup, ...]:
        """The groups as a layer with a sliding ``window`` (0: none) sees them: a row at
        position p sees keys p - window + 1 .. p, the earlier ones masked like later ones."""
        if window == self.window:
            return self.groups
        if self.window:
            raise ValueError(
                f"a plan for a sliding window of {self.window} keys read by a layer with "
                f"window {window}"
            )
        kept = self.windowed.get(window)
        if kept is None:
            kept = self.windowed[window] = tuple(
                _windowed(g, window, self.group_size) for g in self.groups
            )
        return kept

    def buffer(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """A contiguous ``shape`` view of the ``name`` buffer (contents undefined). One
        over ``SCRATCH_KEEP`` bytes is allocated for this use only, not kept."""
        numel = math.prod(shape)
        if numel * like.element_size() > SCRATCH_KEEP:
            return like.new_empty(shape)
        buf = self.scratch.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype:
            buf = self.scratch[name] = like.new_empty(numel)
        return buf[:numel].view(shape)


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
    scratch: dict | None = None,
    *,
    window: int = 0,
) -> CpuAttentionPlan:
    """block_tables: [B, max_pages] int64 (padding entries are never read); page_stride:
    elements from one page to the next in the arena; page_ids and page_offsets [T]: where
    this step's rows write their K/V. page_tokens must be a power of two (so that pages and
    key blocks tile each other). ``scratch``: a dict the caller keeps for its buffers across
    steps (one forward at a time may use it); None: buffers for this plan only.
    ``window`` > 0: a plan for layers whose rows see only their last ``window`` keys; a unit
    then reads from its window's start (aligned as :func:`_origins` says, so the bits are
    those of a read from position 0), and table entries before that may be -1.

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
        window,
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
    return CpuAttentionPlan(
        tuple(groups),
        num_kv_heads,
        group_size,
        page_ids,
        page_offsets,
        {} if scratch is None else scratch,
        window=window,
    )


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
    window=0,
) -> UnitGroup:
    # Index arithmetic in numpy: a small array op costs about a microsecond there and several
    # in torch, and a decode step builds a plan of a few dozen of them.
    hk, d, page_stride = layout
    if len(units) * hk < 2:
        units = [*units, *units]  # a batch of one matmul takes the plain gemm (see notes)
    r = max(max(n for _, _, n in units), min_unit_rows)
    u = np.array(units, dtype=np.int64).reshape(-1, 3)
    seq, t0, n = u[:, 0], u[:, 1], u[:, 2]
    q_start = np.asarray(q_starts, dtype=np.int64)[seq]
    ctx = np.asarray(ctx_lens, dtype=np.int64)[seq]
    first_pos = ctx - np.asarray(q_lens, dtype=np.int64)[seq] + t0  # each unit's first row
    local = np.minimum(np.arange(r)[None, :], (n - 1)[:, None])  # [I, R]
    rows = q_start[:, None] + t0[:, None] + local
    q_pos = first_pos[:, None] + local
    last_pos = first_pos + n - 1
    origin = _origins(first_pos, window, page_tokens)  # [I]: each unit's first key position
    num_keys = (int((last_pos - origin).max()) // KEY_BLOCK + 1) * KEY_BLOCK
    # Whole pages are read; with pages longer than a key block the extra keys are masked
    # blocks, which add exact zeros (so the bits do not depend on page_tokens).
    num_pages = cdiv(num_keys, page_tokens)
    num_blocks = num_pages * page_tokens // KEY_BLOCK
    # Pages past a unit's context repeat its last page (any real page would do: masked).
    last_page = ((ctx - 1) // page_tokens)[:, None]
    page_idx = np.minimum((origin // page_tokens)[:, None] + np.arange(num_pages), last_page)
    table = block_tables.numpy()[seq]
    pages = np.take_along_axis(table, page_idx, 1)  # [I, NP]
    if window:
        # Pages before a unit's window (-1: given back) are read as its last page, masked.
        pages = np.where(pages < 0, np.take_along_axis(table, last_page, 1), pages)
    # K: row (page, head, dim) of page_tokens keys; V: chunk (page, head) of page_tokens rows
    # of D values, after the K half of the page (see kv_views).
    k_rows = pages[:, None, None, :] * (page_stride // page_tokens) + np.arange(hk * d).reshape(
        1, hk, d, 1
    )
    v_rows = (
        pages[:, None, :] * (page_stride // (page_tokens * d)) + hk + np.arange(hk)[None, :, None]
    )
    if window:
        k_pos = origin[:, None, None] + np.arange(num_blocks * KEY_BLOCK)  # [I, 1, keys]
        q = q_pos[:, :, None]
        hidden = (k_pos > q) | (k_pos <= q - window)
        tail = 0
    else:
        tail = _tail_block(int(first_pos.min()), num_blocks)
        k_pos = np.arange(tail * KEY_BLOCK, num_blocks * KEY_BLOCK)
        hidden = k_pos[None, None, :] > q_pos[:, :, None]  # [I, R, (NB - tail) * KB]
    hidden = np.repeat(hidden, group_size, axis=1)[:, None]  # [I, 1, M, ...]
    visible = (~hidden).astype(np.float32)
    bias = hidden.astype(np.float32) * np.float32(_HIDDEN)
    src = np.flatnonzero(np.arange(r)[None, :] < n[:, None])
    dst = rows.reshape(-1)[src]
    return UnitGroup(
        _tensor(rows),
        _tensor(k_rows.reshape(-1)),
        _tensor(v_rows.reshape(-1)),
        tail,
        _tensor(bias),
        _tensor(visible),
        _tensor(src),
        _tensor(dst),
        _tensor(pages.reshape(-1)),
        num_blocks,
        _tensor(q_pos),
    )


def _tensor(a: np.ndarray) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def _origins(first_pos: np.ndarray, window: int, page_tokens: int) -> np.ndarray:
    """Each unit's first key position: 0 without a window; with one, its first row's window
    start rounded down to a multiple of ``align`` = 2 * max(window rounded up to a power of
    two, page_tokens, KEY_BLOCK), a whole number of pages. The blocks' tree sum pairs blocks
    by the low bits of their index (kern.backend.tree_sum), and a row's visible blocks span at
    most align / (2 KEY_BLOCK) + 1 <= align / KEY_BLOCK of them, so an origin at a multiple of
    align leaves every row's pairing, and so its bits, as a read from position 0 would."""
    if not window:
        return np.zeros_like(first_pos)
    align = 2 * max(1 << (window - 1).bit_length(), page_tokens, KEY_BLOCK)
    return np.maximum(first_pos - window + 1, 0) // align * align


def _windowed(g: UnitGroup, window: int, group_size: int) -> UnitGroup:
    """``g`` with a sliding window's masks; the masks then start at block 0 once some row
    is past its first ``window`` keys."""
    if int(g.q_pos.max()) < window:
        return g
    k_pos = np.arange(g.num_blocks * KEY_BLOCK)
    q_pos = g.q_pos.numpy()[:, :, None]
    hidden = (k_pos[None, None, :] > q_pos) | (k_pos[None, None, :] <= q_pos - window)
    hidden = np.repeat(hidden, group_size, axis=1)[:, None]
    bias = _tensor(hidden.astype(np.float32) * np.float32(_HIDDEN))
    return replace(g, tail=0, bias=bias, visible=_tensor((~hidden).astype(np.float32)))


def _tail_block(first_pos: int, num_blocks: int) -> int:
    """The first key block that hides a key from a row at ``first_pos`` or later: every key
    up to the earliest row's position is visible to every row."""
    return min(first_pos + 1, num_blocks * KEY_BLOCK) // KEY_BLOCK
