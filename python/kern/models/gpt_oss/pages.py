"""gpt-oss's page kind (``sliding_kv``): the full layers' K and V in pages, the sliding layers'
in window pages (``kern.models.pages``), so a long sequence costs its full layers plus one
window, not every layer's every token.

Design notes
------------
* A **page** (``page_tokens`` positions, the pool's pages, kept whole by the prefix tree) holds
  each full-attention layer's K and V per head, ``[full layers, 2, Hk, page_tokens, D]``: what
  its positions wrote, as :class:`kern.models.pages.KvPages` does.
* A **window page** (the pool's slots) holds each sliding layer's K and V for ``window_tokens``
  positions, ``[sliding layers, 2, Hk, window_tokens, D]``. ``window_tokens`` is the sliding
  window rounded up to a power of two, at least 16: the attention kernels read pages of a
  power-of-two size (the Triton kernel's tiles are at least 16 keys), and a window page still
  holds a whole window, so a row at ``p`` reads two window pages at most. 128 (the release's
  window) stays 128.
* Offset ``o`` of a sequence's window page ``j`` is position ``j * window_tokens + o``. A
  **snapshot** at ``end`` is one window page holding positions ``end - window_tokens .. end -
  1`` at their offsets (``Pages.snapshot``: the page of ``end - 1`` with the previous page's
  later offsets folded in by :meth:`SlidingKvViews.fold`); a resumed sequence gets a copy in
  each window page its next rows read (``Pages.restore``), where every offset is either the
  snapshot's position or one the sequence writes before it reads it. K/V hold only what each
  position wrote, so a verify needs no rewind.
* The sliding layers run on their own view of the step (:meth:`SlidingKvViews.window_step`:
  each row's slot in its window page, each chunk's window table with -1 before the pages its
  rows read), so the backends' paged attention reads window pages as it reads pages, and reads
  only the pages a row's window reaches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import Tensor

from kern.batch import Step, window_step
from kern.chunk import SeqChunk
from kern.models.config import ModelConfig
from kern.models.gpt_oss.config import window
from kern.models.pages import PageKind, Pages
from kern.models.window import shadow_window

__all__ = ["SlidingKvPages", "SlidingKvViews", "window_page_tokens"]

MIN_WINDOW_PAGE = 16  # the Triton attention's smallest tile of keys


def window_page_tokens(sliding_window: int) -> int:
    """Positions a window page holds for a sliding window of ``sliding_window`` keys."""
    return max(1 << (sliding_window - 1).bit_length(), MIN_WINDOW_PAGE)


@dataclass(frozen=True)
class SlidingKvPages(PageKind):
    """The shapes of one page and one window page (see the module notes)."""

    name: ClassVar[str] = "sliding_kv"
    dtype: torch.dtype
    head_dim: int
    num_kv_heads: int
    group: int  # query heads per KV head
    sliding: tuple[bool, ...]  # per attention layer: whether it keeps window pages
    sliding_window: int  # the sliding layers' window (0: no sliding layer)
    window: int  # positions a window page holds (0: no window pages)

    @classmethod
    def of(cls, config: ModelConfig, dtype: torch.dtype, page_tokens: int) -> SlidingKvPages:
        c = config
        n = c.num_hidden_layers
        sliding = tuple(window(c, i) > 0 for i in range(n))
        w = max(window(c, i) for i in range(n))
        full = n - sum(sliding)
        hk, d = c.num_key_value_heads, c.head_dim
        if full:
            shape: tuple[int, ...] = (full, 2, hk, page_tokens, d)
        else:  # no full layer: a page holds nothing, but the pool needs a page of some bytes
            shape = (max(1, 16 // torch.empty((), dtype=dtype).element_size()),)
        group = c.num_attention_heads // hk
        wp = window_page_tokens(w) if w else 0
        return cls(page_tokens, shape, n, dtype, d, hk, group, sliding, w, wp)

    @classmethod
    def windowed(cls, config: ModelConfig) -> bool:
        return any(window(config, i) for i in range(config.num_hidden_layers))

    @property
    def num_full(self) -> int:
        return len(self.sliding) - sum(self.sliding)

    @property
    def window_tokens(self) -> int:
        return self.window

    @property
    def window_shape(self) -> tuple[int, ...]:
        """One window page: ``[sliding layers, 2, Hk, window_tokens, D]``."""
        return (sum(self.sliding), 2, self.num_kv_heads, self.window, self.head_dim)

    @property
    def window_bytes(self) -> int:
        if not self.window:
            return 0
        return math.prod(self.window_shape) * torch.empty((), dtype=self.dtype).element_size()

    def draft_unit(self, any_stride: bool) -> int:
        if not self.num_full:
            raise ValueError("pages of a model with only sliding layers hold no KV rows")
        return self.page_tokens * self.head_dim

    def bind(
        self, pages: Tensor, page_rows: Tensor, ops: Any, window_rows: Tensor | None = None
    ) -> SlidingKvViews:
        if self.window and window_rows is None:
            raise ValueError("sliding layers' K/V need window pages (the arena's slots)")
        return SlidingKvViews(self, pages, window_rows, ops)


class SlidingKvViews(Pages):
    """:class:`SlidingKvPages` over an arena: a full layer reads ``pages[:, i]``, a sliding
    layer ``windows[:, j]`` (the window pages as ``[S, sliding layers, 2, Hk, W, D]``)."""

    kind: SlidingKvPages

    def __init__(
        self, kind: SlidingKvPages, pages: Tensor, window_rows: Tensor | None, ops: Any
    ) -> None:
        self.window_rows = window_rows
        self.windows: Tensor | None = None
        if kind.window:
            assert window_rows is not None
            rows = window_rows[:, : kind.window_bytes]
            self.windows = rows.view(kind.dtype).view(rows.shape[0], *kind.window_shape)
        layers, full, slid = [], 0, 0
        for sliding in kind.sliding:
            if sliding:
                assert self.windows is not None
                layers.append(self.windows[:, slid])
                slid += 1
            else:
                layers.append(pages[:, full])
                full += 1
        super().__init__(kind, layers, ops)
        self.pages = pages
        self.window_tokens = kind.window

    def plan(self, step: Step, batch: Sequence[SeqChunk]) -> object:
        if not self.kind.num_full:
            return None
        return self.ops.plan_attention(step, self.pages, self.kind.group)

    def window_step(self, step: Step, batch: Sequence[SeqChunk]) -> Step | None:
        if not self.window_tokens:
            return None
        assert self.windows is not None
        at = window_step(step, batch, self.window_tokens)
        k = self.kind
        plan = self.ops.plan_attention(at, self.windows, k.group, window=k.sliding_window)
        return replace(at, attention=plan)

    def kv_at(
        self,
        block_table: Sequence[int],
        positions: Sequence[int],
        window: Sequence[int] | None = None,
    ) -> Tensor:
        """[n, layers, 2, Hk, D]: the full layers' from the pages, the sliding layers' from
        the window pages ``window`` (default: the table ``shadow_window`` derives)."""
        pos = list(positions)
        dev = self.ops.device
        at = torch.tensor(pos, device=dev)
        pages = torch.tensor(list(block_table), device=dev)[at // self.page_tokens]
        offsets = at % self.page_tokens
        w = self.window_tokens
        if w:
            if window is None:
                end = max(pos) + 1 if pos else 0
                window = shadow_window(block_table, self.page_tokens, w, end)
            wpages = torch.tensor(list(window), device=dev)[at // w]
        out = []
        for layer, sliding in zip(self.layers, self.kind.sliding, strict=True):
            k, v = self.ops.kv_views(layer)
            where = (wpages, at % w) if sliding else (pages, offsets)
            out.append(torch.stack([k[where], v[where]], dim=1))
        return torch.stack(out, dim=1)

    def fold(self, prev: int, dst: int, cut: int) -> None:
        for layer, sliding in zip(self.layers, self.kind.sliding, strict=True):
            if sliding:
                for part in self.ops.kv_views(layer):
                    part[dst, cut:] = part[prev, cut:]
