"""Stubs for the Rust extension kern._pool (checked by mypy.stubtest in CI)."""

from typing import final

from typing_extensions import Buffer, disjoint_base

__all__ = [
    "BudgetTooSmall",
    "Cache",
    "CacheCorrupt",
    "CopyPlan",
    "EntryKey",
    "Evicted",
    "Geometry",
    "Inserted",
    "InvalidArgument",
    "LengthMismatch",
    "Match",
    "NoHostTier",
    "NotAllocated",
    "NotLocked",
    "NotU32",
    "OwnedByCache",
    "PoolFull",
    "RepeatedId",
    "Room",
    "SharedPageExtended",
    "Stats",
    "UnknownNode",
    "Woken",
]

@final
class Match:
    """The longest cached prefix of a key."""

    @property
    def hit_len(self) -> int: ...
    @property
    def resident_len(self) -> int: ...
    @property
    def node(self) -> int | None: ...
    @property
    def pages(self) -> bytes: ...
    @property
    def state_len(self) -> int | None: ...
    @property
    def state_slot(self) -> int | None: ...

@final
class Inserted:
    """What ``Cache.insert`` did: how many parked entries the caller's pages made resident
    (woken without a copy)."""

    @property
    def woken(self) -> int: ...

@final
class EntryKey:
    """A tree entry: where its own tokens start and end in its path. ``tokens`` (the whole
    path) is None unless the cache records paths, which only tests ask for."""

    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...
    @property
    def tokens(self) -> bytes | None: ...

@final
class CopyPlan:
    """Copies the runner lands, one batched index copy per list: ``src_pages[i]`` to
    ``dst_pages[i]``, ``src_states[i]`` to ``dst_states[i]``. A park plan copies device to
    host, a wake plan host to device."""

    @property
    def src_pages(self) -> bytes: ...
    @property
    def dst_pages(self) -> bytes: ...
    @property
    def src_states(self) -> bytes: ...
    @property
    def dst_states(self) -> bytes: ...
    @property
    def num_pages(self) -> int: ...

@final
class Woken:
    """What ``Cache.wake`` brought back: the host-to-device copies to land before the pages are
    read, and the entries woken."""

    @property
    def plan(self) -> CopyPlan: ...
    @property
    def keys(self) -> list[EntryKey]: ...

@disjoint_base
class Evicted:
    @final
    class Parked(Evicted):
        __match_args__ = ("key", "plan", "dropped")
        def __new__(
            cls, key: EntryKey, plan: CopyPlan, dropped: list[EntryKey]
        ) -> Evicted.Parked: ...
        @property
        def key(self) -> EntryKey: ...
        @property
        def plan(self) -> CopyPlan: ...
        @property
        def dropped(self) -> list[EntryKey]: ...

    @final
    class Dropped(Evicted):
        __match_args__ = ("key", "parked")
        def __new__(cls, key: EntryKey, parked: bool) -> Evicted.Dropped: ...
        @property
        def key(self) -> EntryKey: ...
        @property
        def parked(self) -> bool: ...

@final
class Room:
    """What ``Cache.make_room`` or ``Cache.take_pages`` did: the steps of the loop (land each
    park plan before allocating or writing the pages) and whether the room is there. What they
    freed is counted from the steps."""

    @property
    def evicted(self) -> list[Evicted]: ...
    @property
    def fits(self) -> bool: ...

@final
class Geometry:
    """How one arena is cut: page ``p`` at byte ``p * page_bytes``, slot ``s`` at
    ``s * slot_stride``; the arena is ``num_chunks * chunk_bytes`` bytes."""

    @property
    def chunk_bytes(self) -> int: ...
    @property
    def num_chunks(self) -> int: ...
    @property
    def page_bytes(self) -> int: ...
    @property
    def pages_per_chunk(self) -> int: ...
    @property
    def slot_stride(self) -> int: ...
    @property
    def slots_per_chunk(self) -> int: ...
    @property
    def num_pages(self) -> int: ...
    @property
    def num_slots(self) -> int: ...
    @property
    def arena_bytes(self) -> int: ...

