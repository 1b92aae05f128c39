"""Checks on a request's head before anything reads its body: how the body is framed, and
whether a response leaves before the body has arrived whole.

Why here and not in the HTTP server: h11 (under hypercorn) accepts a request with both
``Content-Length`` and ``Transfer-Encoding`` (it frames by the latter, RFC 9112 6.3) and a
``Transfer-Encoding`` on HTTP/1.0, which has none. A proxy in front may frame either one by
the other header, which is how requests are smuggled; RFC 9112 6.1 lets a server refuse both,
and kern does, with a 400 in OpenAI's error shape, closing the connection (whatever follows on
it cannot be trusted to start a request).

A response sent before the request's body was received whole (a 401, 404, 405, 413, 415 or
503 decided from the head) says ``Connection: close``: hypercorn closes such a connection
after the response, since the unread body stands between it and the next request, but
without the header the client keeps it for its next request, which then meets the close
("Server disconnected without sending a response", or a reset). The soak saw 1-2 of those a
run until this header went out.
"""

from __future__ import annotations

from typing import Any

from kern.server.api import ApiError
from kern.server.http import Receive, Scope

__all__ = ["UnreadBody", "check_framing"]

_CLOSE = [(b"connection", b"close")]


def check_framing(scope: Scope) -> None:
    """Raise a 400 (``ambiguous_framing``) for a body framed two ways, or chunked on HTTP/1.0."""
    if not scope.get("http_version", "1.1").startswith("1."):
        return  # HTTP/2 frames bodies itself; h2 refuses these headers
    names = {k for k, _ in scope["headers"]}
    if b"transfer-encoding" not in names:
        return
    if b"content-length" in names:
        raise ApiError(
            400,
            "the request has both Content-Length and Transfer-Encoding: its body's length is "
            "ambiguous (send one of them)",
            code="ambiguous_framing",
            headers=_CLOSE,
        )
    if scope["http_version"] == "1.0":
        raise ApiError(
            400,
            "Transfer-Encoding on an HTTP/1.0 request, which has no transfer codings: its "
            "body's length is ambiguous (send Content-Length)",
            code="ambiguous_framing",
            headers=_CLOSE,
        )


class UnreadBody:
    """Whether an HTTP/1 request's body is still (partly) unread; :meth:`receive` is the
    request's ``receive`` that sees it arrive."""

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self._receive = receive
        self.pending = scope.get("http_version", "1.1").startswith("1.") and any(
            k == b"transfer-encoding" or (k == b"content-length" and v.strip() not in (b"0", b""))
            for k, v in scope["headers"]
        )

    async def receive(self) -> dict[str, Any]:
        message = await self._receive()
        if message["type"] == "http.request" and not message.get("more_body", False):
            self.pending = False
        return message

    def close(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """``Connection: close`` for a response sent while the body is unread (see the notes)."""
        if not self.pending or any(k.lower() == b"connection" for k, _ in headers):
            return []
        return _CLOSE
