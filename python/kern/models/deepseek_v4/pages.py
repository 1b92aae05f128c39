"""DeepSeek-V4's page kind (``compressed``): what one page holds, in bytes, the per-layer views
of those bytes the model reads and writes, and the rules that follow (``kern.models.pages``):
which hits are exact, what a prompt-end page copy is, and what a verify's rewind restores.

Design notes
------------
* Everything the next token depends on lives in the pages of its prefix, so a prefix hit at
  any page boundary restores all of it and is exact (no least-common-multiple block size,
  no per-request ring a hit could miss). Per layer, a page of ``page_tokens`` positions holds:
  - the sliding window's entry of each of its tokens (``[page_tokens, head_dim]``; K = V);
  - a CSA layer (compression ``m``, ``page_tokens % m == 0``): the ``page_tokens / m``
    compressed entries whose windows lie in the page, their indexer keys
    (``[page_tokens / m, index_head_dim]``), and the two pooling accumulators of the
    compressor and of the indexer's compressor after the page's last written token;
  - an HCA layer (``m % page_tokens == 0`` or ``page_tokens % m == 0``): the entries whose
    windows end in the page (at least one slot) and the pooling accumulator after its last
    written token.
  A running sequence reads the accumulators of the page holding its previous token (the
  page a hit ends with, or its own last page), and writes them at every page end and at the
  end of each chunk. A 16-byte header holds the position they were written after, so a hit
  ending mid-page is taken only where the page's state is that of its last token (a
  prompt-end snapshot, a request's last page), never of a later one.
* An accumulator is a windowed softmax pooling kept online, float32 whatever the model's
  dtype: (running max, sum of weights, weighted sum), ``[3, dim]``. Tokens enter it one at a
  time, in position order, so its bits depend only on the tokens (not on chunking, batching
  or where a hit ended). CSA keeps two: the entry of the current window (which started with
  the previous window's first half, ``Ca``) and the next window's ``Ca`` so far.
* Bytes per token, per layer: ``head_dim`` (window) + CSA ``(head_dim + index_head_dim) / m``
  + HCA ``head_dim / m``, in the model's dtype; per page, per layer: CSA
  ``4 * 3 * 2 * (head_dim + index_head_dim)``, HCA ``4 * 3 * head_dim`` (the accumulators),
  and HCA ``page_tokens < m`` one entry slot (``head_dim`` values) per page. Every token's
  window entry is kept for the whole context (the price of exact hits at every boundary).
* A verify chunk's rows each leave a pooling state; the plan keeps them (``keep`` rows), and
  :meth:`CompressedViews.rewind` puts back the state of the last row kept, in the page of
  that row. Rejected rows' window entries and closed entries are rewritten before anything
  reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from kern.batch import Step
from kern.chunk import SeqChunk
from kern.models.config import ModelConfig
from kern.models.deepseek_v4 import attention as ca
from kern.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Fields
from kern.models.pages import PageKind, Pages
from kern.pool import ids

if TYPE_CHECKING:
    from kern.pool import Match

__all__ = ["CompressedPages", "CompressedViews", "LayerParts", "LayerViews"]

_ALIGN = 16


@dataclass(frozen=True, slots=True)
class LayerParts:
    """Byte offsets of one layer's parts inside a page (-1: the layer has no such part)."""

    kind: str
    rate: int  # source tokens per compressed entry (0: sliding only)
    slots: int  # compressed entries per page
    window: int
    entries: int
    keys: int
    state: int  # float32 [accumulators, 3, head_dim]
    index_state: int  # float32 [2, 3, index_head_dim]


@dataclass(slots=True)
class LayerViews:
    """One layer's parts across all pages: ``window`` [P, page_tokens, D], ``entries``
    [P, slots, D], ``keys`` [P, slots, Di], ``state`` [P, A, 3, D] and ``index_state``
    [P, 2, 3, Di] (float32); None where the layer has no such part."""

    parts: LayerParts
    window: Tensor
    entries: Tensor | None
    keys: Tensor | None
    state: Tensor | None
    index_state: Tensor | None


