"""Checks on a request's head before anything reads its body: how the body is framed.

Why here and not in the HTTP server: h11 (under hypercorn) accepts a request with both
``Content-Length`` and ``Transfer-Encoding`` (it frames by the latter, RFC 9112 6.3) and a
``Transfer-Encoding`` on HTTP/1.0, which has none. A proxy in front may frame either one by
the other header, which is how requests are smuggled; RFC 9112 6.1 lets a server refuse both,
and kern does, with a 400 in OpenAI's error shape, closing the connection (whatever follows on
it cannot be trusted to start a request).
"""

from __future__ import annotations

from kern.server.api import ApiError
from kern.server.http import Scope

__all__ = ["check_framing"]

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
