"""What one page of a DeepSeek-V4 model holds (the ``compressed`` page class), in bytes, and
the per-layer views of those bytes the model reads and writes.

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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kern.model_config import V4_ATTENTION_TYPES

__all__ = ["CompressedPage", "LayerParts", "LayerViews"]

SLIDING, CSA, HCA = V4_ATTENTION_TYPES
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


@dataclass(frozen=True, slots=True)
class CompressedPage:
    """The byte plan of one page (:meth:`of`) and its views over an arena's pages."""

    page_tokens: int
    dtype: torch.dtype
    head_dim: int
    index_dim: int
    layers: tuple[LayerParts, ...]
    nbytes: int

    @classmethod
    def of(cls, c, dtype: torch.dtype, page_tokens: int) -> CompressedPage:
        """The plan for config ``c`` (a deepseek_v4 ``ModelConfig``); ``ValueError`` when
        ``page_tokens`` does not fit its compression rates."""
        item = torch.empty((), dtype=dtype).element_size()
        d, di, pt = c.head_dim, c.index_head_dim, page_tokens
        csa, hca = c.compress_rates
        layers = []
        offset = _ALIGN  # the header: the position whose state the page holds (int32)

        def take(nbytes: int) -> int:
            nonlocal offset
            at = offset
            offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
            return at

        for kind in c.layer_types:
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
        return cls(pt, dtype, d, di, tuple(layers), max(offset, _ALIGN))

    @classmethod
    def fitting_page_tokens(cls, c, at_least: int = 16) -> int:
        """The smallest page size of at least ``at_least`` tokens that fits ``c``'s rates."""
        csa, hca = c.compress_rates
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