@dataclass(frozen=True)
class CompressedPages(PageKind):
    """The byte plan of one page (:meth:`of`) and its views over an arena's pages."""

    name: ClassVar[str] = "compressed"
    dtype: torch.dtype
    head_dim: int
    index_dim: int
    layers: tuple[LayerParts, ...]
    nbytes: int
    rates: tuple[int, ...]  # each compressed layer's rate, in layer order
    window: int  # the sliding window's entries

    @classmethod
    def of(cls, config: ModelConfig, dtype: torch.dtype, page_tokens: int) -> CompressedPages:
        """The plan for ``config`` (a deepseek_v4 ``ModelConfig``); ``ValueError`` when
        ``page_tokens`` does not fit its compression rates."""
        c = config
        v4: DeepseekV4Fields = c.family_fields
        item = torch.empty((), dtype=dtype).element_size()
        d, di, pt = c.head_dim, v4.index_head_dim, page_tokens
        csa, hca = v4.compress_rates
        layers = []
        offset = _ALIGN  # the header: the position whose state the page holds (int32)

        def take(nbytes: int) -> int:
            nonlocal offset
            at = offset
            offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
            return at

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
            state = take(4 * accumulators * 3 * d) if accumulators else -1
            index_state = take(4 * 2 * 3 * di) if kind == CSA else -1
            window = take(item * pt * d)
            entries = take(item * slots * d) if rate else -1
            keys = take(item * slots * di) if kind == CSA else -1
            layers.append(LayerParts(kind, rate, slots, window, entries, keys, state, index_state))
        nbytes = max(offset, _ALIGN)
        rates = tuple({CSA: csa, HCA: hca}[k] for k in v4.attention_types if k != SLIDING)
        shape = (nbytes // item,)
        return cls(pt, shape, 0, dtype, d, di, tuple(layers), nbytes, rates, v4.sliding_window)

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

    def bind(self, pages: Tensor, page_rows: Tensor, ops: Any) -> CompressedViews:
        return CompressedViews(self, page_rows, ops)

    @classmethod
    def fitting_page_tokens(cls, c: ModelConfig, at_least: int = 16) -> int:
        """The smallest page size of at least ``at_least`` tokens that fits ``c``'s rates."""
        csa, hca = c.family_fields.compress_rates
        pt = -(-at_least // csa) * csa
        while not (pt % hca == 0 or hca % pt == 0):
            pt += csa
        return pt

    @staticmethod
    def positions(page_rows: Tensor) -> Tensor:
        """[num_pages] int32: the position after which each page's accumulators were written
        (its last written token; -1 in a page never written)."""
        return page_rows[:, :4].view(torch.int32)[:, 0]

    def views(self, page_rows: Tensor) -> list[LayerViews]:
        """Per-layer views of ``page_rows`` ([num_pages, >= nbytes] uint8)."""
        n = page_rows.shape[0]

        def part(at: int, dtype: torch.dtype, *shape: int) -> Tensor:
            size = 1
            for s in shape:
                size *= s
            width = size * torch.empty((), dtype=dtype).element_size()
            return page_rows[:, at : at + width].view(dtype).view(n, *shape)

        out = []
        d, di, pt = self.head_dim, self.index_dim, self.page_tokens
        for p in self.layers:
            acc = 2 if p.kind == CSA else 1
            out.append(
                LayerViews(
                    p,
                    part(p.window, self.dtype, pt, d),
                    part(p.entries, self.dtype, p.slots, d) if p.entries >= 0 else None,
                    part(p.keys, self.dtype, p.slots, di) if p.keys >= 0 else None,
                    part(p.state, torch.float32, acc, 3, d) if p.state >= 0 else None,
                    part(p.index_state, torch.float32, 2, 3, di) if p.index_state >= 0 else None,
                )
            )
        return out


class CompressedViews(Pages):
    """:class:`CompressedPages` over an arena (see the module notes)."""

    kind: CompressedPages
    prompt_snapshots = True
    rewinds = True

    def __init__(self, kind: CompressedPages, page_rows: Tensor, ops: Any) -> None:
        super().__init__(kind, kind.views(page_rows), ops)
        # The position whose pooling state each page holds (-1: none).
        self._state_ends = kind.positions(page_rows)
        self._state_ends.fill_(-1)
        # The last forward's plan and its verify chunks' first kept rows.
        self._verify_plan: ca.CompressedPlan | None = None
        self._verified: dict[tuple[int, int], int] = {}

    def plan(self, step: Step, batch: Sequence[SeqChunk]) -> ca.CompressedPlan:
        """One plan, every layer; the pooling state after each row of a verify chunk is kept
        for :meth:`rewind`."""
        keep: list[int] = []
        self._verified = {}
        for b, chunk in enumerate(batch):
            if chunk.logits == "all":
                # Keyed by the page it writes first: no other running sequence holds it.
                page = chunk.block_table[chunk.start_pos // self.page_tokens]
                self._verified[(chunk.start_pos, page)] = len(keep)
                keep.extend(range(step.q_starts[b], step.q_starts[b] + step.q_lens[b]))
        k = self.kind
        attention = ca.plan(step, self.page_tokens, k.window, k.rates, keep)
        self._verify_plan = attention
        return attention

    def stepped(self, step: Step) -> None:
        plan = step.attention
        assert isinstance(plan, ca.CompressedPlan)
        rows = plan.state_rows
        self._state_ends[plan.row_page[rows]] = step.positions[rows].int()

    def kv_at(self, block_table: Sequence[int], positions: Sequence[int]) -> Tensor:
        """[n, layers, D]: the window entries."""
        pos = torch.tensor(list(positions), device=self.ops.device)
        pages = torch.tensor(list(block_table), device=self.ops.device)[pos // self.page_tokens]
        offsets = pos % self.page_tokens
        return torch.stack([v.window[pages, offsets] for v in self.layers], dim=1)

    def state_end(self, page: int) -> int:
        """The position whose pooling state ``page`` holds (-1: none)."""
        return int(self._state_ends[page])

    def hit_key(self, tokens: Sequence[int]) -> Sequence[int]:
        """All but the last token: a match ending at a node's end returns that node's pages (a
        prompt-end snapshot's own copy), not a longer path's page of a later state."""
        return tokens[: len(tokens) - 1]

    def exact_hit(self, match: Match, hit: int) -> int:
        """The longest part of ``hit`` whose last page holds the state of the hit's last
        token: the hit itself (a prompt-end snapshot, a request's last page), else its last
        page end. A parked part is checked once it is woken."""
        if hit == 0 or hit > match.resident_len:
            return hit
        pt, pages = self.page_tokens, ids(match.pages)
        for end in (hit, hit - hit % pt):
            if end and self.state_end(pages[(end - 1) // pt]) == end - 1:
                return end
        return 0

    def rewind(self, block_table: Sequence[int], start_pos: int, num_rows: int) -> None:
        """Leave the pooling state as the verify chunk's first ``num_rows`` rows left it (in
        the page of its last kept row)."""
        pt = self.page_tokens
        first = self._verified[(start_pos, block_table[start_pos // pt])]
        last = start_pos + num_rows - 1
        assert self._verify_plan is not None
        ca.rewind(self._verify_plan, first + num_rows - 1, block_table[last // pt])
        self._state_ends[block_table[last // pt]] = last
