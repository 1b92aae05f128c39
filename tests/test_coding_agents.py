"""The coding agents end to end: Claude Code (``claude -p``) and the Codex CLI (``codex exec``),
their official binaries at the versions of ``constraints-agents.txt``, each run
non-interactively in a temporary git repository against ``kern serve --model DIR`` with no
flags but the pool sizes every test server passes.

The model is the scripted tiny qwen3 of ``support.scripted_model``: it calls the agent's
file-reading tool (Claude Code's ``Read``, Codex's ``exec_command`` with ``cat README.md``),
and answers :data:`ANSWER` once the tool's result is in the conversation. So each test asserts
that the agent completes its turn (exit 0, the final answer is :data:`ANSWER`), that the tool
call round-tripped (the answer's call in the first response, the tool's output in the next
request), and that every request the agent sent got a 2xx, as the recording proxy saw it and
as kern's log says. The agents' binaries are installed by ``support.agents`` (a cached venv);
when they cannot be, the tests fail: they never skip.

Design notes
------------
* The agents talk to a record-only reverse proxy (``support.agents.Recorder``) in front of kern:
  it shows every request (kern logs GETs at DEBUG only) and the request bodies, so the tests
  also check that the agents sent the fields kern must take (Claude Code: a system message
  inside ``messages``, adaptive ``thinking``, ``context_management``, ``output_config.effort``,
  ``tools``, ``stream``; Codex: ``client_metadata``, a ``namespace`` tool, ``include``,
  ``prompt_cache_key``, ``reasoning.summary``, ``store: false``).
* Prompt size is CPU time: the tiny tokenizer has 512 ids (about 1.6 bytes a token) and prefill
  grows faster than linearly. Claude Code's default 21 tools and ~100 KB prompt are ~52k
  tokens (~180 s of prefill on 2 cores), so it gets ``--tools Read`` (it still sends its
  default system prompt, a system message and a deferred-tool placeholder: ~6.8k tokens, 4 s
  a run on an idle machine, 20 s on a busy one). Codex keeps its default tools (the namespace
  one included) but gets a one-line base prompt (``model_instructions_file``): ~13k tokens
  instead of ~24k (7 s idle, 38 s busy, instead of 105 s busy). Neither changes the shape of
  a request.
* Codex runs its command without its sandbox (``-s danger-full-access``): the command is the
  script's fixed ``cat README.md``, and bubblewrap's needs (user namespaces) are the
  machine's business, not kern's.
* Retries off (``CLAUDE_CODE_MAX_RETRIES=0``; Codex's provider ``request_max_retries`` and
  ``stream_max_retries`` 0): a refused request fails the turn at once, with kern's message.
* Each agent gets a temporary ``HOME`` (and ``CLAUDE_CONFIG_DIR`` / ``CODEX_HOME``) and an
  environment of its own: nothing of the user's configuration is read or written.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from support.agents import Agents, Exchange, Recorder, install_agents
from support.scripted_model import make_scripted
from support.server import KEY, MODEL, Server

ANSWER = "The file says hello."
README = "hello from the README\n"
PROMPT = "Read README.md and tell me what it says."
POOL = "64MiB"
# Seconds an agent's run may take: ~5 s (Claude Code) and ~8 s (Codex) on an idle 2-core
# machine, 20 s and 40 s on a busy one; mostly prefill.
AGENT_TIMEOUT = 240

# kern's request log line (kern.server.logs.RequestRecord.log): date time LEVEL id METHOD
# PATH STATUS ...
_LOG_LINE = re.compile(
    r"^\S+ \S+ [A-Z]+ \S+ (GET|POST|PUT|PATCH|DELETE|HEAD|OPTIONS) (/\S*) (\d{3}|None)(.*)$",
    re.M,
)


@pytest.fixture(scope="module")
def agents() -> Agents:
    return install_agents()


def _repo(tmp: Path) -> Path:
    """A git repository with one commit: README.md."""
    repo = tmp / "repo"
    repo.mkdir()
    (repo / "README.md").write_text(README)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp), "GIT_CONFIG_NOSYSTEM": "1"}
    for cmd in (
        ["git", "init", "-q"],
        ["git", "add", "README.md"],
        ["git", "-c", "user.name=kern", "-c", "user.email=kern@localhost", "commit", "-qm", "init"],
    ):
        subprocess.run(cmd, cwd=repo, env=env, check=True)
    return repo


def _home(tmp: Path) -> Path:
    home = tmp / "home"
    home.mkdir()
    return home


def _sse(text: str) -> list[dict[str, Any]]:
    """The JSON data of a server-sent event stream."""
    out = []
    for line in text.splitlines():
        if line.startswith("data:") and line[5:].strip().startswith("{"):
            out.append(json.loads(line[5:]))
    return out


class Run:
    """A scripted server, the recorder in front of it, and an agent's finished run."""

    def __init__(self, tmp: Path, name: str, tool: str, arguments: dict[str, Any]) -> None:
        model = make_scripted(tmp / "model", tool=tool, arguments=arguments, answer=ANSWER)
        self.server = Server(tmp, name, pool_bytes=POOL, model=model)
        self.recorder = Recorder(self.server.url)
        self.proc: subprocess.CompletedProcess[bytes] | None = None
        self.seconds = 0.0

    def run(self, cmd: list[str], cwd: Path, env: dict[str, str]) -> None:
        t0 = time.monotonic()
        try:
            self.proc = subprocess.run(
                cmd,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=AGENT_TIMEOUT,
            )
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace")[-4000:]
            err = (e.stderr or b"").decode(errors="replace")[-4000:]
            pytest.fail(
                f"{cmd[0]}: no end in {AGENT_TIMEOUT} s\nstdout:\n{out}\nstderr:\n{err}\n"
                + self.context()
            )
        self.seconds = time.monotonic() - t0

    def context(self) -> str:
        """What a failure shows: the agent's output, the requests, kern's log."""
        parts = []
        if self.proc is not None:
            parts.append(f"exit {self.proc.returncode}")
            parts.append("stdout:\n" + self.proc.stdout.decode(errors="replace")[-6000:])
            parts.append("stderr:\n" + self.proc.stderr.decode(errors="replace")[-4000:])
        parts.append("requests:\n" + self.recorder.summary())
        parts.append("kern log:\n" + self.server.output()[-6000:])
        return "\n".join(parts)

    def close(self) -> None:
        self.recorder.close()
        self.server.close()

    def check_http(self, path: str) -> list[Exchange]:
        """Every request got a 2xx (as the proxy saw it, and as kern's log says); the POSTs to
        ``path``, in order, of which there are at least two (the call, then the answer)."""
        exchanges = list(self.recorder.exchanges)
        bad = [ex for ex in exchanges if ex.status is None or not 200 <= ex.status < 300]
        assert not bad, "not 2xx:\n" + "\n".join(ex.summary() for ex in bad) + self.context()
        log = self.server.output()
        lines = _LOG_LINE.findall(log)
        bad_lines = [line for line in lines if not line[2].startswith("2")]
        assert not bad_lines, f"kern logged non-2xx requests: {bad_lines}\n{self.context()}"
        # kern logs every POST to /v1/ at INFO (other requests at DEBUG).
        posts = [ex for ex in exchanges if ex.method == "POST"]
        logged = [line for line in lines if line[0] == "POST"]
        assert len(logged) == len(posts), self.context()
        mine = [ex for ex in posts if ex.path.split("?")[0] == path]
        assert len(mine) >= 2, self.context()
        self.report(lines)
        return mine

    def report(self, lines: list[tuple[str, str, str, str]]) -> None:
        name = Path(self.proc.args[0]).name if self.proc is not None else "?"
        print(f"\n{name}: {self.seconds:.1f} s, {len(self.recorder.exchanges)} requests")
        for ex in self.recorder.exchanges:
            print(f"  {ex.method} {ex.path} {ex.status}: {len(ex.body)} bytes")
        for method, path, status, rest in lines:
            print(f"  kern: {method} {path} {status}{rest}")


