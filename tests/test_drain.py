"""``kern serve``'s drain on SIGTERM/SIGINT (kern.server.drain): an idle server exits at once;
requests in flight finish within ``--shutdown-timeout`` while new ones and ``/health`` get a 503
with ``Retry-After``; what is left at the deadline ends with ``abort`` (a stream's last chunk, a
whole answer so far); a second signal stops at once. Each server is a subprocess on a free
loopback port."""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import httpx
from support.server import KEY, MODEL, Server


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


class _Calls:
    """A stream and a whole answer running in threads; each records what it received."""

    def __init__(self, srv: Server, max_tokens: int) -> None:
        body = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        self.srv = srv
        self.events: list[str] = []
        self.whole: dict = {}
        self.first = threading.Event()

        def stream() -> None:
            with srv.http.stream(
                "POST", "/v1/completions", json={**body, "prompt": "stream", "stream": True}
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.first.set()

        def whole() -> None:
            r = srv.http.post("/v1/completions", json={**body, "prompt": "whole"})
            self.whole["status"] = r.status_code
            self.whole["body"] = r.json()

        self.threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for t in self.threads:
            t.start()
        # Both run: the stream has a token, and the scheduler runs two requests.
        assert self.first.wait(60)
        _wait(lambda: srv.metrics()["kern_num_requests_running"] == 2, "both running")

    def join(self) -> None:
        for t in self.threads:
            t.join(30)
            assert not t.is_alive()

    def stream_finish(self) -> str:
        assert self.events[-1] == "[DONE]", self.events[-3:]
        return json.loads(self.events[-2])["choices"][0]["finish_reason"]


def _unready(srv: Server) -> bool:
    r = httpx.get(srv.url + "/health")
    return r.status_code == 503


def test_idle_server_exits_at_once_on_sigterm(tmp_path):
    # scripts/check_wheel.py's sequence: a completion and a scrape with urllib, `kern bench`,
    # then SIGTERM with a keep-alive connection left open: exit 0 at once, no grace period.
    srv = Server(tmp_path, "idle", pool_bytes="16MiB")
    try:
        body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 4}).encode()
        headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
        req = urllib.request.Request(srv.url + "/v1/completions", body, headers)
        with urllib.request.urlopen(req, timeout=60) as r:
            assert '"finish_reason"' in r.read().decode()
        req = urllib.request.Request(srv.url + "/metrics", headers=headers)
        with urllib.request.urlopen(req, timeout=60) as r:
            assert "kern_generation_tokens_total" in r.read().decode()
        bench = [sys.executable, "-m", "kern.cli", "bench", "--url", srv.url, "--concurrency"]
        bench += ["2", "--requests", "2", "--prompt-tokens", "8", "--shared-prefix", "4"]
        bench += ["--max-tokens", "4", "--api-key", KEY]
        out = subprocess.run(bench, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert re.search(r"Successful requests:\s+2\n", out.stdout), out.stdout
        keep = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        keep.request("GET", "/health")
        assert keep.getresponse().read() == b"ok\n"  # the connection stays open, idle
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(10) == 0
        took = time.monotonic() - t0
        keep.close()
        assert took < 3.0, took
        out = srv.output()
        assert "SIGTERM: draining (0 requests in flight" in out and "Traceback" not in out, out
    finally:
        srv.close()


def test_in_flight_requests_finish_while_new_ones_get_503(tmp_path):
    srv = Server(tmp_path, "drain", pool_bytes="16MiB", env={"KERN_SHUTDOWN_TIMEOUT": "120"})
    try:
        calls = _Calls(srv, max_tokens=600)
        srv.proc.send_signal(signal.SIGTERM)
        # Unready at once; a new request gets a 503 naming the shutdown, with Retry-After.
        _wait(lambda: _unready(srv), "/health turns 503")
        r = httpx.get(srv.url + "/health")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        body = {"model": MODEL, "prompt": "late", "max_tokens": 2}
        r = srv.http.post("/v1/completions", json=body)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert r.headers["connection"] == "close"
        assert r.json()["error"]["message"] == "the server is shutting down"
        assert srv.http.get("/metrics").status_code == 200  # still scraped while draining
        assert srv.proc.wait(120) == 0
        calls.join()
        # Both ran to their end: nothing lost.
        assert calls.stream_finish() == "length"
        assert calls.whole["status"] == 200
        choice = calls.whole["body"]["choices"][0]
        assert choice["finish_reason"] == "length"
        assert calls.whole["body"]["usage"]["completion_tokens"] == 600
        assert "SIGTERM: draining (2 requests in flight, 120 s at most" in srv.output()
    finally:
        srv.close()


def test_deadline_ends_what_is_left_with_abort(tmp_path):
    srv = Server(tmp_path, "deadline", pool_bytes="16MiB", extra=("--shutdown-timeout", "1"))
    try:
        calls = _Calls(srv, max_tokens=8000)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGINT)
        assert srv.proc.wait(30) == 0
        took = time.monotonic() - t0
        calls.join()
        assert calls.stream_finish() == "abort"
        # The whole answer is the answer so far, not a 503: its tokens are not thrown away.
        assert calls.whole["status"] == 200, calls.whole
        choice = calls.whole["body"]["choices"][0]
        assert choice["finish_reason"] == "abort" and choice["text"]
        assert 0 < calls.whole["body"]["usage"]["completion_tokens"] < 8000
        assert 1.0 <= took < 10.0, took
        out = srv.output()
        assert "shutdown timeout (1 s): aborting 2 requests in flight" in out, out
        assert "Traceback" not in out, out
    finally:
        srv.close()


def test_second_signal_stops_at_once(tmp_path):
    srv = Server(tmp_path, "twice", pool_bytes="16MiB", extra=("--shutdown-timeout", "120"))
    try:
        calls = _Calls(srv, max_tokens=8000)
        srv.proc.send_signal(signal.SIGTERM)
        _wait(lambda: _unready(srv), "/health turns 503")
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0
        took = time.monotonic() - t0
        calls.join()
        assert calls.stream_finish() == "abort"
        assert calls.whole["status"] == 200
        assert calls.whole["body"]["choices"][0]["finish_reason"] == "abort"
        assert took < 5.0, took
        assert "SIGTERM again: aborting 2 requests and stopping" in srv.output()
    finally:
        srv.close()


def test_shutdown_timeout_is_checked(tmp_path):
    srv_args = [sys.executable, "-m", "kern.cli", "serve", "--shutdown-timeout", "-1"]
    out = subprocess.run(srv_args, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--shutdown-timeout" in out.stderr, out.stderr
    from kern.errors import UsageError
    from kern.server.settings import DEFAULT_SHUTDOWN_TIMEOUT, shutdown_timeout

    assert shutdown_timeout({}) == DEFAULT_SHUTDOWN_TIMEOUT == 25.0
    assert shutdown_timeout({"KERN_SHUTDOWN_TIMEOUT": "0"}) == 0.0
    for bad in ("-1", "soon", "inf", "nan"):
        try:
            shutdown_timeout({"KERN_SHUTDOWN_TIMEOUT": bad})
        except UsageError as e:
            assert "KERN_SHUTDOWN_TIMEOUT" in str(e)
        else:
            raise AssertionError(bad)
