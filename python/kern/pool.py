"""The KV cache books, re-exported from the Rust extension ``kern._pool``.

Ids cross as buffers: pass token ids and page ids as numpy uint32 arrays, ``array('I')`` or
bytes; page lists come back as ``bytes`` of little-endian uint32 (``np.frombuffer(b, np.uint32)``
views them without a copy).

Contract with the caller (the scheduler):

- ``match`` touches the LRU order of the hit's path but never splits a node. The pages it
  returns stay valid only while the hit's node is locked.
- A hit that ends mid-page shares that page: copy it into a page of your own before writing
  past the hit (``insert`` refuses a shared page extended in place).
- ``make_room`` frees device pages at once in the books: land each returned plan (device ->
  host copies) before allocating again. ``wake`` returns host -> device copies to land before
  the woken pages are read.
- Every error is raised before anything changes.
"""

from kern._pool import *  # noqa: F403  (the names and __all__ are the extension's)
from kern._pool import __all__  # noqa: F401