def test_scripted_model(tmp_path):
    """The script over kern's chat API, sampled at temperature 1: the call, then (a tool
    result in the conversation) the answer. No agent needed."""
    model = make_scripted(
        tmp_path / "model", tool="Read", arguments={"file_path": "/a/b"}, answer=ANSWER
    )
    server = Server(tmp_path, "scripted", pool_bytes=POOL, model=model)
    try:
        schema = {"type": "object", "properties": {"file_path": {"type": "string"}}}
        tools = [{"type": "function", "function": {"name": "Read", "parameters": schema}}]
        messages: list[dict[str, Any]] = [{"role": "user", "content": "read /a/b"}]
        body = {"model": MODEL, "tools": tools, "temperature": 1.0, "max_tokens": 64}
        r = server.http.post("/v1/chat/completions", json={**body, "messages": messages})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "Read"
        assert json.loads(call["function"]["arguments"]) == {"file_path": "/a/b"}
        messages.append(choice["message"])
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": README})
        r = server.http.post("/v1/chat/completions", json={**body, "messages": messages})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert (choice["finish_reason"], choice["message"]["content"]) == ("stop", ANSWER)
        # Any other prompt: the end of sequence at once.
        r = server.complete("hello", max_tokens=8)
        assert r["choices"][0]["text"] == "" and r["choices"][0]["finish_reason"] == "stop"
    finally:
        server.close()


