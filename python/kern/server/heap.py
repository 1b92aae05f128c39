"""Heap the process freed, given back to the system while it serves.

glibc keeps the memory a freed tensor or buffer leaves behind inside its arenas for reuse, and
under a serving mix (many sizes, several threads) that free-but-kept heap fragments and grows:
in a soak of ``kern serve`` (``python -m kern.bench.soak``), glibc's bytes in use were flat
after the first minute while its free-but-kept heap went from 32 to 217 MiB, and RSS with it.
``malloc_trim(0)`` hands the free pages of every arena back (it also releases whole free pages
inside a heap, not only its top), so RSS follows what is in use. It runs every
:data:`TRIM_INTERVAL` seconds in a worker thread: the event loop never waits for it, and the
scheduler thread only meets it at an arena lock, one arena at a time.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
from collections.abc import Callable

__all__ = ["TRIM_INTERVAL", "trim_forever", "trimmer"]

log = logging.getLogger("kern.server")

TRIM_INTERVAL = 10.0


def trimmer() -> Callable[[], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


async def trim_forever(interval: float = TRIM_INTERVAL) -> None:
    """Trim the heap every ``interval`` seconds until cancelled."""
    trim = trimmer()
    if trim is None:
        log.debug("no malloc_trim in this C library: freed heap stays with the process")
        return
    while True:
        await asyncio.sleep(interval)
        await asyncio.to_thread(trim)
