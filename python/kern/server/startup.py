"""How the process ends when the app cannot start under a plain ASGI server
(``hypercorn kern.app:app``): :func:`exit_failed_start`.

Design notes
------------
* ``kern serve`` loads before it serves, so its mistakes are one line and exit 2 (kern.cli).
  Under hypercorn the lifespan startup loads; answering ``lifespan.startup.failed`` there made
  hypercorn 0.18 raise its ``LifespanFailureError`` through the app (a 51-line traceback) and
  the command exit 0. So a failed start prints one line (``kern: error: ...``) for a user's
  mistake, the traceback for anything else, and ends the process at once with 2 or 1: nothing
  of it can serve.
* hypercorn 0.18 runs the app in a worker process (``--workers 1`` by default), and its
  supervisor returns 0 whatever the worker's exit code (``hypercorn.run.run`` joins the exited
  workers a second time and keeps that result; pgjones/hypercorn#269). So when this process is
  such a worker and its parent is still that supervisor, the supervisor is ended with SIGKILL
  first, and the command exits non-zero (killed: 137 in a shell) instead of 0. With
  ``--workers 0`` the app runs in hypercorn's own process, which exits 2 itself.
* A supervisor so ended leaves the semaphores of its shutdown event (handed to this worker) to
  multiprocessing's resource tracker, which would clean them up with a warning of its own on
  stderr; this worker removes them first, as their owner would have (``SemLock._cleanup``).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
import os
import signal
import sys
import traceback
from typing import NoReturn

from kern.checkpoint.errors import CheckpointError
from kern.errors import UsageError
from kern.kern_toml import TomlConfigError

__all__ = ["USAGE_EXIT_CODE", "exit_failed_start"]

# A user's mistake, as every kern command exits with one (kern.cli).
USAGE_EXIT_CODE = 2


def exit_failed_start(error: BaseException) -> NoReturn:
    """Say why the start failed (one line for a user's mistake) and end the process: 2 for a
    user's mistake, 1 otherwise (see the design notes for hypercorn's supervisor)."""
    if isinstance(error, UsageError | CheckpointError | TomlConfigError):
        print(f"kern: error: {error}", file=sys.stderr)
        code = USAGE_EXIT_CODE
    else:
        traceback.print_exception(error)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    supervisor = _hypercorn_supervisor()
    if supervisor is not None:
        _remove_semaphores(getattr(multiprocessing.current_process(), "_kwargs", {}))
        os.kill(supervisor, signal.SIGKILL)
    os._exit(code)


def _hypercorn_supervisor() -> int | None:
    """The pid of the hypercorn process that started this one as its worker, while it is still
    this process's parent; None otherwise (run by hypercorn --workers 0, or another server)."""
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None or os.getppid() != parent.pid:
        return None
    worker = getattr(multiprocessing.current_process(), "_target", None)
    if not getattr(worker, "__module__", "").startswith("hypercorn."):
        return None
    return parent.pid


def _remove_semaphores(kwargs: dict[str, object]) -> None:
    """Unlink the semaphores the supervisor handed to this worker (its shutdown event's: the
    event, its condition's lock and counters) and take them off the resource tracker's list."""
    found: list[multiprocessing.synchronize.SemLock] = []
    for value in kwargs.values():
        parts = [value, *vars(value).values()] if hasattr(value, "__dict__") else [value]
        for part in parts:
            inner = vars(part).values() if hasattr(part, "__dict__") else ()
            found += [
                x for x in (part, *inner) if isinstance(x, multiprocessing.synchronize.SemLock)
            ]
    for lock in dict.fromkeys(found):
        name = getattr(getattr(lock, "_semlock", None), "name", None)
        if name is not None:
            try:
                multiprocessing.synchronize.SemLock._cleanup(name)  # type: ignore[attr-defined]
            except OSError:
                pass