def test_claude_code(tmp_path, agents):
    """``claude -p``: reads README.md with its Read tool, then answers; every request 2xx."""
    repo = _repo(tmp_path)
    readme = str(repo / "README.md")
    run = Run(tmp_path, "claude", "Read", {"file_path": readme})
    try:
        home = _home(tmp_path)
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(home),
            "CLAUDE_CONFIG_DIR": str(home / ".claude"),
            "ANTHROPIC_BASE_URL": run.recorder.url,
            "ANTHROPIC_API_KEY": KEY,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "CLAUDE_CODE_MAX_RETRIES": "0",
        }
        cmd = [str(agents.claude), "-p", PROMPT, "--model", MODEL, "--output-format", "json"]
        cmd += ["--tools", "Read", "--allowedTools", "Read", "--max-turns", "3"]
        cmd += ["--no-session-persistence"]
        run.run(cmd, repo, env)
        assert run.proc is not None and run.proc.returncode == 0, run.context()
        result = json.loads(run.proc.stdout)
        assert result["is_error"] is False, run.context()
        assert result["result"] == ANSWER, run.context()

        requests = run.check_http("/v1/messages")
        for ex in requests:
            # Anthropic's key header, which kern takes as it takes a bearer token.
            headers = {k.lower(): v for k, v in ex.headers.items()}
            assert headers.get("x-api-key") == KEY and "authorization" not in headers, headers
            body = ex.json()
            assert body["model"] == MODEL and body["stream"] is True, ex.summary()
            assert body["thinking"]["type"] == "adaptive", body["thinking"]
            assert "edits" in body["context_management"], body["context_management"]
            assert body["output_config"]["effort"], body["output_config"]
            assert "Read" in [t.get("name") for t in body["tools"]], body["tools"]
            assert "system" in [m["role"] for m in body["messages"]], body["messages"]

        # The first answer is the scripted call; the last request carries its result back.
        events = _sse(requests[0].text())
        calls = [
            e["content_block"]
            for e in events
            if e["type"] == "content_block_start" and e["content_block"]["type"] == "tool_use"
        ]
        assert [c["name"] for c in calls] == ["Read"], requests[0].text()
        last = requests[-1].json()["messages"]
        assert last[-2]["role"] == "assistant"
        uses = [b for b in last[-2]["content"] if b["type"] == "tool_use"]
        assert [(u["id"], u["input"]) for u in uses] == [(calls[0]["id"], {"file_path": readme})]
        results = [b for b in last[-1]["content"] if b["type"] == "tool_result"]
        assert [r["tool_use_id"] for r in results] == [calls[0]["id"]], last[-1]
        content = results[0]["content"]
        text = content if isinstance(content, str) else "".join(p["text"] for p in content)
        assert README.strip() in text, results
    finally:
        run.close()


