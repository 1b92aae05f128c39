"""CORS for browser clients: off unless origins are allowed (``kern serve --allowed-origins``,
``KERN_ALLOWED_ORIGINS``).

Design notes
------------
* Off by default: without allowed origins an ``OPTIONS`` request is refused like any other
  wrong method (405), and no response carries an ``Access-Control-*`` header, so a web page
  can read nothing of the server's answers.
* With them, a preflight (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``)
  on any path is answered 204 before the API key is checked: a browser never sends the key on
  a preflight. It allows the methods kern takes, the headers the page asked for (else the ones
  its clients send), for ``MAX_AGE`` seconds. A preflight from an origin not allowed is a 403.
* Every other response to an allowed ``Origin`` carries ``Access-Control-Allow-Origin`` (the
  origin itself, with ``Vary: Origin``; ``*`` when every origin is allowed), errors included,
  so the page can read why it was refused, and exposes ``X-Request-Id``.
* An origin is ``scheme://host[:port]`` exactly as a browser sends it (no path, no trailing
  slash), or ``*``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from kern.errors import UsageError
from kern.server import api
from kern.server.api import ApiError

__all__ = ["MAX_AGE", "Cors", "parse_origins"]

# Seconds a browser may cache a preflight's answer (Chrome caps it at 7,200).
MAX_AGE = 600
METHODS = b"GET, HEAD, POST, OPTIONS"
# The headers kern's clients send: OpenAI's and Anthropic's.
HEADERS = b"authorization, content-type, x-api-key, anthropic-version, x-request-id"
_ORIGIN = re.compile(r"^[a-z][a-z0-9+.-]*://[^/?#\s]+$")

Headers = list[tuple[bytes, bytes]]


def parse_origins(values: Iterable[str], where: str) -> tuple[str, ...]:
    """Origins from comma-separated ``values`` (a flag given several times, or one variable);
    a :class:`UsageError` naming ``where`` for one that is not ``scheme://host[:port]`` or
    ``*``."""
    out: list[str] = []
    for value in values:
        for origin in value.split(","):
            origin = origin.strip()
            if origin != "*" and not _ORIGIN.match(origin):
                raise UsageError(
                    f"{where}: {origin!r} is not an origin (scheme://host[:port], no path; or *)"
                )
            out.append(origin)
    return tuple(dict.fromkeys(out))


class Cors:
    """The allowed origins and the headers they get."""

    def __init__(self, origins: Iterable[str]) -> None:
        origins = tuple(origins)
        self.any = "*" in origins
        self.origins = frozenset(o.encode() for o in origins)

    def _allow(self, scope_headers: Iterable[tuple[bytes, bytes]]) -> Headers | None:
        """``Access-Control-Allow-Origin`` (and ``Vary``) for the request's ``Origin``, or
        None when it sends none or one not allowed."""
        origin = next((v for k, v in scope_headers if k == b"origin"), None)
        if origin is None:
            return None
        if self.any:
            return [(b"access-control-allow-origin", b"*")]
        if origin in self.origins:
            return [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]
        return None

    def headers(self, scope_headers: Iterable[tuple[bytes, bytes]]) -> Headers:
        """What every response to this request carries (nothing for an origin not allowed)."""
        allow = self._allow(scope_headers)
        if allow is None:
            return []
        return [*allow, (b"access-control-expose-headers", b"x-request-id")]

    def preflight(self, method: str, scope_headers: list[tuple[bytes, bytes]]) -> Headers | None:
        """A preflight's own headers (beside :meth:`headers`'), or None when the request is no
        preflight. Raises a 403 ``ApiError`` for one from an origin not allowed."""
        asked = dict(scope_headers)
        if method != "OPTIONS" or not {b"origin", b"access-control-request-method"} <= asked.keys():
            return None
        if self._allow(scope_headers) is None:
            origin = asked[b"origin"].decode("latin-1")
            raise ApiError(
                403,
                f"origin {api.echo(origin)} is not allowed (see --allowed-origins)",
                code="cors_origin_not_allowed",
            )
        return [
            (b"access-control-allow-methods", METHODS),
            (
                b"access-control-allow-headers",
                asked.get(b"access-control-request-headers", HEADERS),
            ),
            (b"access-control-max-age", str(MAX_AGE).encode()),
            (b"vary", b"Access-Control-Request-Headers"),
        ]
