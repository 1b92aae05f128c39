"""The current HTTP request's record (a kern.server.logs.RequestRecord): the app sets it (each
ASGI request runs in its own task and context), the handlers fill it. It lives apart from
kern.server.logs, which formats the record, so that the lowest layer (kern.server.api) can
name the request a warning is about without importing what imports it."""

from __future__ import annotations

import contextvars
from typing import Any

__all__ = ["RECORD", "current_id"]

RECORD: contextvars.ContextVar[Any] = contextvars.ContextVar("kern_request", default=None)


def current_id() -> str:
    """The current request's id, or "-" outside one."""
    record = RECORD.get()
    return record.id if record is not None else "-"