def test_codex(tmp_path, agents):
    """``codex exec``: runs ``cat README.md`` with its exec_command tool, then answers; every
    request 2xx."""
    repo = _repo(tmp_path)
    run = Run(tmp_path, "codex", "exec_command", {"cmd": "cat README.md"})
    try:
        home = _home(tmp_path)
        (home / "codex").mkdir()
        instructions = tmp_path / "instructions.md"
        instructions.write_text("You are a coding agent. Use the tools to do what the user asks.\n")
        last_message = tmp_path / "last-message.txt"
        env = {
            "PATH": os.environ["PATH"],
            "HOME": str(home),
            "CODEX_HOME": str(home / "codex"),
            "KERN_KEY": KEY,
        }
        provider = (
            f'model_providers.kern={{name="kern",base_url="{run.recorder.url}/v1",'
            'wire_api="responses",env_key="KERN_KEY",request_max_retries=0,'
            "stream_max_retries=0}"
        )
        cmd = [str(agents.codex), "exec", "--ephemeral", "--json", "-m", MODEL]
        cmd += ["-s", "danger-full-access", "-o", str(last_message)]
        cmd += ["-c", "model_provider=kern", "-c", provider, "-c", 'web_search="disabled"']
        cmd += ["-c", f"model_instructions_file={json.dumps(str(instructions))}", PROMPT]
        run.run(cmd, repo, env)
        assert run.proc is not None and run.proc.returncode == 0, run.context()
        assert last_message.read_text().strip() == ANSWER, run.context()
        events = [json.loads(line) for line in run.proc.stdout.splitlines() if line.strip()]
        items = [e["item"] for e in events if e["type"] == "item.completed"]
        commands = [i for i in items if i["type"] == "command_execution"]
        assert len(commands) == 1 and commands[0]["exit_code"] == 0, run.context()
        assert commands[0]["aggregated_output"] == README, run.context()
        messages = [i["text"] for i in items if i["type"] == "agent_message"]
        assert messages == [ANSWER], run.context()

        requests = run.check_http("/v1/responses")
        for ex in requests:
            body = ex.json()
            assert body["model"] == MODEL and body["stream"] is True, ex.summary()
            assert body["store"] is False and body["include"], ex.summary()
            assert body["client_metadata"] and body["prompt_cache_key"], ex.summary()
            assert body["reasoning"]["summary"], body["reasoning"]
            kinds = {t["type"] for t in body["tools"]}
            assert "namespace" in kinds and "web_search" not in kinds, kinds
            assert "exec_command" in [t.get("name") for t in body["tools"]], body["tools"]

        # The first answer is the scripted call; the last request carries its output back.
        done = [
            e["item"] for e in _sse(requests[0].text()) if e["type"] == "response.output_item.done"
        ]
        calls = [i for i in done if i["type"] == "function_call"]
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            ("exec_command", {"cmd": "cat README.md"})
        ], requests[0].text()
        last = requests[-1].json()["input"]
        sent = [i for i in last if i.get("type") == "function_call"]
        outputs = [i for i in last if i.get("type") == "function_call_output"]
        assert [c["call_id"] for c in sent] == [calls[0]["call_id"]], last[-2:]
        assert [o["call_id"] for o in outputs] == [calls[0]["call_id"]], last[-2:]
        output = outputs[0]["output"]
        text = output if isinstance(output, str) else json.dumps(output)
        assert README.strip() in text, outputs
    finally:
        run.close()
