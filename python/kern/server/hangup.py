"""How far the scheduler may run ahead of the event loop (:class:`StepGate`), which bounds what
a client's hang-up costs whatever the machine's load.

Why: a hang-up reaches kern on the event loop (``http.disconnect`` from ``receive()``), and the
abort lands at the scheduler's next step. Events used to cross with a bare
``call_soon_threadsafe``, so nothing held the scheduler back when the loop fell behind (a
starved process, a GIL convoy): it could run a request to its end while the loop had written
three events, and a client leaving after those three cost the whole answer. With the gate the
scheduler delivers step N + ``ahead`` only once the loop has dispatched step N, so from the
moment the loop reads the hang-up, the request runs at most ``ahead`` + 1 more steps (the step
in progress and the ones already let through). The loop is never held: a slow client's stream
queues on its own handler, and the rest of the batch goes on.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["DEFAULT_STEPS_AHEAD", "StepGate"]

# Steps the scheduler may have delivered that the event loop has not dispatched yet: two keep
# the loop's work and the next step's forward overlapping, and a hang-up costs at most three
# steps.
DEFAULT_STEPS_AHEAD = 2
# How often a held scheduler thread looks whether the loop still runs (it never waits on a
# loop that stopped or closed: shutdown and the crash path deliver through the gate too).
_POLL_SECONDS = 0.05

T = TypeVar("T")


class StepGate:
    """Delivers a step's events from the scheduler thread to the event loop, holding that
    thread while ``ahead`` earlier deliveries wait for the loop."""

    def __init__(self, ahead: int = DEFAULT_STEPS_AHEAD) -> None:
        if ahead < 1:
            raise ValueError("ahead must be >= 1")
        self.ahead = ahead
        self._cv = threading.Condition()
        self._pending = 0

    @property
    def pending(self) -> int:
        """Deliveries the loop has not dispatched yet."""
        return self._pending

    def deliver(
        self, loop: asyncio.AbstractEventLoop, dispatch: Callable[[T], None], events: T
    ) -> None:
        """From the scheduler thread: ``dispatch(events)`` on ``loop``, once fewer than ``ahead``
        deliveries are pending (at once if the loop is not running: nobody would dispatch)."""
        with self._cv:
            while self._pending >= self.ahead and loop.is_running() and not loop.is_closed():
                self._cv.wait(_POLL_SECONDS)
            if loop.is_closed():
                return
            self._pending += 1
        try:
            loop.call_soon_threadsafe(self._dispatch, dispatch, events)
        except RuntimeError:  # closed in between
            self._done()

    def _dispatch(self, dispatch: Callable[[T], None], events: T) -> None:
        try:
            dispatch(events)
        finally:
            self._done()

    def _done(self) -> None:
        with self._cv:
            self._pending -= 1
            self._cv.notify()
