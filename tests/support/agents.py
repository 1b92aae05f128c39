"""The coding agents' binaries and a recording proxy, for tests/test_coding_agents.py.

:func:`install_agents` puts the official Claude Code and Codex CLI binaries, from the PyPI
wheels that carry them at the versions of ``constraints-agents.txt``, into ``.venv-agents/``
at the repository's root (git ignores it) and returns their paths. The venv is built once per
text of the constraints file (a stamp file says which) and reused; a lock file makes a second
pytest process wait for the first one's build. A failed install fails the test with pip's
output: the tests never skip for want of an agent.

:class:`Recorder` is a reverse proxy on a free loopback port that forwards each request to the
server as it came (method, path and query, headers but the hop-by-hop ones, body bytes) and the
answer back as it came (status, headers, body streamed chunk by chunk), and records what went
through: the agents' request bodies and statuses, which kern's log does not show. It only
records; it never changes a request or an answer.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

__all__ = ["Agents", "Exchange", "Recorder", "install_agents"]

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints-agents.txt"
AGENTS_DIR = ROOT / ".venv-agents"
INSTALL_TIMEOUT = 300  # seconds: ~330 MB of wheels (~20 s here)


@dataclass(frozen=True)
class Agents:
    claude: Path
    codex: Path


def _run(cmd: list[str], what: str) -> None:
    try:
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=INSTALL_TIMEOUT
        )
    except subprocess.TimeoutExpired as e:
        out = (e.output or b"").decode(errors="replace")
        pytest.fail(f"{what}: no end in {INSTALL_TIMEOUT} s: {' '.join(cmd)}\n{out}")
    if proc.returncode != 0:
        out = proc.stdout.decode(errors="replace")
        pytest.fail(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{out}")


def install_agents() -> Agents:
    """The agents' binaries, installed into ``.venv-agents/venv`` unless already there at the
    pinned versions. Fails the test (never skips) when they cannot be installed."""
    AGENTS_DIR.mkdir(exist_ok=True)
    venv = AGENTS_DIR / "venv"
    stamp = venv / "kern-constraints.txt"
    pins = CONSTRAINTS.read_text()
    with open(AGENTS_DIR / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (stamp.is_file() and stamp.read_text() == pins):
            shutil.rmtree(venv, ignore_errors=True)
            _run([sys.executable, "-m", "venv", str(venv)], "making the agents' venv")
            # --no-deps: only the bundled binaries are run, never the Python packages.
            pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps"]
            pip += ["--only-binary=:all:", "--disable-pip-version-check", "-r", str(CONSTRAINTS)]
            _run(pip, "installing the coding agents (pip)")
            stamp.write_text(pins)
    site = sorted(venv.glob("lib/python*/site-packages"))
    found = {}
    for name, rel in (
        ("claude", "claude_agent_sdk/_bundled/claude"),
        ("codex", "codex_cli_bin/bin/codex"),
    ):
        paths = [p / rel for p in site if (p / rel).is_file()]
        if not paths:
            pytest.fail(f"{venv}: no {rel} after installing {CONSTRAINTS.name}")
        found[name] = paths[0]
    return Agents(**found)


@dataclass
class Exchange:
    """One request through the :class:`Recorder` and its answer."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    status: int | None = None  # None: the server gave no answer
    answer: bytearray = field(default_factory=bytearray)

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    def text(self) -> str:
        return bytes(self.answer).decode(errors="replace")

    def summary(self) -> str:
        return f"{self.method} {self.path} -> {self.status}: {self.text()[:2000]}"


# Hop-by-hop headers (RFC 9110 7.6.1) and the two the forwarding itself sets.
_HOP = {
    "connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
    "upgrade", "host", "content-length",
}  # fmt: skip
_KEEP = 1 << 20  # bytes of each answer the record keeps


class Recorder:
    """A recording reverse proxy to ``upstream`` (see the module's notes); ``url`` is its
    address, ``exchanges`` what went through, in the order the requests came."""

    def __init__(self, upstream: str) -> None:
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._client = httpx.Client(base_url=upstream, timeout=None)
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _body(self) -> bytes:
                if self.headers.get("transfer-encoding", "").lower() == "chunked":
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("content-length") or 0))

            def _forward(self) -> None:
                body = self._body()
                headers = [(k, v) for k, v in self.headers.items() if k.lower() not in _HOP]
                ex = Exchange(self.command, self.path, dict(headers), body)
                with recorder._lock:
                    recorder.exchanges.append(ex)
                request = recorder._client.build_request(
                    self.command, self.path, content=body, headers=headers
                )
                r = recorder._client.send(request, stream=True)
                try:
                    ex.status = r.status_code
                    self.send_response(r.status_code)
                    for k, v in r.headers.multi_items():
                        if k.lower() not in _HOP:
                            self.send_header(k, v)
                    empty = self.command == "HEAD" or r.status_code in (204, 304)
                    if not empty:
                        self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for chunk in r.iter_raw():
                        if len(ex.answer) < _KEEP:
                            ex.answer += chunk[: _KEEP - len(ex.answer)]
                        if chunk and not empty:
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                            self.wfile.flush()
                    if not empty:
                        self.wfile.write(b"0\r\n\r\n")
                        self.wfile.flush()
                finally:
                    r.close()

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = _forward

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
        self._client.close()

    def summary(self) -> str:
        with self._lock:
            return "\n".join(ex.summary() for ex in self.exchanges)
