"""The scheduler's thread: the one thread that loads the model and then runs every torch op of
the process (``kern.engine.scheduler.Scheduler.run``)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Protocol, TypeVar

__all__ = ["start_scheduler"]


class _Loop(Protocol):
    def run(self) -> None: ...


S = TypeVar("S", bound=_Loop)


def start_scheduler(make: Callable[[], S]) -> S:
    """Call ``make`` (load the checkpoint, build the runner, cache and scheduler) on a new
    thread, run the scheduler's loop there, and return the scheduler once built (``make``'s
    exception, if it raised).

    Why one thread for every torch op of the process: libgomp keeps a worker pool per thread
    that starts parallel regions, and with two such pools on 2 cores it stops spinning and
    wakes its workers by futex for every op. Measured at 2 threads: an add of 64 x 3072 took
    17 us from one thread and 86 us once another had run torch ops; a batch-64 decode step of
    the ~30M bench model, 44 ms when loaded and run on one thread, 118 ms when loaded on
    another.
    """
    built: queue.Queue[S | BaseException] = queue.Queue(maxsize=1)

    def main() -> None:
        try:
            sched = make()
        except BaseException as e:  # noqa: BLE001 - handed to the caller, re-raised there
            built.put(e)
            return
        built.put(sched)
        sched.run()

    threading.Thread(target=main, name="kern-scheduler", daemon=True).start()
    got = built.get()
    if isinstance(got, BaseException):
        raise got
    return got
