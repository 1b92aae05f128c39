"""The KV cache books, re-exported from the Rust extension ``kern._pool``.

Ids cross as buffers: pass token ids and page ids as numpy uint32 arrays, ``array('I')`` or
bytes; page lists come back as ``bytes`` of little-endian uint32. The conversions are owned here,
as tiktoken's ``Encoding`` owns its numpy handling: :func:`u32` makes the buffer from a list of
ids, :func:`ids` reads one back as a list.

Contract with the caller (the scheduler), one call per operation:

- ``match(tokens)`` returns the longest cached prefix and **locks** it: call ``unlock(m.node)``
  once when done (``m.node`` is None without a hit). It refreshes exactly the path it read and
  splits the node it stopped in right after the last page it read (never a parked one). The
  pages it returns stay valid while that lock is held.
- A hit that ends mid-page shares that page: copy it into a page of your own before writing
  past the hit (``insert`` refuses a shared page extended in place).
- ``insert(tokens, pages, state)`` leaves every page passed (and the state slot) the tree's or
  free: it frees your duplicates itself. Pages you keep reading after it must be re-read from a
  ``match`` of the same tokens.
- ``make_room(pages, slots)`` evicts until that many pages and slots can be allocated together
  (a no-op when they fit) and frees device pages at once in the books: land each park plan in
  ``room.evicted`` (device -> host copies) before allocating again. ``wake`` returns
  host -> device copies to land before the woken pages are read.
- ``take_pages(n)`` is ``make_room(n)`` and, when the room fits, ``n`` pages allocated, in one
  call, returning ``(pages, room)`` (``pages`` None when it does not fit); land the park
  plans in ``room`` before writing the pages.
- ``release(tokens, pages, *, state, node, free)`` ends a request in one call: the
  ``insert``, the ``unlock`` of its match's lock and the ``free_pages`` of its pages past the
  key, every check before anything changes.
- Every error is raised before anything changes.
"""

from collections.abc import Sequence

import numpy as np

from kern import _pool
from kern._pool import *  # noqa: F403  (the extension's names)

__all__ = [*_pool.__all__, "ids", "u32"]


def u32(ids: Sequence[int]) -> np.ndarray:
    """Token or page ids as the uint32 buffer every call takes (a copy)."""
    return np.asarray(ids, dtype=np.uint32)


def ids(buf: bytes) -> list[int]:
    """A returned buffer of uint32 ids (``Match.pages``, ``take_pages``) as a list."""
    return np.frombuffer(buf, dtype=np.uint32).tolist()
