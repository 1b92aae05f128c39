"""kern.server.heap: the freed heap a serving process keeps goes back to the system."""

from __future__ import annotations

import subprocess
import sys

# In a fresh interpreter: fragment the heap (keep every 16th of 2,048 blocks of 64 KiB, below
# glibc's mmap threshold, so the freed ones stay in the arena), then trim.
SCRIPT = """
import gc
from kern.server.heap import trimmer

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

blocks = [bytearray(b"x" * 65536) for _ in range(2048)]
kept = blocks[::16]
del blocks
gc.collect()
before = rss()
trim = trimmer()
assert trim is not None, "glibc has malloc_trim"
trim()
print(before - rss(), len(kept))
"""


def test_trim_gives_freed_heap_back() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    released, kept = (int(x) for x in out.stdout.split())
    assert kept == 128
    # 1,920 blocks (120 MiB) were freed between the kept ones: most of it must come back.
    assert released > 64 * 2**20, released
