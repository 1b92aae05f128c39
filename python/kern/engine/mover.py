"""What the cache's books (``kern.engine.memory``, ``kern.engine.sharing``,
``kern.engine.window_pages``) ask of the runner and of each other, as protocols: the one
module all three import, so none imports another's class to name its type."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kern.metrics import Metrics
from kern.pool import Cache, CopyPlan, Match

__all__ = ["Books", "HitRule", "Mover"]


class HitRule(Protocol):
    """What memory asks of the runner's page kind (``kern.models.pages.Pages``): which prefix
    hits a sequence may resume at."""

    prompt_snapshots: bool

    def hit_key(self, tokens: Sequence[int]) -> Sequence[int]: ...
    def exact_hit(self, match: Match, hit: int) -> int: ...


class Mover(Protocol):
    """What memory asks of the runner (``kern.engine.runner.Runner``): the copies that land
    the cache's plans and the copy-on-write of pages and slots, and its page kind's rules."""

    stateful: bool
    window_tokens: int
    pages: HitRule

    def park(self, plans: Sequence[CopyPlan]) -> None: ...
    def wake(self, plan: CopyPlan) -> None: ...
    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None: ...
    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None: ...
    def snapshot_window(self, window: Sequence[int], end: int, dst: int) -> None: ...
    def restore_window(self, src: int, dst: Sequence[int]) -> None: ...


class Books(Protocol):
    """What window pages (``kern.engine.window_pages``) ask of the cache's books
    (``kern.engine.memory.Memory``): room, and the pieces the books hold."""

    cache: Cache
    runner: Mover
    metrics: Metrics
    page_tokens: int
    window: int

    def make_room(self, pages: int, slots: int = 0) -> bool: ...
    def drop_drafts(self) -> bool: ...
    def wake_path(self, key: object) -> bool: ...
