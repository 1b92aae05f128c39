"""The gate's side of HTTP: a `kern serve` process and a client for it, on the standard
library alone (the gate needs nothing a kern install lacks).

Design notes
------------
* One connection per request, so requests sent from several threads at once really are
  concurrent, and a hang-up is a closed socket the server sees at once.
* Every wait is bounded: a request by ``timeout`` seconds, the server's start by its own
  limit, and a server that exits while starting fails at once with the end of its log.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Answer", "Client", "HttpError", "Request", "ServerProcess", "free_port"]


class HttpError(RuntimeError):
    """A response other than 200 (the message names the route, status and body)."""


@dataclass
class Answer:
    """One choice as a client receives it, whole or assembled from a stream."""

    ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    num_events: int = 0  # stream events that carried this choice's text or finish
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Client:
    """Requests to one server on loopback."""

    def __init__(
        self, port: int, model: str, *, timeout: float, api_key: str | None = None
    ) -> None:
        self.port = port
        self.model = model
        self.timeout = timeout
        self.headers = {"content-type": "application/json"}
        if api_key:
            self.headers["authorization"] = f"Bearer {api_key}"

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)

    def get(self, path: str) -> str:
        conn = self._conn()
        try:
            conn.request("GET", path, headers=self.headers)
            resp = conn.getresponse()
            body = resp.read().decode("utf-8")
            if resp.status != 200:
                raise HttpError(f"GET {path}: {resp.status} {body[:500]}")
            return body
        finally:
            conn.close()

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        conn = self._conn()
        try:
            conn.request("POST", path, json.dumps(body).encode(), headers=self.headers)
            resp = conn.getresponse()
            data = resp.read().decode("utf-8")
            if resp.status != 200:
                raise HttpError(f"POST {path}: {resp.status} {data[:500]}")
            return json.loads(data)
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as name -> value. The ``model_name`` label every kern series carries is
        dropped (one model per server); other labels stay in the name."""
        out = {}
        for line in self.get("/metrics").splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                name = re.sub(r'model_name="(?:[^"\\]|\\.)*",?', "", name).replace("{}", "")
                out[name] = float(value)
        return out

    def idle_metrics(self, limit: float = 30.0) -> dict[str, float]:
        """Metrics once nothing runs or waits (an abort lands within a step); raises
        ``TimeoutError`` if the server is still busy after ``limit`` seconds."""
        deadline = time.monotonic() + limit
        while True:
            m = self.metrics()
            if m.get("kern_num_requests_running") == 0 and m.get("kern_num_requests_waiting") == 0:
                return m
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server was still busy after {limit:.0f}s: {m}")
            time.sleep(0.05)

    def generate(self, req: Request) -> Answer:
        """One request, whole (``stream`` false) or streamed and assembled."""
        if req.stream:
            return _assemble(self._events(req.path, req.body(self.model, stream=True)), req.chat)
        out = self.post(req.path, req.body(self.model, stream=False))
        choice = out["choices"][0]
        text = choice["message"]["content"] if req.chat else choice["text"]
        return Answer(
            ids=choice.get("token_ids") or [],
            text=text or "",
            finish_reason=choice.get("finish_reason"),
            prompt_tokens=out["usage"]["prompt_tokens"],
            cached_tokens=out["usage"].get("prompt_tokens_details", {}).get("cached_tokens"),
            raw=out,
        )

    def hang_up(self, req: Request, after_events: int) -> int:
        """Stream ``req``, read ``after_events`` events, then close the connection. Returns
        the events read (fewer if the stream ended first)."""
        seen = 0
        for _ in self._events(req.path, req.body(self.model, stream=True)):
            seen += 1
            if seen >= after_events:
                break  # closing the generator closes the socket
        return seen

    def _events(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        conn = self._conn()
        try:
            conn.request("POST", path, json.dumps(body).encode(), headers=self.headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise HttpError(f"POST {path}: {resp.status} {resp.read()[:500]!r}")
            while True:
                line = resp.readline()
                if not line:
                    raise HttpError(f"POST {path}: the stream ended without [DONE]")
                line = line.strip()
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    return
                yield json.loads(line[6:])
        finally:
            conn.close()


@dataclass(frozen=True)
class Request:
    """A greedy request: a completion (``prompt`` text or ids) or a chat turn (``chat``: the
    user message)."""

    prompt: str | list[int]
    max_tokens: int | None
    chat: bool = False
    stream: bool = False
    ignore_eos: bool = False

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    def body(self, model: str, *, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "temperature": 0, "return_token_ids": True}
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        body["max_tokens"] = self.max_tokens
        if self.ignore_eos:
            body["ignore_eos"] = True
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        # max_tokens stays even when None: null asks for the most the server allows (an
        # absent max_tokens is 16 on /v1/completions, as in OpenAI's API).
        return body


def _assemble(events: Iterator[dict[str, Any]], chat: bool) -> Answer:
    parts: list[str] = []
    ids: list[int] = []
    finish = None
    usage: dict[str, Any] = {}
    num_events = 0
    for ev in events:
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices", []):
            text = (ch.get("delta", {}).get("content") if chat else ch.get("text")) or ""
            if text or ch.get("finish_reason"):
                num_events += 1
            parts.append(text)
            if ch.get("finish_reason"):
                finish = ch["finish_reason"]
                ids = ch.get("token_ids") or []
    return Answer(
        ids=ids,
        text="".join(parts),
        finish_reason=finish,
        prompt_tokens=usage.get("prompt_tokens", 0),
        cached_tokens=usage.get("prompt_tokens_details", {}).get("cached_tokens"),
        num_events=num_events,
    )


class ServerProcess:
    """``kern serve --config CONFIG --target NAME [EXTRA...]`` (without both: the embedded
    model) on a free loopback port, its output in ``log``. Use as a context manager: the
    server is stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(
        self,
        kern: list[str],
        config: Path | None,
        target: str | None,
        log: Path,
        *,
        start_limit: float,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.port = free_port()
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 - closed in stop()
        which = ["--config", str(config), "--target", target] if config and target else []
        self.proc = subprocess.Popen(
            [*kern, "serve", *which, "--port", str(self.port), *extra],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        self.started = time.monotonic()
        try:
            self._wait_healthy(start_limit)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, limit: float) -> None:
        deadline = time.monotonic() + limit
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"kern serve exited with code {self.proc.returncode} while starting:\n"
                    + self.log_tail()
                )
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            finally:
                conn.close()
            if time.monotonic() > deadline:
                raise TimeoutError(f"kern serve was not healthy after {limit:.0f}s")
            time.sleep(0.2)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, n: int = 20) -> str:
        self._log.flush()
        lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def stop(self) -> int | None:
        """Stop the server; returns its exit code (None if it had to be killed)."""
        code = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        else:
            code = self.proc.returncode
        self._log.close()
        return code

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