@final
class Stats:
    """Counters of the device pool, the host tier and the tree (what the gauges read).
    Evictions are counted from the returned ``Evicted`` values alone."""

    @property
    def chunk_bytes(self) -> int: ...
    @property
    def free_chunks(self) -> int: ...
    @property
    def pages_used(self) -> int: ...
    @property
    def pages_free(self) -> int: ...
    @property
    def slot_capacity(self) -> int: ...
    @property
    def slots_used(self) -> int: ...
    @property
    def slots_free(self) -> int: ...
    @property
    def host_pages_used(self) -> int: ...
    @property
    def host_pages_free(self) -> int: ...
    @property
    def host_slots_used(self) -> int: ...
    @property
    def num_nodes(self) -> int: ...
    @property
    def resident_pages(self) -> int: ...
    @property
    def parked_pages(self) -> int: ...
    @property
    def resident_states(self) -> int: ...
    @property
    def parked_states(self) -> int: ...

@final
class Cache:
    """kern's KV cache books: the device pool, the host tier and the prefix tree."""

    def __new__(
        cls,
        *,
        page_tokens: int,
        page_bytes: int,
        device_bytes: int,
        state_bytes: int = 0,
        host_bytes: int = 0,
        min_slots: int = 2,
    ) -> Cache: ...
    @property
    def page_tokens(self) -> int: ...
    @property
    def device(self) -> Geometry: ...
    @property
    def host(self) -> Geometry | None: ...
    @property
    def pages_free(self) -> int: ...
    def match(self, tokens: Buffer) -> Match:
        """The longest cached prefix, locked: ``unlock(m.node)`` once when done. Refreshes and
        locks exactly the path read; splits the node it stops in (never a parked one)."""

    def unlock(self, node: int) -> None:
        """Release one lock ``match`` took on ``node``; ``NotLocked`` for any other handle,
        one that names no live node included."""

    def insert(self, tokens: Buffer, pages: Buffer, state: int | None = None) -> Inserted:
        """Give a request's tokens, pages and state snapshot to the tree: it takes what it
        lacks and frees the rest. Raises (changing nothing) on a foreign or repeated page."""

    def make_room(self, pages: int = 0, slots: int = 0, park: bool = True) -> Room:
        """Evict until ``pages`` pages and ``slots`` slots can be allocated together; land each
        park plan before allocating. Room that could not fit even in an empty pool (the state
        slots' starting chunks are never pages') evicts nothing. A call that evicted nothing
        returns one of two shared ``Room`` objects. ``park=False`` drops instead of parking
        (the scheduler never asks for it; it is how a test empties a cache with a host tier)."""

    def take_pages(self, n: int) -> tuple[bytes | None, Room]:
        """``make_room(n)`` and, when the room fits, ``n`` pages allocated, in one call:
        ``(pages, room)``, ``pages`` None when ``room.fits`` is False. Land each park plan
        before writing the pages. A call that evicted nothing returns one of two shared
        ``Room`` objects (one that fits, one that does not), the same each time."""

    def release(
        self,
        tokens: Buffer,
        pages: Buffer,
        *,
        state: int | None = None,
        node: int | None = None,
        free: Buffer = b"",
    ) -> Inserted:
        """The end of a request: ``insert(tokens, pages, state)``, ``unlock(node)`` and
        ``free_pages(free)`` in one call. Every check runs before anything changes (a page
        named in both ``pages`` and ``free`` is ``RepeatedId``). ``state`` and ``node`` are
        both ints, so they are keyword-only: a swapped pair cannot pass by position."""

    def wake(self, node: int) -> Woken:
        """Bring the parked part of ``node``'s path back, all or nothing (``PoolFull``), and
        refresh the path: a wake is a use, with nothing parked too."""

    def free_pages(self, pages: Buffer) -> None: ...
    def alloc_slot(self) -> int: ...
    def free_slot(self, slot: int) -> None: ...
    def stats(self) -> Stats: ...
    def check_integrity(self) -> None: ...
    # Test-only (see .mypy-stubtest-allowlist): a match that changes nothing, and keys that
    # carry their token paths.
    def _peek(self, tokens: Buffer) -> Match: ...
    def _record_paths(self, on: bool) -> None: ...

class PoolFull(RuntimeError): ...
class BudgetTooSmall(ValueError): ...
class NotAllocated(ValueError): ...
class RepeatedId(ValueError): ...
class OwnedByCache(ValueError): ...
class UnknownNode(KeyError): ...
class NotLocked(ValueError): ...
class LengthMismatch(ValueError): ...
class SharedPageExtended(ValueError): ...
class NotU32(TypeError): ...
class NoHostTier(RuntimeError): ...
class InvalidArgument(ValueError): ...
class CacheCorrupt(RuntimeError): ...
