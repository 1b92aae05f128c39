"""HTTP helpers shared by the ASGI transport (kern.app) and the handlers: the ASGI callables'
types, a whole response, a batch of SSE events, and the markers a generating handler's queue
carries beside the scheduler's events. A leaf: it imports nothing of kern.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = [
    "DONE",
    "JSON",
    "headers_only",
    "SSE",
    "Disconnected",
    "Headers",
    "Marker",
    "Receive",
    "Scope",
    "Send",
    "respond",
    "send_sse",
]

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

JSON: Headers = [(b"content-type", b"application/json")]
SSE: Headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
# The last event of every stream.
DONE = b"data: [DONE]\n\n"


class Marker(enum.Enum):
    """Queued for a generating handler beside its sequences' events."""

    HANGUP = "hangup"  # its client disconnected
    SHUTDOWN = "shutdown"  # the server drains


class Disconnected(Exception):
    """The client hung up: nothing more is sent, and the request logs it as its error."""


async def respond(send: Send, status: int, body: bytes, headers: Headers | None = None) -> None:
    """A whole response: ``body`` with ``headers`` (default: JSON)."""
    await send({"type": "http.response.start", "status": status, "headers": headers or JSON})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_sse(send: Send, lines: list[bytes]) -> None:
    """``lines`` as one write of SSE events (none: no write), the stream kept open."""
    if lines:
        body = b"".join(b"data: " + line + b"\n\n" for line in lines)
        await send({"type": "http.response.body", "body": body, "more_body": True})


def headers_only(send: Send) -> Send:
    """``send`` for a HEAD request: the GET response's status and headers, no body."""

    async def send_head(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            message = {"type": "http.response.body", "body": b"", "more_body": False}
        await send(message)

    return send_head
