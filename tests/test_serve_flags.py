"""``kern serve``'s serving options and their twins in the environment under plain hypercorn:
``--max-model-len``, ``--chat-template``, ``--served-model-name`` given more than once,
``--allowed-origins`` (CORS, off by default); and a start that fails under plain hypercorn is
one line and a non-zero exit."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys

import httpx
import pytest
from support.server import KEY, MODEL, Server

from kern.tiny import default_model_path
from kern.tokenizer import Tokenizer

KERN = [sys.executable, "-m", "kern.cli"]
TEMPLATE = (
    "CUSTOM{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ALIAS = "tiny-alias"


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory, template):
    """The embedded model under every option at once (the key comes from KERN_API_KEY)."""
    command = [*KERN, "serve", "--port", "{port}", "--pool-bytes", "2MiB"]
    command += ["--served-model-name", MODEL, "--served-model-name", ALIAS]
    command += ["--max-model-len", "64", "--chat-template", str(template)]
    command += ["--allowed-origins", "http://app.test,http://b.test"]
    command += ["--allowed-origins", "http://c.test:8080"]
    s = Server(tmp_path_factory.mktemp("flags"), "flags", pool_bytes="2MiB", command=command)
    yield s
    s.close()


def _env_without_kern(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERN_")}
    return {**env, **extra}


# --- --served-model-name, repeated -----------------------------------------------------------


def test_served_model_names_are_aliases(served):
    models = served.http.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL, ALIAS]
    assert served.http.get(f"/v1/models/{ALIAS}").json()["id"] == ALIAS
    for name in (MODEL, ALIAS):
        body = {"model": name, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
        r = served.http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == MODEL  # answers report the first name
    r = served.http.post("/v1/completions", json={"model": "other", "prompt": "Hello"})
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "model_not_found"
    assert (
        error["message"]
        == f"model 'other' does not exist (this server serves '{MODEL}', '{ALIAS}')"
    )
    assert served.http.get("/v1/models/other").status_code == 404
    line = next(x for x in served.output().splitlines() if " serving " in x)
    assert f"serving '{MODEL}' (also '{ALIAS}'): qwen3 from " in line
    assert ", max model len 64, " in line


# --- --max-model-len --------------------------------------------------------------------------


def test_max_model_len_is_listed_and_enforced(served):
    models = served.http.get("/v1/models").json()["data"]
    assert [m["max_model_len"] for m in models] == [64, 64]
    r = served.http.post("/tokenize", json={"prompt": "Hello"})
    assert r.json()["max_model_len"] == 64
    prompt = list(range(10, 20))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 55, "ignore_eos": True}
    r = served.http.post("/v1/completions", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    assert "= 65 is over the model's context of 64 tokens" in error["message"]
    r = served.http.post("/v1/completions", json={**body, "max_tokens": 54})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 54
    # A chat request that leaves max_tokens unset may fill what is left of the 64.
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    r = served.http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    assert sum(r.json()["usage"][k] for k in ("prompt_tokens", "completion_tokens")) == 64
    # A prompt that fills the context alone is the prompt's fault, not max_tokens'.
    r = served.http.post("/v1/completions", json={**body, "prompt": list(range(3, 67))})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "prompt", r.text
    assert "the prompt (64 tokens) leaves no room to generate in the model's context" in r.text
    long_chat = {**chat, "messages": [{"role": "user", "content": "hi " * 80}]}
    r = served.http.post("/v1/chat/completions", json=long_chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


# --- --chat-template --------------------------------------------------------------------------


def test_chat_template_replaces_the_checkpoints(served):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = served.http.post("/tokenize", json={"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    tokenizer = Tokenizer.from_dir(default_model_path())
    want = tokenizer.encode("CUSTOM[system]be brief[user]hi<|im_start|>assistant\n")
    assert r.json()["tokens"] == want
    # The checkpoint's own template renders something else.
    own = tokenizer.apply_chat_template(messages)
    assert tokenizer.encode(own) != want
    body = {"model": ALIAS, "messages": messages, "max_tokens": 3, "temperature": 0}
    r = served.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want), r.text


# --- --allowed-origins (CORS) -----------------------------------------------------------------


def test_cors_preflight_needs_no_key_and_allowed_origins_read_answers(served):
    preflight = {
        "Origin": "http://app.test",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    for path in ("/v1/chat/completions", "/v1/messages", "/no/such/route"):
        r = httpx.options(served.url + path, headers=preflight)  # no API key
        assert r.status_code == 204, (path, r.text)
        assert r.headers["access-control-allow-origin"] == "http://app.test"
        assert r.headers["access-control-allow-methods"] == "GET, HEAD, POST, OPTIONS"
        assert r.headers["access-control-allow-headers"] == "authorization, content-type"
        assert r.headers["access-control-max-age"] == "600"
        assert "Origin" in r.headers.get_list("vary")
        assert r.content == b""
    # Without Access-Control-Request-Headers: the headers kern's clients send.
    r = httpx.options(
        served.url + "/v1/messages",
        headers={"Origin": "http://c.test:8080", "Access-Control-Request-Method": "POST"},
    )
    assert r.status_code == 204
    allowed = r.headers["access-control-allow-headers"]
    for name in ("authorization", "content-type", "x-api-key", "anthropic-version"):
        assert name in allowed
    # A preflight from another origin is refused; so is an OPTIONS that is no preflight.
    r = httpx.options(served.url + "/v1/models", headers={**preflight, "Origin": "http://evil"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "cors_origin_not_allowed"
    assert "access-control-allow-origin" not in r.headers
    assert served.http.options("/v1/models").status_code == 405
    # Actual responses carry the allowed origin, errors included; other origins get nothing.
    r = served.http.get("/v1/models", headers={"Origin": "http://b.test"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://b.test"
    assert r.headers["access-control-expose-headers"] == "x-request-id"
    r = httpx.post(
        served.url + "/v1/completions",
        json={"model": MODEL, "prompt": "x"},
        headers={"Origin": "http://app.test"},
    )
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://app.test"
    r = served.http.get("/v1/models", headers={"Origin": "http://evil.test"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    r = served.http.get("/v1/models")
    assert "access-control-allow-origin" not in r.headers


def _asgi(app, method: str, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, dict]:
    """One request through ``app`` in-process: its status and headers."""
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    asyncio.run(app(scope, receive, send))
    start = sent[0]
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}


def test_cors_is_off_by_default_and_star_allows_any_origin():
    from kern.app import App
    from kern.server.cors import Cors

    app = App()  # not started: what routing answers before any model is asked for
    ask = [(b"origin", b"http://app.test"), (b"access-control-request-method", b"POST")]
    status, headers = _asgi(app, "OPTIONS", "/v1/chat/completions", ask)
    assert status == 405 and headers["allow"] == "POST"
    assert not any(k.startswith("access-control-") for k in headers)
    app.cors = Cors(["*"])
    status, headers = _asgi(app, "OPTIONS", "/v1/chat/completions", ask)
    assert status == 204 and headers["access-control-allow-origin"] == "*"
    status, headers = _asgi(app, "GET", "/v1/models", [(b"origin", b"http://any.test")])
    assert status == 503 and headers["access-control-allow-origin"] == "*"  # still loading


# --- mistakes: one line, exit 2, before anything loads ----------------------------------------


def test_option_mistakes_are_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for %}")
    missing = tmp_path / "missing.jinja"
    cases = [
        (
            ["--max-model-len", "100000"],
            "--max-model-len 100000: over the model's context of 8192 tokens "
            "(max_position_embeddings in its config.json)",
        ),
        (
            ["--max-model-len", "0"],
            "argument --max-model-len: 0 is not a positive integer (see kern serve --help)",
        ),
        (
            ["--chat-template", str(missing)],
            f"--chat-template {missing}: cannot read the chat template: No such file or directory",
        ),
        (
            ["--chat-template", str(tmp_path)],
            f"--chat-template {tmp_path}: cannot read the chat template: Is a directory",
        ),
        (
            ["--chat-template", str(bad)],
            f"--chat-template {bad}: chat template does not compile: Expected an expression, "
            "got 'end of statement block'",
        ),
        (["--served-model-name", ""], "--served-model-name: a model name cannot be empty"),
        (
            ["--allowed-origins", "http://app.test/"],
            "--allowed-origins: 'http://app.test/' is not an origin (scheme://host[:port], no "
            "path; or *)",
        ),
    ]
    for args, message in cases:
        out = subprocess.run(
            [*KERN, "serve", *args], capture_output=True, text=True, timeout=60,
            env=_env_without_kern(),
        )  # fmt: skip
        assert out.returncode == 2, (args, out.stderr)
        assert out.stdout == ""
        assert out.stderr == f"kern serve: error: {message}\n", args


def test_the_environment_sets_the_same_options(tmp_path, monkeypatch, template):
    from kern.errors import UsageError
    from kern.server.settings import Settings

    for var in [v for v in os.environ if v.startswith("KERN_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("KERN_SERVED_MODEL_NAME", "first,second,first")
    monkeypatch.setenv("KERN_MAX_MODEL_LEN", "128")
    monkeypatch.setenv("KERN_CHAT_TEMPLATE", str(template))
    monkeypatch.setenv("KERN_ALLOWED_ORIGINS", "http://app.test, *")
    settings = Settings.from_env()
    assert settings.target.name == "first"
    assert settings.served_model_names == ("first", "second")
    assert settings.max_model_len == 128
    assert settings.chat_template == TEMPLATE
    assert settings.allowed_origins == ("http://app.test", "*")
    tokenizer = settings.tokenizer(Tokenizer.from_dir(default_model_path()))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "CUSTOM[user]hi<|im_start|>assistant\n"
    )
    bad = tmp_path / "bad.jinja"
    bad.write_text("{{ x")
    for var, value, message in (
        ("KERN_MAX_MODEL_LEN", "lots", "KERN_MAX_MODEL_LEN='lots' is not a positive integer"),
        ("KERN_MAX_MODEL_LEN", "8193", "KERN_MAX_MODEL_LEN=8193: over the model's context of "),
        ("KERN_CHAT_TEMPLATE", str(tmp_path / "no"), "cannot read the chat template: No such"),
        ("KERN_CHAT_TEMPLATE", str(bad), f"KERN_CHAT_TEMPLATE={bad}: chat template does not "),
        ("KERN_SERVED_MODEL_NAME", "a,,b", "KERN_SERVED_MODEL_NAME: a model name cannot be em"),
        ("KERN_ALLOWED_ORIGINS", "app.test", "KERN_ALLOWED_ORIGINS: 'app.test' is not an origin"),
    ):
        with monkeypatch.context() as m:
            m.setenv(var, value)
            with pytest.raises(UsageError, match=re.escape(message)):
                Settings.from_env()


# --- a failed start under plain hypercorn -----------------------------------------------------


@pytest.mark.parametrize("workers", ["1", "0"])
def test_a_failed_start_under_hypercorn_is_one_line_and_not_exit_0(tmp_path, workers):
    """hypercorn's supervisor (its default --workers 1) reports 0 whatever its worker's exit
    code: kern ends it, so the command still fails. With --workers 0 the exit code is 2."""
    empty = tmp_path / "empty"
    empty.mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "hypercorn", "kern.app:app", "--bind", "127.0.0.1:0"]
        + ["--workers", workers],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env_without_kern(KERN_MODEL=str(empty), KERN_API_KEY=KEY),
    )
    want = f"kern: error: {empty}/config.json: no such file (a checkpoint folder needs config.json)"
    assert out.stderr == want + "\n"
    assert out.stdout == ""
    assert out.returncode != 0
    if workers == "0":
        assert out.returncode == 2
