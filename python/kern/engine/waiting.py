"""The scheduler's waiting queue (:class:`Waiting`): first come, first served within a
priority, lower priority values first (vLLM's ``priority``)."""

from __future__ import annotations

from collections import deque

from kern.engine.request import Request

__all__ = ["Waiting"]


class Waiting(deque[Request]):
    """Requests waiting for admission, the head admitted first."""

    def add(self, req: Request, *, behind: bool) -> None:
        """Queue ``req`` by priority: behind the waiting ones of its priority (a new request)
        or in front of them (a preempted one, which resumes first)."""
        p = req.priority
        if behind and (not self or self[-1].priority <= p):
            self.append(req)  # the common case: one priority
            return
        later = (lambda r: r.priority > p) if behind else (lambda r: r.priority >= p)
        self.insert(next((i for i, r in enumerate(self) if later(r)), len(self)), req)
