"""Rank 0's runner over N ranks: each call that changes what a rank holds is broadcast once,
then run here (see the package's design notes)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from kern.chunk import SeqChunk
from kern.engine.runner import Runner
from kern.pool import CopyPlan

__all__ = ["RankedRunner"]


@dataclass(frozen=True, slots=True)
class _Plan:
    """A CopyPlan's four id lists (little-endian uint32 bytes), as a picklable value."""

    src_pages: bytes
    dst_pages: bytes
    src_states: bytes
    dst_states: bytes

    @classmethod
    def of(cls, p: CopyPlan) -> _Plan:
        return cls(bytes(p.src_pages), bytes(p.dst_pages), bytes(p.src_states), bytes(p.dst_states))


# Runner methods that change nothing a rank holds: rank 0 runs them alone.
_READ_ONLY = frozenset({"kv_at"})


class RankedRunner:
    """Rank 0's runner: each call that changes what a rank holds is sent to every rank with
    ``send`` (the control broadcast), then run here under ``guard`` (a collective's fault
    context, :meth:`kern.engine.ranks.launch.Ranks.guard`); everything else is the local
    runner's."""

    def __init__(
        self,
        runner: Runner,
        send: Callable[[tuple[str, tuple[Any, ...]]], None],
        guard: Callable[[], AbstractContextManager[None]],
    ) -> None:
        self._runner = runner
        self._send = send
        self._guard = guard
        self.broadcast_seconds = 0.0
        self.broadcasts = 0

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._runner, name)
        if callable(value) and name not in _READ_ONLY:
            # A runner method this wrapper does not broadcast would change rank 0 alone and
            # leave the ranks apart: refuse it loudly instead.
            raise AttributeError(
                f"Runner.{name} is not broadcast to the other ranks "
                "(kern.engine.ranks.runner.RankedRunner)"
            )
        return value

    def _call(self, name: str, *args: Any) -> Any:
        t0 = time.perf_counter()
        self._send((name, args))
        self.broadcast_seconds += time.perf_counter() - t0
        self.broadcasts += 1
        with self._guard():
            return getattr(self._runner, name)(*args)

    def forward(self, batch: Sequence[SeqChunk]) -> Tensor:
        return self._call("forward", list(batch))

    def keep_rows(self, slot: int, num_rows: int) -> None:
        self._call("keep_rows", slot, num_rows)

    def rewind(
        self,
        block_table: Sequence[int],
        start_pos: int,
        slot: int | None,
        num_rows: int,
        window: Sequence[int] | None = None,
    ) -> None:
        # Broadcast only what changes something: a stateless target on plain pages has
        # nothing to rewind.
        if self._runner.rewinds:
            window = None if window is None else list(window)
            self._call("rewind", list(block_table), start_pos, slot, num_rows, window)

    def snapshot_window(self, window: Sequence[int], end: int, dst: int) -> None:
        self._call("snapshot_window", list(window), end, dst)

    def restore_window(self, src: int, dst: Sequence[int]) -> None:
        self._call("restore_window", src, list(dst))

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self._call("copy_pages", list(src), list(dst))

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self._call("copy_slots", list(src), list(dst))

    def park(self, plans: Sequence[CopyPlan]) -> None:
        self._call("park", [_Plan.of(p) for p in plans])

    def wake(self, plan: CopyPlan) -> None:
        self._call("wake", _Plan.of(plan))
