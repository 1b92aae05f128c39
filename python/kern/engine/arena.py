"""One byte arena per budget, viewed as KV pages and as state slots, and the copies that land
the cache's park and wake plans.

Design notes
------------
* The arena is exactly ``placement.arena_bytes`` bytes (the pool's chunks, nothing else): page
  ``p`` is the ``page_bytes`` at ``p * page_bytes``, slot ``s`` the ``slot_stride`` bytes at
  ``s * slot_stride``. Both views cover the same bytes; the pool's books guarantee that a
  chunk backs pages or slots, never both in use, so when a class takes a chunk from the other
  the views follow with no copy and no re-allocation.
* Bytes a class inherits from the other are not cleared: a slot is zeroed when a sequence
  starts in it and overwritten whole by a snapshot copy or a wake, and attention reads a page
  only at positions the sequence wrote (the CPU's batched attention gives the other positions
  probability 0, the Triton kernel masks their loads), so stale bytes are never an input.
  The device arena starts zeroed all the same, so even a masked read of a never-written page
  sees finite numbers; the host arena is only ever read where a park wrote it, and is left
  unwritten (the OS maps it on first touch).
* A drafter's runner views the same device arena (kern.engine.drafters, ``Runner.over_arena``): its
  placement has the pool's page stride (``page_stride``, the target's ``page_bytes``) and its own,
  smaller ``page_bytes``, so draft page ``p`` is the first bytes of pool page ``p``. The pool hands
  such pages to requests like any other, so the two models never share a page in use.
* Plans are landed as raw rows of bytes: one gather and one scatter per arena for a whole
  list of park plans (not one per evicted entry), one per arena for a wake. A park list can
  reuse host slots: ``Evicted.Parked(dropped=...)`` drops an entry parked earlier in the same
  list and gives its host pages to a later one, so for a destination named twice only the
  last copy counts (an index copy with repeated destinations keeps an arbitrary one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from kern import pool
from kern.arith import cdiv
from kern.engine.layout import Layout

__all__ = ["Arena", "Placement", "land"]

# A slot's offset and stride are multiples of this many bytes (as the pool's are), so its
# float32 part can be viewed in place.
SLOT_ALIGN = 16


@dataclass(frozen=True, slots=True)
class Placement:
    """Where page ``p`` (``p * page_bytes``) and slot ``s`` (``slot_offset + s * slot_stride``)
    sit in an arena of ``arena_bytes``: the pool's ``kern.pool.Geometry`` as the runner reads
    it (:meth:`of_pool`; a plain value that ranks can send to their workers), or an arena of
    the runner's own. A pool's placement aliases the two (offset 0, both spanning the arena);
    :meth:`separate` gives pages and slots bytes of their own.
    ``page_stride`` (None: ``page_bytes``) puts page ``p`` at ``p * page_stride`` instead: a
    draft model's pages inside the pool's larger ones (see the design notes)."""

    page_bytes: int
    num_pages: int
    slot_stride: int
    num_slots: int
    arena_bytes: int
    slot_offset: int = 0
    page_stride: int | None = None
    # Window pages laid out by page (``kern.models.window.shadow_window``): an arena of the
    # runner's own, whose chunks name no window table.
    own_windows: bool = False

    @classmethod
    def of_pool(cls, g: pool.Geometry) -> Placement:
        return cls(g.page_bytes, g.num_pages, g.slot_stride, g.num_slots, g.arena_bytes)

    @classmethod
    def separate(cls, layout: Layout, num_pages: int, num_slots: int) -> Placement:
        """``num_pages`` pages, then ``num_slots`` slots, in one buffer, none shared: for a
        runner that owns its memory outright (``kern run``, tests, benchmarks). A layout with
        window pages gets ``cdiv(page_tokens, window_tokens)`` of them a page instead."""
        windowed = layout.windowed
        if windowed:
            num_slots = num_pages * cdiv(layout.page_tokens, layout.pages.window_tokens)
        num_slots = num_slots if layout.has_slots else 0
        stride = cdiv(layout.state_bytes, SLOT_ALIGN) * SLOT_ALIGN
        offset = cdiv(num_pages * layout.page_bytes, SLOT_ALIGN) * SLOT_ALIGN
        total = offset + num_slots * stride if num_slots else num_pages * layout.page_bytes
        return cls(
            layout.page_bytes, num_pages, stride, num_slots, total, offset, own_windows=windowed
        )


class Arena:
    """``placement.arena_bytes`` bytes on ``device``, with typed views:

    - ``pages`` [num_pages, *layout.page_shape] and ``page_rows`` [num_pages, page_bytes];
    - for a stateful layout, ``delta`` [num_slots, *delta_shape] (float32), ``conv``
      [num_slots, *conv_shape] and ``slot_rows`` [num_slots, state_bytes].

    ``zero=False`` leaves the bytes unwritten (the host tier, see the notes); ``pin=True``
    page-locks a CPU arena so copies to and from a GPU run asynchronously at full speed.
    ``buffer``: view these bytes (another arena's) instead of allocating; they are not
    cleared.
    """

    def __init__(
        self,
        layout: Layout,
        placement: Placement,
        device: torch.device,
        *,
        zero: bool = True,
        pin: bool = False,
        buffer: Tensor | None = None,
    ) -> None:
        if placement.page_bytes != layout.page_bytes:
            raise ValueError(
                f"the pool cuts {placement.page_bytes}-byte pages, the layout needs "
                f"{layout.page_bytes}"
            )
        if layout.has_slots and placement.slot_stride < layout.state_bytes:
            raise ValueError(
                f"the pool's slots are {placement.slot_stride} bytes apart, a state needs "
                f"{layout.state_bytes}"
            )
        self.layout = layout
        self.num_pages = placement.num_pages
        self.num_slots = placement.num_slots if layout.has_slots else 0
        stride = placement.page_stride or layout.page_bytes
        if stride < layout.page_bytes:
            raise ValueError(f"a page stride of {stride} bytes for {layout.page_bytes}-byte pages")
        if buffer is None:
            make = torch.zeros if zero else torch.empty
            buffer = make(placement.arena_bytes, dtype=torch.uint8, device=device, pin_memory=pin)
        elif buffer.numel() < self.num_pages * stride:
            raise ValueError(f"a {buffer.numel()}-byte buffer for {self.num_pages} pages")
        self.buffer = buffer
        page_bytes = layout.page_bytes
        rows = self.buffer[: self.num_pages * stride].view(self.num_pages, stride)
        self.page_rows = rows[:, :page_bytes]
        self.pages = self.page_rows.view(layout.dtype).view(self.num_pages, *layout.page_shape)
        self.slot_rows: Tensor | None = None
        self.delta: Tensor | None = None
        self.conv: Tensor | None = None
        if self.num_slots:
            stride = placement.slot_stride
            first = placement.slot_offset
            rows = self.buffer[first : first + self.num_slots * stride].view(self.num_slots, stride)
            self.slot_rows = rows[:, : layout.state_bytes]
        if self.num_slots and layout.stateful:
            split = layout.delta_bytes
            self.delta = rows[:, :split].view(torch.float32).view(-1, *layout.delta_shape)
            self.conv = (
                rows[:, split : layout.state_bytes].view(layout.dtype).view(-1, *layout.conv_shape)
            )

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


def land(
    dst: Arena,
    src: Arena,
    page_pairs: Sequence[tuple[bytes, bytes]],
    slot_pairs: Sequence[tuple[bytes, bytes]],
) -> None:
    """Copy pages and slots from ``src`` to ``dst``: each pair is (source ids, destination
    ids) as little-endian uint32 bytes, as the cache's plans carry them. One gather and one
    scatter per kind for the whole list; a destination named twice gets its last copy."""
    _copy_rows(dst.page_rows, src.page_rows, page_pairs)
    if dst.slot_rows is not None and src.slot_rows is not None:
        _copy_rows(dst.slot_rows, src.slot_rows, slot_pairs)


def _copy_rows(dst: Tensor, src: Tensor, pairs: Sequence[tuple[bytes, bytes]]) -> None:
    src_ids = np.frombuffer(b"".join(s for s, _ in pairs), dtype="<u4")
    dst_ids = np.frombuffer(b"".join(d for _, d in pairs), dtype="<u4")
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"a plan pairs {len(src_ids)} sources with {len(dst_ids)} destinations")
    if not len(dst_ids):
        return
    # Keep each destination's last copy: unique over the reversed list finds last occurrences.
    _, last = np.unique(dst_ids[::-1], return_index=True)
    keep = np.sort(len(dst_ids) - 1 - last)
    s = torch.from_numpy(src_ids[keep].astype(np.int64))
    d = torch.from_numpy(dst_ids[keep].astype(np.int64))
    rows = src.index_select(0, s.to(src.device))
    dst.index_copy_(0, d.to(dst.device), rows.to(dst.device))
