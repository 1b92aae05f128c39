"""A coding agent's first request, what it waits for: ``python -m kern.bench.agent_request``.

Starts ``kern serve --model DIR`` (a tiny qwen3 with a 131,072-token context made in a
temporary folder, or ``--model``; ``--url`` for a running server) with no other flag, and
streams Claude-Code-shaped ``/v1/messages`` requests: a system prompt of ``--system-kb`` KB,
a system message inside ``messages``, ``--tools`` synthetic tools (kern.bench.tool_grammars'
agent-sized list), thinking adaptive, context management, effort. For each it prints the
prompt's tokens, the time to the first streamed token and the whole answer's time:

* ``cold, no tools``: a prompt the server has never seen, without tools but as long (the
  tools' text as more instructions): prefill alone;
* ``cold``: another never-seen prompt, with the tools: the server's first grammars (the
  compiler process starts, each tool compiles) and the whole prompt's prefill, so the
  difference from the row above is what the tools cost;
* ``again``: the first request once more (its prefix cached, its grammars cached);
* ``next turn``: the first request with a reply and a new user message (Claude Code's second
  request: the cached prefix, a short suffix).

Each prompt starts with a random salt, so no measurement hits another's cache. The figures
depend on the machine and the model; the ratios between the rows are what to read.
"""

from __future__ import annotations

import argparse
import json
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from kern.bench.tool_grammars import agent_tools

__all__ = ["main"]

MODEL = "agent-bench"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _system(kb: int, salt: str) -> str:
    """``kb`` KB of instructions (made-up prose), starting with ``salt``."""
    line = (
        "When a task asks for a change, read the files it touches first, make the smallest "
        "change that does it, run the tests that cover it and report what changed and why.\n"
    )
    return salt + "\n" + line * (kb * 1024 // len(line))


def body(
    kb: int, tools: int, salt: str, *, next_turn: bool = False, model: str = MODEL
) -> dict[str, Any]:
    """A Claude-Code-shaped request (see the module's notes)."""
    anthropic_tools = [
        {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
        for t in agent_tools()[:tools]
    ]
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "Fix the failing test in src/."}]},
        {"role": "system", "content": "# Environment\nWorking directory: /repo\nPlatform: linux"},
    ]
    if next_turn:
        messages += [
            {"role": "assistant", "content": [{"type": "text", "text": "Which test fails?"}]},
            {"role": "user", "content": "test_parse, in tests/test_io.py."},
        ]
    out: dict[str, Any] = {
        "model": model,
        "max_tokens": 8,
        "temperature": 0,
        "system": [{"type": "text", "text": _system(kb, salt)}],
        "messages": messages,
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": True,
    }
    if anthropic_tools:
        out["tools"] = anthropic_tools
    return out


def measure(client: httpx.Client, request: dict[str, Any]) -> tuple[int, float, float]:
    """(prompt tokens, seconds to the first streamed token, seconds to the end)."""
    start = time.monotonic()
    first = None
    tokens = 0
    with client.stream("POST", "/v1/messages", json=request) as r:
        if r.status_code != 200:
            raise SystemExit(f"HTTP {r.status_code}: {r.read().decode()[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "message_start":
                usage = event["message"]["usage"]
                tokens = usage["input_tokens"] + usage["cache_read_input_tokens"]
            if first is None and event["type"] == "content_block_delta":
                first = time.monotonic() - start
    total = time.monotonic() - start
    return tokens, first if first is not None else total, total


def _serve(model: Path | None, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    if model is None:
        from kern.tiny import make_tiny

        folder = Path(tempfile.mkdtemp()) / MODEL
        model = make_tiny("qwen3", folder, max_position_embeddings=131_072)
    port = _free_port()
    command = [sys.executable, "-m", "kern.cli", "serve", "--model", str(model)]
    command += ["--port", str(port), "--served-model-name", MODEL]
    proc = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"kern serve did not start; its log: {log}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kern.bench.agent_request", description=__doc__)
    p.add_argument("--url", help="a running kern serve (its served model name: --model-name)")
    p.add_argument("--model-name", default=MODEL)
    p.add_argument("--model", type=Path, help="a checkpoint folder to serve (default: tiny)")
    p.add_argument("--system-kb", type=int, default=40, help="system prompt size (default 40)")
    p.add_argument("--tools", type=int, default=24, help="synthetic tools (default 24, all)")
    args = p.parse_args(argv)
    proc = None
    url = args.url
    if url is None:
        proc, url = _serve(args.model, Path(tempfile.mkdtemp()) / "serve.log")
    try:
        with httpx.Client(base_url=url, timeout=3600) as client:
            first_salt = secrets.token_hex(8)
            kb, n, name = args.system_kb, args.tools, args.model_name
            # The server's first request pays its own warm-up: not a measurement.
            measure(client, body(0, 0, secrets.token_hex(8), model=name))
            rows = [
                ("cold, no tools", body(kb, 0, secrets.token_hex(8), model=name)),
                ("cold", body(kb, n, first_salt, model=name)),
                ("again", body(kb, n, first_salt, model=name)),
                ("next turn", body(kb, n, first_salt, next_turn=True, model=name)),
            ]
            print(f"system {args.system_kb} KB, {args.tools} tools, served at {url}")
            print(f"{'request':<16} {'prompt tokens':>13} {'first token s':>14} {'whole s':>8}")
            for name, request in rows:
                if name == "cold, no tools" and args.tools:
                    # The same prompt size: the tools' text as more instructions instead.
                    extra = json.dumps(body(0, args.tools, "")["tools"])
                    request["system"][0]["text"] += extra
                tokens, first, total = measure(client, request)
                print(f"{name:<16} {tokens:>13} {first:>14.2f} {total:>8.2f}", flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
