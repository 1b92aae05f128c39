"""Budgets checked before anything is allocated: a ``pool_bytes`` or ``host_bytes`` the machine
cannot give is one line naming the key, the size asked and what the machine has
(:func:`check_budgets`), not an allocator's traceback after the weights were read.

Design notes
------------
* What the machine has: host memory is the least of ``MemAvailable`` (/proc/meminfo) and what
  the process's memory cgroup has left (``memory.max`` less ``memory.current`` on cgroup v2,
  ``memory.limit_in_bytes`` less ``memory.usage_in_bytes`` on v1); a CUDA device's is
  ``torch.cuda.mem_get_info``'s free bytes. A figure that cannot be read is no limit: the check
  refuses only what is certainly too much, and the allocation stays the last word.
* ``pool_bytes`` is device memory (host memory on the CPU backend), ``host_bytes`` is always
  host memory; on the CPU both come from the same memory, so their sum is checked too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kern.errors import UsageError
from kern.kern_toml import Target

__all__ = ["Memory", "check_budgets", "format_bytes", "host_memory"]

_CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1's "no limit" is a huge page-aligned number; anything this large is no limit.
_NO_LIMIT = 1 << 60


@dataclass(frozen=True)
class Memory:
    """What one kind of memory has left: ``free`` bytes, and where the figure comes from."""

    free: int
    source: str


def format_bytes(n: int) -> str:
    """``n`` in the largest binary unit that keeps it at least 1 ("30TiB", "17.8GiB")."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f}".removesuffix(".0") + unit
    return f"{n}B"


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_dirs(controller: str) -> list[Path]:
    """The process's cgroup folders for ``controller`` ("" for v2), then the mount's root (a
    container sees its own cgroup there)."""
    out = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, names, path = line.split(":", 2)
        if (controller in names.split(",")) if controller else names == "":
            base = _CGROUP_ROOT / controller if controller else _CGROUP_ROOT
            out.append(base / path.lstrip("/"))
    out.append(_CGROUP_ROOT / controller if controller else _CGROUP_ROOT)
    return out


def _cgroup_left() -> Memory | None:
    """What the memory cgroup lets this process still take, or None without a limit."""
    for where, limit_file, used_file in (
        ("", "memory.max", "memory.current"),
        ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes"),
    ):
        for d in _cgroup_dirs(where):
            limit = _read_int(d / limit_file)  # "max" (v2's no limit) reads as None
            if limit is None or limit >= _NO_LIMIT:
                continue
            used = _read_int(d / used_file) or 0
            return Memory(max(0, limit - used), f"cgroup {limit_file} {format_bytes(limit)}")
    return None


def host_memory() -> Memory | None:
    """Host memory this process can still take (see the design notes), or None if unknown."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(Memory(int(line.split()[1]) * 1024, "MemAvailable"))
    except (OSError, ValueError, IndexError):
        pass
    cgroup = _cgroup_left()
    if cgroup is not None:
        found.append(cgroup)
    return min(found, key=lambda m: m.free, default=None)


def _device_memory(device: str) -> Memory | None:
    """Free memory of a CUDA ``device`` ("cuda", "cuda:1"), or None when unknown."""
    import torch

    if not torch.cuda.is_available():
        return None  # the backend says so itself, by name
    try:
        free, _ = torch.cuda.mem_get_info(torch.device(device))
    except (RuntimeError, ValueError, AssertionError):
        return None
    return Memory(free, f"free on {device}")


def _refuse(target: Target, key: str, asked: int, has: Memory, what: str) -> UsageError:
    return UsageError(
        f"{target.where(key)}: {key} = {format_bytes(asked)} ({asked} bytes) is more than "
        f"the machine has: {format_bytes(has.free)} of {what} ({has.source})"
    )


def check_budgets(target: Target) -> None:
    """Raise a :class:`UsageError` naming the key when ``target``'s ``pool_bytes`` or
    ``host_bytes`` is more than this machine has (a ranked target: its first rank's device)."""
    pool, host_bytes = target.pool_bytes, target.host_bytes
    device = target.device
    on_cuda = device.startswith("cuda")
    host = host_memory() if (host_bytes or (pool and not on_cuda)) else None
    if pool:
        if on_cuda:
            dev = _device_memory(device if ":" in device or target.ranks < 2 else "cuda:0")
            if dev is not None and pool > dev.free:
                raise _refuse(target, "pool_bytes", pool, dev, "device memory")
        elif host is not None and pool > host.free:
            raise _refuse(target, "pool_bytes", pool, host, "host memory")
    if host_bytes and host is not None:
        if host_bytes > host.free:
            raise _refuse(target, "host_bytes", host_bytes, host, "host memory")
        if pool and not on_cuda and pool + host_bytes > host.free:
            raise UsageError(
                f"{target.where('pool_bytes')}, {target.where('host_bytes')}: pool_bytes + "
                f"host_bytes = {format_bytes(pool + host_bytes)} is more than the machine has: "
                f"{format_bytes(host.free)} of host memory ({host.source}; both are host "
                "memory on the CPU)"
            )
