"""How a request's body is framed, over raw sockets (kern.server.request_head): both
Content-Length and Transfer-Encoding, or Transfer-Encoding on HTTP/1.0, is a 400
``ambiguous_framing`` in OpenAI's error shape and the connection closes; an HTTP/1.0 POST with
a Content-Length is served."""

from __future__ import annotations

import json
import socket

import pytest
from support.server import KEY, MODEL

BODY = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3, "temperature": 0}).encode()
CHUNKED = b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\n\r\n"


@pytest.fixture(scope="module")
def server(make_server):
    return make_server("framing", pool_bytes="4MiB")


def _exchange(srv, head: bytes, body: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send a raw request; read until the server closes: status, headers, the body unframed."""
    head += f"Authorization: Bearer {KEY}\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
        s.sendall(head + body)
        data = b""
        while chunk := s.recv(65536):  # the server closes: these requests carry no keep-alive
            data += chunk
    raw_head, _, rest = data.partition(b"\r\n\r\n")
    lines = raw_head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        rest, _ = _unchunk(rest)
    return status, headers, rest


def _unchunk(data: bytes) -> tuple[bytes, bytes]:
    """A whole chunked body at the start of ``data``: (the body, what follows it)."""
    out = b""
    while True:
        size, _, data = data.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return out, data[2:]
        out, data = out + data[:n], data[n + 2 :]


def _ambiguous(status: int, headers: dict[str, str], body: bytes) -> None:
    assert status == 400, body
    assert headers["connection"].lower() == "close"
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "ambiguous_framing" and err["type"] == "invalid_request_error"


def test_content_length_and_transfer_encoding_is_a_400(server):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: kern\r\nContent-Type: application/json\r\n"
    head += b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n" % len(BODY)
    status, headers, body = _exchange(server, head, CHUNKED)
    _ambiguous(status, headers, body)
    assert "Content-Length and Transfer-Encoding" in json.loads(body)["error"]["message"]
    # Refused before the body or the route matter: a GET of a known route too.
    head = b"GET /v1/models HTTP/1.1\r\nHost: kern\r\nContent-Length: 0\r\n"
    _ambiguous(*_exchange(server, head + b"Transfer-Encoding: chunked\r\n", b"0\r\n\r\n"))


def test_transfer_encoding_on_http_1_0_is_a_400(server):
    head = b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
    status, headers, body = _exchange(server, head + b"Transfer-Encoding: chunked\r\n", CHUNKED)
    _ambiguous(status, headers, body)
    assert "HTTP/1.0" in json.loads(body)["error"]["message"]


def test_http_1_0_post_with_content_length_is_served(server):
    head = b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
    status, _, body = _exchange(server, head + b"Content-Length: %d\r\n" % len(BODY), BODY)
    assert status == 200, body
    answer = json.loads(body)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 3
    # Without a Content-Type (what a bare probe sends) it is the 415 every POST gets, and the
    # message says what came.
    head = b"POST /v1/completions HTTP/1.0\r\n"
    status, _, body = _exchange(server, head + b"Content-Length: %d\r\n" % len(BODY), BODY)
    err = json.loads(body)["error"]
    assert status == 415 and err["code"] == "unsupported_media_type"
    assert "(got none)" in err["message"]
    assert server.proc.poll() is None


def _read_response(s: socket.socket, buf: bytes) -> tuple[int, dict[str, str], bytes, bytes]:
    """One response off a kept-alive socket: status, headers, body, what came after it."""
    while b"\r\n\r\n" not in buf:
        buf += s.recv(65536)
    raw_head, _, rest = buf.partition(b"\r\n\r\n")
    lines = raw_head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if headers.get("transfer-encoding") == "chunked":
        while b"\r\n0\r\n\r\n" not in rest and not rest.startswith(b"0\r\n\r\n"):
            rest += s.recv(65536)
        return int(lines[0].split()[1]), headers, *_unchunk(rest)
    n = int(headers["content-length"])
    while len(rest) < n:
        rest += s.recv(65536)
    return int(lines[0].split()[1]), headers, rest[:n], rest[n:]


@pytest.mark.parametrize(
    "why, head",
    [
        ("415", b"POST /v1/completions HTTP/1.1\r\nContent-Type: text/plain\r\n"),
        ("404", b"POST /v1/nothing-here HTTP/1.1\r\nContent-Type: application/json\r\n"),
        ("405", b"POST /v1/models HTTP/1.1\r\nContent-Type: application/json\r\n"),
    ],
)
def test_a_response_before_the_body_is_read_closes_the_connection(server, why, head):
    # Refused from the head, the body unread: hypercorn closes the connection after the
    # answer, so the answer must say so, or a keep-alive client sends its next request into
    # the close (the soak's "Server disconnected without sending a response").
    head += b"Host: kern\r\nContent-Length: %d\r\n" % len(BODY)
    head += f"Authorization: Bearer {KEY}\r\n\r\n".encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(head + BODY)
        status, headers, body, rest = _read_response(s, b"")
        assert status == int(why), body
        assert headers["connection"].lower() == "close"
        while chunk := s.recv(65536):  # and the server does close it
            rest += chunk
        assert rest == b""


def test_a_refusal_after_the_body_is_read_keeps_the_connection(server):
    bad = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": -5}).encode()
    auth = f"Authorization: Bearer {KEY}\r\n".encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: kern\r\nContent-Type: application/json\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(head + auth + b"Content-Length: %d\r\n\r\n" % len(bad) + bad)
        status, headers, body, rest = _read_response(s, b"")
        assert status == 400 and "connection" not in headers, (status, headers)
        s.sendall(head + auth + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY)
        status, headers, body, rest = _read_response(s, rest)
        assert status == 200, body
        assert json.loads(body)["usage"]["completion_tokens"] == 3


def test_a_wrong_key_with_a_body_closes_the_connection(server):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: kern\r\nContent-Type: application/json\r\n"
    head += b"Authorization: Bearer wrong\r\nContent-Length: %d\r\n\r\n" % len(BODY)
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(head + BODY)
        status, headers, _, _ = _read_response(s, b"")
        assert status == 401 and headers["connection"].lower() == "close"
