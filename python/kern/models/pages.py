"""Page kinds: what one KV page holds for a model, and the rules that follow from it. The runner
and the cache's books ask the kind instead of testing which it is.

Design notes
------------
* A page is ``page_tokens`` positions of every attention layer, contiguous, so parking or
  waking a page is one row of bytes (``kern.engine.layout``). A kind (:class:`PageKind`) says
  the page's shape; bound to a runner's arena (:meth:`PageKind.bind`) it is :class:`Pages`:
  the per-layer views the layers read and write, the step's attention plan, the K/V at a
  position, which prefix hits are exact, and what a verify's rewind must restore.
* Two kinds here, one per family in its folder (DeepSeek-V4's compressed pages,
  ``kern.models.deepseek_v4.pages``; gpt-oss's sliding-window K/V,
  ``kern.models.gpt_oss.pages``); the registry row names a family's kind.
  - :class:`KvPages` (GQA): each layer's K and V per head, ``[attention layers, 2, Hk,
    page_tokens, D]``. How K and V sit inside a page is the backend's choice (the CPU stores
    K transposed; ``ops.kv_views``), not the kind's.
  - :class:`LatentPages` (multi-head latent attention): each layer's one cached vector per
    token, the normalised latent then the rotated RoPE key, ``[attention layers,
    page_tokens, kv_lora_rank + qk_rope_head_dim]``: 576 values a token a layer at
    DeepSeek-V3's dims, where K and V per head would be 128 x (192 + 128).
* KV and latent pages hold only what each position wrote, so every prefix hit is exact,
  a page copy is not a state snapshot, and a verify needs no rewind: rejected positions are
  overwritten when the sequence gets there again.
* A kind may keep a sliding window's entries in **window pages** of their own (the pool's
  slots; ``PageKind.window_tokens``, DeepSeek-V4's and gpt-oss's): a running sequence holds
  only the ones its next rows read (``kern.engine.window_pages``), and a hit resumes only
  where the tree holds a snapshot of the window (:meth:`Pages.snapshot`, :meth:`Pages.restore`).
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

if TYPE_CHECKING:
    from kern.pool import Match

__all__ = ["KvPages", "LatentPages", "PageKind", "Pages"]


@dataclass(frozen=True)
class PageKind:
    """What one page holds (its shape in the backend's dtype); :meth:`of` builds it from a
    config, :meth:`bind` puts it over an arena."""

    name: ClassVar[str]
    page_tokens: int
    page_shape: tuple[int, ...]
    num_attention_layers: int

    @classmethod
    def of(cls, config: ModelConfig, dtype: torch.dtype, page_tokens: int) -> PageKind:
        raise NotImplementedError

    @classmethod
    def fit(cls, config: ModelConfig, page_tokens: int) -> str | None:
        """Why ``page_tokens`` does not fit ``config``'s pages (None: it does)."""
        return None

    @classmethod
    def windowed(cls, config: ModelConfig) -> bool:
        """Whether this kind keeps window pages for ``config`` (before a dtype or a page size:
        what a target may set)."""
        return False

    @property
    def window_tokens(self) -> int:
        """Positions a window page holds (0: this kind keeps no window pages; see
        :class:`Pages`)."""
        return 0

    @property
    def window_bytes(self) -> int:
        """Bytes of one window page (0 without them)."""
        return 0

    def draft_unit(self, any_stride: bool) -> int:
        """The values a draft page's rows come in: a pool page holding a draft's page must be
        a whole number of them from the arena's start (the CPU attention indexes K rows of
        ``page_tokens`` values and V chunks of ``page_tokens * head_dim`` values; latent
        pages, rows of ``page_tokens * C``); ``any_stride``: the backend reads pages at any
        stride (CUDA's latent attention)."""
        raise NotImplementedError

    def bind(
        self, pages: Tensor, page_rows: Tensor, ops: Any, window_rows: Tensor | None = None
    ) -> Pages:
        """This kind over an arena's ``pages`` ([num_pages, *page_shape]) and ``page_rows``
        ([num_pages, page_bytes] uint8), and its window pages' ``window_rows`` ([num_slots,
        window_bytes] uint8, for a kind that keeps them), for ``ops``."""
        raise NotImplementedError


class Pages:
    """A page kind over one runner's arena (see the module notes). The defaults are the
    rules of pages that hold only what each position wrote."""

    # A page copy holds the state at its last token (compressed pages): a prompt-end copy of
    # the partial page is a snapshot a repeated prompt resumes from.
    prompt_snapshots: ClassVar[bool] = False
    # A verify's rejected rows leave state in the pages that must be rewound (:meth:`rewind`).
    rewinds: ClassVar[bool] = False
    # Positions a window page holds (0: none). A kind with window pages keeps a sliding
    # window's entries (and the state a next token reads) apart from the pages a prefix cache
    # keeps whole: a running sequence holds only the window pages its attention can still
    # read, a cached prefix one window page folded into a snapshot where a hit may resume.
    window_tokens: int = 0
    # The window pages as rows of bytes ([num_window_pages, >= window_bytes] uint8; None
    # without them): what snapshots and restores copy whole.
    window_rows: Tensor | None = None

    def __init__(self, kind: PageKind, layers: list, ops: Any) -> None:
        self.kind = kind
        self.page_tokens = kind.page_tokens
        self.layers = layers  # per attention layer, what its layer reads (Caches.kv)
        self.ops = ops

    def plan(self, step: Step, batch: Sequence[SeqChunk]) -> object:
        """The step's attention plan (the backend's index structures every layer reads)."""
        raise NotImplementedError

    def window_step(self, step: Step, batch: Sequence[SeqChunk]) -> Step | None:
        """``step`` as the layers that keep their K/V in window pages see it (their slots, their
        tables, their attention plan), for ``Step.window``; None: no such layer."""
        return None

    def stepped(self, step: Step) -> None:
        """After the forward of ``step`` (its plan in ``step.attention``)."""

    def kv_at(
        self,
        block_table: Sequence[int],
        positions: Sequence[int],
        window: Sequence[int] | None = None,
    ) -> Tensor:
        """A copy of what the pages hold at ``positions`` of a sequence, per layer (a kind
        with window pages reads them through ``window``)."""
        raise NotImplementedError

    def hit_key(self, tokens: Sequence[int]) -> Sequence[int]:
        """The key a prompt's prefix-cache lookup matches."""
        return tokens

    def exact_hit(self, match: Match, hit: int) -> int:
        """The longest part of a resident ``hit`` of ``match`` a sequence may resume at."""
        return hit

    def rewind(
        self,
        block_table: Sequence[int],
        start_pos: int,
        num_rows: int,
        window: Sequence[int] | None = None,
    ) -> None:
        """After a verify chunk at ``start_pos`` of the last forward (its window pages
        ``window``, for a kind with them), leave the pages as its first ``num_rows`` rows
        left them."""

    def snapshot(self, window: Sequence[int], end: int, dst: int) -> None:
        """Make window page ``dst`` the snapshot a sequence resumes from at ``end``: the
        window before ``end`` (at offsets ``position % window_tokens``) and what the page of
        ``end - 1`` holds after it, from the sequence's window pages ``window`` (``dst`` may be
        the one holding ``end - 1``: then the previous page is folded in, in place)."""
        assert self.window_rows is not None
        w = self.window_tokens
        j = (end - 1) // w
        src = window[j]
        if dst != src:
            self.window_rows[dst] = self.window_rows[src]
        cut = end % w
        if cut and j > 0 and window[j - 1] >= 0:
            self.fold(window[j - 1], dst, cut)

    def fold(self, prev: int, dst: int, cut: int) -> None:
        """Copy every layer's window entries at offsets ``cut ..`` of window page ``prev``
        into ``dst`` (a snapshot's older part of the window)."""
        raise NotImplementedError

    def restore(self, src: int, dst: Sequence[int]) -> None:
        """Copy snapshot ``src`` into window pages ``dst``: each then holds, at every
        position a resumed sequence reads before writing, what the snapshot's sequence had."""
        assert self.window_rows is not None
        if dst:
            at = torch.tensor(list(dst), device=self.window_rows.device)
            # A copy first: an index write refuses a source inside its own tensor.
            self.window_rows[at] = self.window_rows[src].clone()


@dataclass(frozen=True)
class KvPages(PageKind):
    """K and V per head (see the module notes)."""

    name: ClassVar[str] = "kv"
    head_dim: int
    group: int  # query heads per KV head

    @classmethod
    def of(cls, config: ModelConfig, dtype: torch.dtype, page_tokens: int) -> KvPages:
        c = config
        n = sum(not c.is_linear_layer(i) for i in range(c.num_hidden_layers))
        shape = (n, 2, c.num_key_value_heads, page_tokens, c.head_dim)
        group = c.num_attention_heads // c.num_key_value_heads
        return cls(page_tokens, shape, n, c.head_dim, group)

    def draft_unit(self, any_stride: bool) -> int:
        return self.page_tokens * self.head_dim

    def bind(
        self, pages: Tensor, page_rows: Tensor, ops: Any, window_rows: Tensor | None = None
    ) -> KvViews:
        return KvViews(self, pages, ops)


class KvViews(Pages):
    """:class:`KvPages` over an arena: layer ``l`` reads the strided view ``pages[:, l]``."""

    kind: KvPages

    def __init__(self, kind: KvPages, pages: Tensor, ops: Any) -> None:
        super().__init__(kind, [pages[:, i] for i in range(kind.num_attention_layers)], ops)
        self.pages = pages

    def plan(self, step: Step, batch: Sequence[SeqChunk]) -> object:
        if not self.kind.num_attention_layers:
            return None
        return self.ops.plan_attention(step, self.pages, self.kind.group)

    def plan_decode(self, tables: Tensor, seq_lens: Tensor, size: int) -> object:
        """A decode step's plan over device tables and lengths (a captured graph's)."""
        return self.ops.plan_decode_attention(tables, seq_lens, size, self.kind.group)

    def kv_at(self, block_table: Sequence[int], positions: Sequence[int]) -> Tensor:
        """[n, layers, 2, Hk, D]."""
        pages, offsets = _where(block_table, positions, self.page_tokens, self.ops.device)
        out = []
        for layer in self.layers:
            k, v = self.ops.kv_views(layer)
            out.append(torch.stack([k[pages, offsets], v[pages, offsets]], dim=1))
        return torch.stack(out, dim=1)


@dataclass(frozen=True)
class LatentPages(PageKind):
    """One latent vector per token and layer (see the module notes)."""

    name: ClassVar[str] = "latent"
    num_heads: int

    @classmethod
    def of(cls, config: ModelConfig, dtype: torch.dtype, page_tokens: int) -> LatentPages:
        c, m = config, config.mla
        assert m is not None
        n = sum(not c.is_linear_layer(i) for i in range(c.num_hidden_layers))
        shape = (n, page_tokens, m.kv_lora_rank + m.qk_rope_head_dim)
        return cls(page_tokens, shape, n, c.num_attention_heads)

    def draft_unit(self, any_stride: bool) -> int:
        return 1 if any_stride else self.page_tokens * self.page_shape[-1]

    def bind(
        self, pages: Tensor, page_rows: Tensor, ops: Any, window_rows: Tensor | None = None
    ) -> LatentViews:
        return LatentViews(self, pages, ops)


class LatentViews(Pages):
    """:class:`LatentPages` over an arena: layer ``l`` reads ``pages[:, l]``."""

    kind: LatentPages

    def __init__(self, kind: LatentPages, pages: Tensor, ops: Any) -> None:
        super().__init__(kind, [pages[:, i] for i in range(kind.num_attention_layers)], ops)
        self.pages = pages

    def plan(self, step: Step, batch: Sequence[SeqChunk]) -> object:
        return self.ops.plan_latent_attention(step, self.pages, self.kind.num_heads)

    def kv_at(self, block_table: Sequence[int], positions: Sequence[int]) -> Tensor:
        """[n, layers, C]: the cached vectors."""
        pages, offsets = _where(block_table, positions, self.page_tokens, self.ops.device)
        return torch.stack([layer[pages, offsets] for layer in self.layers], dim=1)


def _where(
    block_table: Sequence[int], positions: Sequence[int], page_tokens: int, device: torch.device
) -> tuple[Tensor, Tensor]:
    """The pages and offsets of a sequence's ``positions``."""
    pos = torch.tensor(list(positions), device=device)
    pages = torch.tensor(list(block_table), device=device)[pos // page_tokens]
    return pages, pos % page_tokens
