"""DeepSeek-V4's page kind (``compressed``): what one page and one window page hold, in
bytes, the per-layer views of those bytes the model reads and writes, and the rules that follow
(``kern.models.pages``): snapshots where a hit may resume, and what a verify's rewind restores.

Design notes
------------
* Two object classes, so that a million-token sequence costs its compressed entries plus one
  window, not every token's window entry:
  - A **page** (``page_tokens`` positions, the pool's pages, kept whole by the prefix tree)
    holds per layer only what its positions wrote and nothing a later token changes: a CSA
    layer (compression ``m``, ``page_tokens % m == 0``) the ``page_tokens / m`` compressed
    entries whose windows lie in the page and their indexer keys (``[page_tokens / m,
    index_head_dim]``); an HCA layer (``m % page_tokens == 0`` or ``page_tokens % m == 0``)
    the entries whose windows end in the page (at least one slot).
  - A **window page** (``sliding_window`` positions, the pool's slots) holds per layer the
    sliding window's entry of each of its positions (``[window, head_dim]``; K = V), the
    pooling accumulators after the page's last written token (CSA: the compressor's and the
    indexer's compressor's, two each; HCA: one) and a 16-byte header with that token's
    position. A running sequence reads the accumulators of the window page holding its
    previous token and writes them at every window page end and at the end of each chunk.
* A query at ``p`` reads the window ``[p - window + 1, p]``: two window pages at most. A
  running sequence holds those (``kern.engine.memory``) and gives older ones back as it goes.
  A **snapshot** at ``end`` is one window page holding the window before ``end`` at offsets
  ``position % window`` and the state after ``end - 1`` (:meth:`CompressedViews.snapshot`:
  the page of ``end - 1`` with the previous page's later offsets folded in). A resumed
  sequence gets a copy in each page its window reaches (:meth:`CompressedViews.restore`):
  offset ``o`` of page ``j`` stands for position ``j * window + o``, and where that is not the
  snapshot's position it is one the sequence never reads again (before the window) or writes
  before reading (at or after ``end``). So a hit is exact exactly where a snapshot sits: the
  tree keeps compressed pages whole and snapshots only where a hit may resume.
* An accumulator is a windowed softmax pooling kept online, float32 whatever the model's
  dtype: (running max, sum of weights, weighted sum), ``[3, dim]``. Tokens enter it one at a
  time, in position order, so its bits depend only on the tokens (not on chunking, batching
  or where a hit ended). CSA keeps two: the entry of the current window (which started with
  the previous window's first half, ``Ca``) and the next window's ``Ca`` so far.
* Bytes per token, per layer (page): CSA ``(head_dim + index_head_dim) / m``, HCA
  ``head_dim / m`` (at least one entry a page), in the model's dtype. Per window page, per
  layer: ``window * head_dim`` values and the accumulators, CSA ``4 * 3 * 2 * (head_dim +
  index_head_dim)`` bytes, HCA ``4 * 3 * head_dim``.
* A verify chunk's rows each leave a pooling state; the plan keeps them (``keep`` rows), and
  :meth:`CompressedViews.rewind` puts back the state of the last row kept, in the window page
  of that row. Rejected rows' window entries and closed entries are rewritten before anything
  reads them, and the window pages a round may reach are given back only once it settles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from kern.arith import cdiv
from kern.batch import Step
from kern.chunk import SeqChunk
from kern.models.config import ModelConfig
from kern.models.deepseek_v4 import attention as ca
from kern.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Fields
from kern.models.pages import PageKind, Pages
from kern.models.window import shadow_window, window_span

__all__ = ["CompressedPages", "CompressedViews", "LayerParts", "LayerViews"]

_ALIGN = 16


@dataclass(frozen=True, slots=True)
class LayerParts:
    """Byte offsets of one layer's parts inside a page (``entries``, ``keys``) and inside a
    window page (``window``, ``state``, ``index_state``); -1: the layer has no such part."""

    kind: str
    rate: int  # source tokens per compressed entry (0: sliding only)
    slots: int  # compressed entries per page
    entries: int
    keys: int
    window: int
    state: int  # float32 [accumulators, 3, head_dim]
    index_state: int  # float32 [2, 3, index_head_dim]


@dataclass(slots=True)
class LayerViews:
    """One layer's parts across all pages: ``entries`` [P, slots, D] and ``keys`` [P, slots,
    Di]; and across all window pages: ``window`` [S, window, D], ``state`` [S, A, 3, D] and
    ``index_state`` [S, 2, 3, Di] (float32); None where the layer has no such part."""

    parts: LayerParts
    window: Tensor
    entries: Tensor | None
    keys: Tensor | None
    state: Tensor | None
    index_state: Tensor | None


class _Offsets:
    """Byte offsets handed out in order, each part aligned to ``_ALIGN``."""

    def __init__(self, start: int) -> None:
        self.at = start

    def take(self, nbytes: int) -> int:
        at = self.at
        self.at += cdiv(nbytes, _ALIGN) * _ALIGN
        return at


@dataclass(frozen=True)
class CompressedPages(PageKind):
    """The byte plan of one page and one window page (:meth:`of`) and their views over an
    arena."""

    name: ClassVar[str] = "compressed"
    dtype: torch.dtype
    head_dim: int
    index_dim: int
    layers: tuple[LayerParts, ...]
    nbytes: int
    rates: tuple[int, ...]  # each compressed layer's rate, in layer order
    window: int  # the sliding window's entries: a window page's positions
    window_nbytes: int

    @classmethod
    def of(cls, config: ModelConfig, dtype: torch.dtype, page_tokens: int) -> CompressedPages:
        """The plan for ``config`` (a deepseek_v4 ``ModelConfig``); ``ValueError`` when
        ``page_tokens`` does not fit its compression rates."""
        c = config
        v4: DeepseekV4Fields = c.family_fields
        item = torch.empty((), dtype=dtype).element_size()
        d, di, pt, w = c.head_dim, v4.index_head_dim, page_tokens, v4.sliding_window
        csa, hca = v4.compress_rates
        layers = []
        page = _Offsets(0)
        wpage = _Offsets(_ALIGN)  # the header: the position whose state the page holds
        for kind in v4.attention_types:
            rate = {SLIDING: 0, CSA: csa, HCA: hca}[kind]
            if rate and not (pt % rate == 0 or (kind == HCA and rate % pt == 0)):
                need = (
                    f"a multiple of {rate}" if kind == CSA else f"a divisor or multiple of {rate}"
                )
                raise ValueError(
                    f"page_tokens {pt} does not fit {kind}'s compression rate {rate} "
                    f"(page_tokens must be {need})"
                )
            slots = max(1, pt // rate) if rate else 0
            accumulators = {SLIDING: 0, CSA: 2, HCA: 1}[kind]
            entries = page.take(item * slots * d) if rate else -1
            keys = page.take(item * slots * di) if kind == CSA else -1
            window = wpage.take(item * w * d)
            state = wpage.take(4 * accumulators * 3 * d) if accumulators else -1
            index_state = wpage.take(4 * 2 * 3 * di) if kind == CSA else -1
            layers.append(LayerParts(kind, rate, slots, entries, keys, window, state, index_state))
        nbytes = max(page.at, _ALIGN)
        rates = tuple({CSA: csa, HCA: hca}[k] for k in v4.attention_types if k != SLIDING)
        shape = (nbytes // item,)
        return cls(pt, shape, 0, dtype, d, di, tuple(layers), nbytes, rates, w, wpage.at)

    @classmethod
    def windowed(cls, config: ModelConfig) -> bool:
        return True

    @property
    def window_tokens(self) -> int:
        return self.window

    @property
    def window_bytes(self) -> int:
        return self.window_nbytes

    @classmethod
    def fit(cls, config: ModelConfig, page_tokens: int) -> str | None:
        try:  # pages must hold whole compression windows (or whole pages a window)
            cls.of(config, torch.float32, page_tokens)
        except ValueError as e:
            fits = cls.fitting_page_tokens(config)
            rates = list(config.family_fields.compress_rates)
            return (
                f"{e}; this checkpoint's compress_rates {rates} fit page_tokens {fits} (kern "
                f"serve --page-tokens {fits}, or page_tokens = {fits} in a kern.toml target)"
            )
        return None

    def draft_unit(self, any_stride: bool) -> int:
        raise ValueError("compressed pages hold no other model's KV rows")

    def bind(
        self, pages: Tensor, page_rows: Tensor, ops: Any, window_rows: Tensor | None = None
    ) -> CompressedViews:
        if window_rows is None:
            raise ValueError("compressed pages need window pages (the arena's slots)")
        return CompressedViews(self, page_rows, window_rows, ops)

    @classmethod
    def fitting_page_tokens(cls, c: ModelConfig, at_least: int = 16) -> int:
        """The smallest page size of at least ``at_least`` tokens that fits ``c``'s rates."""
        csa, hca = c.family_fields.compress_rates
        pt = -(-at_least // csa) * csa
        while not (pt % hca == 0 or hca % pt == 0):
            pt += csa
        return pt

    @staticmethod
    def positions(window_rows: Tensor) -> Tensor:
        """[num_window_pages] int32: the position after which each window page's
        accumulators were written (its last written token; -1 in a page never written)."""
        return window_rows[:, :4].view(torch.int32)[:, 0]

    def views(self, page_rows: Tensor, window_rows: Tensor) -> list[LayerViews]:
        """Per-layer views of ``page_rows`` ([num_pages, >= nbytes] uint8) and
        ``window_rows`` ([num_window_pages, >= window_bytes] uint8)."""

        def part(rows: Tensor, at: int, dtype: torch.dtype, *shape: int) -> Tensor:
            size = 1
            for s in shape:
                size *= s
            width = size * torch.empty((), dtype=dtype).element_size()
            return rows[:, at : at + width].view(dtype).view(rows.shape[0], *shape)

        out = []
        d, di, w = self.head_dim, self.index_dim, self.window
        pr, wr = page_rows, window_rows
        for p in self.layers:
            acc = 2 if p.kind == CSA else 1
            out.append(
                LayerViews(
                    p,
                    part(wr, p.window, self.dtype, w, d),
                    part(pr, p.entries, self.dtype, p.slots, d) if p.entries >= 0 else None,
                    part(pr, p.keys, self.dtype, p.slots, di) if p.keys >= 0 else None,
                    part(wr, p.state, torch.float32, acc, 3, d) if p.state >= 0 else None,
                    part(wr, p.index_state, torch.float32, 2, 3, di)
                    if p.index_state >= 0
                    else None,
                )
            )
        return out


class CompressedViews(Pages):
    """:class:`CompressedPages` over an arena (see the module notes)."""

    kind: CompressedPages
    rewinds = True

    def __init__(
        self, kind: CompressedPages, page_rows: Tensor, window_rows: Tensor, ops: Any
    ) -> None:
        super().__init__(kind, kind.views(page_rows, window_rows), ops)
        self.window_tokens = kind.window
        self.window_rows = window_rows
        # The position whose pooling state each window page holds (-1: none).
        self._state_ends = kind.positions(window_rows)
        self._state_ends.fill_(-1)
        # The last forward's plan and its verify chunks' first kept rows.
        self._verify_plan: ca.CompressedPlan | None = None
        self._verified: dict[tuple[int, int], int] = {}

    def plan(self, step: Step, batch: Sequence[SeqChunk]) -> ca.CompressedPlan:
        """One plan, every layer; the pooling state after each row of a verify chunk is kept
        for :meth:`rewind`."""
        keep: list[int] = []
        self._verified = {}
        w = self.window_tokens
        for b, chunk in enumerate(batch):
            if chunk.logits == "all":
                # Keyed by the window page it writes first: no other running sequence holds it.
                assert chunk.window is not None
                page = chunk.window[chunk.start_pos // w]
                self._verified[(chunk.start_pos, page)] = len(keep)
                keep.extend(range(step.q_starts[b], step.q_starts[b] + step.q_lens[b]))
        k = self.kind
        windows, bases = window_tables(batch, w)
        attention = ca.plan(step, self.page_tokens, w, k.rates, windows, bases, keep)
        self._verify_plan = attention
        return attention

    def stepped(self, step: Step) -> None:
        plan = step.attention
        assert isinstance(plan, ca.CompressedPlan)
        rows = plan.state_rows
        self._state_ends[plan.row_window[rows]] = step.positions[rows].int()

    def kv_at(
        self,
        block_table: Sequence[int],
        positions: Sequence[int],
        window: Sequence[int] | None = None,
    ) -> Tensor:
        """[n, layers, D]: the window entries (read through ``window``, default the table
        :func:`shadow_window` derives from ``block_table``)."""
        w = self.window_tokens
        pos = list(positions)
        if window is None:
            window = shadow_window(block_table, self.page_tokens, w, max(pos) + 1 if pos else 0)
        dev = self.ops.device
        at = torch.tensor(pos, device=dev)
        pages = torch.tensor(list(window), device=dev)[at // w]
        return torch.stack([v.window[pages, at % w] for v in self.layers], dim=1)

    def state_end(self, window_page: int) -> int:
        """The position whose pooling state ``window_page`` holds (-1: none)."""
        return int(self._state_ends[window_page])

    def rewind(
        self,
        block_table: Sequence[int],
        start_pos: int,
        num_rows: int,
        window: Sequence[int] | None = None,
    ) -> None:
        """Leave the pooling state as the verify chunk's first ``num_rows`` rows left them (in
        the window page of its last kept row)."""
        w = self.window_tokens
        last = start_pos + num_rows - 1
        if window is None:
            window = shadow_window(block_table, self.page_tokens, w, last + 1)
        first = self._verified[(start_pos, window[start_pos // w])]
        assert self._verify_plan is not None
        ca.rewind(self._verify_plan, first + num_rows - 1, window[last // w])
        self._state_ends[window[last // w]] = last

    def fold(self, prev: int, dst: int, cut: int) -> None:
        for v in self.layers:
            v.window[dst, cut:] = v.window[prev, cut:]


def window_tables(batch: Sequence[SeqChunk], window: int) -> tuple[Tensor, list[int]]:
    """Each chunk's window pages from the first its rows read ([B, J] int64, -1 padded) and
    that first page's index in its sequence's table."""
    rows, bases = [], []
    for c in batch:
        assert c.window is not None
        span = window_span(c.start_pos, c.start_pos + len(c.token_ids), window)
        rows.append(list(c.window[span.start : span.stop]))
        bases.append(span.start)
    width = max(len(r) for r in rows)
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long), bases
