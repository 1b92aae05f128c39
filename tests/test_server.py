"""The server over real HTTP: a `kern serve` subprocess on a free loopback port, driven with
httpx and the official openai client, answers compared with `kern.engine.generate` on the same
ids."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from support.server import KEY, MODEL, Server

from kern.checkpoint.load import load_checkpoint
from kern.engine.generate import generate
from kern.probe import probe_ulps
from kern.tiny import default_model_path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("srv"), "main", pool_bytes="16MiB")
    yield s
    s.close()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    # 64 pages of 16 tokens on the device, 512 in the host tier: parks, wakes and preempts.
    s = Server(tmp_path_factory.mktemp("small"), "small", pool_bytes="512KiB", host_bytes="4MiB")
    yield s
    s.close()


@pytest.fixture(scope="module")
def ckpt():
    return load_checkpoint(default_model_path())


def _reference(ckpt, prompt_ids, steps):
    """kern run's answer: generate alone, cut at end-of-sequence as the server stops."""
    ids = generate(ckpt, prompt_ids, steps, page_tokens=16, threads=2).ids
    eos = set(ckpt.tokenizer.eos_token_ids)
    for n, t in enumerate(ids):
        if t in eos:
            return ids[: n + 1]
    return ids


def _excused(ckpt, prompt_ids, got, want) -> bool:
    """A divergence is excused only if both tokens are within 4 ULPs of the top logit at the
    first step they differ (the probe of generate on the shared context)."""
    s = next(i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b)
    probe = generate(ckpt, prompt_ids + want[:s], 1, probe_steps=[0], page_tokens=16, threads=2)
    values, ids = probe.probes[0]
    import numpy as np

    bits = dict(zip(ids.tolist(), values.numpy().view(np.uint32).tolist(), strict=True))
    top = int(values.numpy().view(np.uint32)[0])
    return all(t in bits and probe_ulps(bits[t], top) <= 4 for t in (got[s], want[s]))


def _prompts(ckpt, n, offset=0):
    tok = ckpt.tokenizer
    texts = [f"Request {i + offset}: the weather today is" + " sunny" * (i % 5) for i in range(n)]
    return [tok.encode(t) for t in texts]


# --- basics -------------------------------------------------------------------------------


def test_completion_matches_kern_run(server, ckpt):
    prompt = ckpt.tokenizer.encode("Once upon a time")
    out = server.complete(prompt, 20)
    choice = out["choices"][0]
    want = _reference(ckpt, prompt, 20)
    assert choice["token_ids"] == want
    assert choice["text"] == ckpt.tokenizer.decode(want, skip_special_tokens=True)
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    server.assert_no_leak()


def test_text_ending_mid_character(server, ckpt):
    # Answers cut inside a multi-byte character: the served text, whole or streamed, ends with
    # the U+FFFD that decode (and so kern run) gives, instead of losing the last bytes.
    tok = ckpt.tokenizer
    cases = []
    for prompt in _prompts(ckpt, 12, offset=900):
        want = _reference(ckpt, prompt, 24)
        cut = [n for n in range(1, len(want) + 1) if tok.decode(want[:n]).endswith("\ufffd")]
        if cut:
            cases.append((prompt, cut[-1]))
    assert len(cases) >= 3
    for prompt, steps in cases[:3]:
        want = tok.decode(_reference(ckpt, prompt, steps), skip_special_tokens=True)
        assert want.endswith("\ufffd")
        assert server.complete(prompt, steps)["choices"][0]["text"] == want
        body = {"model": MODEL, "prompt": prompt, "max_tokens": steps, "temperature": 0}
        parts = []
        with server.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    parts += [c["text"] for c in json.loads(line[6:])["choices"]]
        assert "".join(parts) == want
    server.assert_no_leak()


def test_openai_client(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    try:
        c = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0)
        assert c.choices[0].finish_reason in ("stop", "length")
        assert c.usage.prompt_tokens_details.cached_tokens is not None
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0
        )
        text = chat.choices[0].message.content
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts, usage, finish = [], None, None
        for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            for ch in chunk.choices:
                parts.append(ch.delta.content or "")
                finish = ch.finish_reason or finish
        assert "".join(parts) == text
        assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens
        assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again
        assert finish == chat.choices[0].finish_reason
        s2 = client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=8, temperature=0, stream=True
        )
        assert "".join(ch.choices[0].text for ch in s2 if ch.choices) == c.choices[0].text
        models = client.models.list()
        assert [m.id for m in models.data] == [MODEL]
    finally:
        client.close()
    server.assert_no_leak()


def test_sampling_parameters(server, ckpt):
    prompt = ckpt.tokenizer.encode("The answer is")
    a = server.complete(prompt, 12, temperature=0.8, top_p=0.9, top_k=40, seed=7, n=2)
    b = server.complete(prompt, 12, temperature=0.8, top_p=0.9, top_k=40, seed=7, n=2)
    assert [c["token_ids"] for c in a["choices"]] == [c["token_ids"] for c in b["choices"]]
    ref = _reference(ckpt, prompt, 12)
    stop_id = ref[3]
    out = server.complete(prompt, 12, stop_token_ids=[stop_id])
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["token_ids"][-1] == stop_id
    ign = server.complete(prompt, 12, ignore_eos=True)
    assert len(ign["choices"][0]["token_ids"]) == 12
    text = ckpt.tokenizer.decode(ref, skip_special_tokens=True)
    if len(text) > 4:
        stop = text[2:4]
        st = server.complete(prompt, 12, stop=[stop])
        assert st["choices"][0]["finish_reason"] == "stop"
        assert st["choices"][0]["text"] == text[: text.find(stop)]
    lp = server.complete(prompt, 4, logprobs=3)["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 4 and all(len(t) <= 3 for t in lp["top_logprobs"])
    server.assert_no_leak()


def test_kern_bench_against_the_server(server):
    out = subprocess.run(
        [sys.executable, "-m", "kern.cli", "bench", "--url", server.url, "--api-key", KEY]
        + ["--concurrency", "1,3", "--requests", "3", "--prompt-tokens", "24"]
        + ["--shared-prefix", "16", "--max-tokens", "6", "--json"]
        + ["--baseline-model", str(default_model_path())],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    table, js = out.stdout.strip().rsplit("\n", 1)
    assert "| conc | ok | failed | req/s | out tok/s |" in table and "server/runner" in table
    rows = json.loads(js)
    assert [r["concurrency"] for r in rows] == [1, 3]
    for r in rows:
        assert r["requests"] == r["completed"] == 3 and r["output_tok_s"] > 0
        assert r["runner_tok_s"] > 0 and r["sched_tok_s"] > 0 and r["ratio"] > 0
    # The second and third requests of a level share the first's 16-token prefix (a page).
    assert rows[0]["cached_ratio"] > 0
    assert "concurrency 3" in out.stderr  # the progress bar
    server.assert_no_leak()


def test_other_routes(server):
    t = server.http.post("/tokenize", json={"prompt": "hello world"}).json()
    assert t["count"] == len(t["tokens"]) > 0
    d = server.http.post("/detokenize", json={"tokens": t["tokens"]}).json()
    assert d["prompt"] == "hello world"
    spec = server.http.get("/openapi.json").json()
    assert "/v1/chat/completions" in spec["paths"]
    assert "CompletionRequest" in spec["components"]["schemas"]
    assert httpx.get(server.url + "/health").status_code == 200  # no key needed


# --- bad input ----------------------------------------------------------------------------

BAD = [
    (b"{not json", 400, None),
    (json.dumps({"model": MODEL, "prompt": 5}), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": -1}), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 10**9}), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 10**6}), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "x", "temperature": 5}), 400, "temperature"),
    (json.dumps({"model": MODEL, "prompt": "x", "top_p": 0}), 400, "top_p"),
    (json.dumps({"model": MODEL, "prompt": "x", "top_p": 1.5}), 400, "top_p"),
    (json.dumps({"model": "nope", "prompt": "x"}), 404, "model"),
    (json.dumps({"model": MODEL, "prompt": [1, 99999]}), 400, "prompt[1]"),
    (json.dumps({"model": MODEL, "prompt": [1, -3]}), 400, "prompt[1]"),
    (json.dumps({"model": MODEL, "prompt": ""}), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": []}), 400, "prompt"),
    (json.dumps({"prompt": "x"}), 400, "model"),
    (json.dumps({"model": MODEL, "prompt": "x", "n": 0}), 400, "n"),
    (json.dumps([1, 2]), 400, None),
    # msgspec refuses a lone surrogate as malformed JSON: no field to name.
    (json.dumps({"model": MODEL, "prompt": "\ud800"}), 400, None),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_bad_completion(server, body, status, param):
    r = server.http.post(
        "/v1/completions", content=body, headers={"content-type": "application/json"}
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_bad_chat_and_size_and_auth(server):
    bad_chat = [
        {"model": MODEL, "messages": []},
        {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": -1},
        {"model": MODEL, "messages": [{"role": "user", "content": 3}]},
    ]
    for body in bad_chat:
        r = server.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] is not None
    big = b'{"model": "tiny", "prompt": "' + b"a" * (5 * 2**20) + b'"}'
    r = server.http.post(
        "/v1/completions", content=big, headers={"content-type": "application/json"}
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    assert httpx.post(server.url + "/v1/completions", json=body).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    r = httpx.post(server.url + "/v1/completions", json=body, headers=wrong)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert server.http.get("/nowhere").status_code == 404
    assert server.http.get("/v1/completions").status_code == 405
    assert server.proc.poll() is None
    server.assert_no_leak()


# --- identity under load, prefix hits, hang-ups --------------------------------------------


def _concurrent_identity(srv, ckpt, prompts, steps):
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: srv.complete(p, steps, ignore_eos=True), prompts))
    excused = 0
    for p, out in zip(prompts, outs, strict=True):
        got = out["choices"][0]["token_ids"]
        want = generate(ckpt, p, steps, page_tokens=16, threads=2).ids
        if got != want:
            assert len(got) == len(want) and _excused(ckpt, p, got, want), (got, want)
            excused += 1
    print(f"{len(prompts)} concurrent requests, {excused} divergences excused by the probe")
    return outs


def test_twelve_concurrent_identical(server, ckpt):
    _concurrent_identity(server, ckpt, _prompts(ckpt, 12), 24)
    server.assert_no_leak()


def test_hang_up_mid_stream_frees(server, ckpt):
    # Read once idle (an earlier test's abort lands before), and wait for the abort itself:
    # idle_metrics gives up after 10 s, which under load read as "the abort never came".
    before = server.idle_metrics()
    body = {"model": MODEL, "prompt": "hang up", "max_tokens": 8000, "stream": True}
    body.update(temperature=0, ignore_eos=True)
    with server.http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            if line.startswith("data: "):
                got += 1
                if got == 3:
                    break
    _wait_for(
        lambda m: (
            m["kern_aborted_total"] > before["kern_aborted_total"]
            and m["kern_num_requests_running"] == 0
        ),
        server,
        timeout=60,
    )
    m = server.idle_metrics()
    assert m["kern_aborted_total"] == before["kern_aborted_total"] + 1
    # Cut short, not run to its end for nobody.
    made = m["kern_generation_tokens_total"] - before["kern_generation_tokens_total"]
    assert made < 8000
    server.assert_no_leak()


# --- a small pool with a host tier ---------------------------------------------------------


def test_hang_up_while_queued_frees(small, ckpt):
    # Each request needs 54 of the 64 pages, so they run one at a time and the rest queue.
    # The last one's client hangs up while it waits: it is aborted without ever running.
    gen = np.random.default_rng(7)
    prompts = [gen.integers(10, 500, 800).tolist() for _ in range(4)]
    before = small.metrics()
    body = {"model": MODEL, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    body["return_token_ids"] = True
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        running = [pool.submit(small.complete, p, 60, ignore_eos=True) for p in prompts[:3]]
        _wait_for(lambda m: m["kern_num_requests_waiting"] >= 2, small)
        with small.http.stream(
            "POST", "/v1/completions", json={**body, "prompt": prompts[3], "stream": True}
        ) as r:
            assert r.status_code == 200
            # First come, first served: with another still waiting, this one (queued after
            # it, or about to be) has not run when its client goes.
            assert small.metrics()["kern_num_requests_waiting"] >= 2
        outs = [f.result() for f in running]
    m = small.idle_metrics()
    assert m["kern_aborted_total"] == before["kern_aborted_total"] + 1
    # It never ran: its 800 prompt tokens were never counted as admitted.
    assert m["kern_prompt_tokens_total"] == before["kern_prompt_tokens_total"] + 3 * 800
    for p, out in zip(prompts, outs, strict=False):
        assert out["choices"][0]["token_ids"] == generate(ckpt, p, 60, page_tokens=16).ids
    small.assert_no_leak()


def _wait_for(cond, srv, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond(srv.metrics()):
        assert time.monotonic() < deadline, srv.metrics()
        time.sleep(0.02)


def test_scheduler_crash_exits_101(tmp_path):
    script = str(Path(__file__).parent / "support" / "crash_server.py")
    srv = Server(
        tmp_path, "crash", pool_bytes="1MiB", command=[sys.executable, script, "{port}", "3"]
    )
    try:
        body = {"model": MODEL, "prompt": "crash", "max_tokens": 50, "stream": True}
        body.update(temperature=0, ignore_eos=True)
        t0 = time.monotonic()
        finish = None
        try:
            with srv.http.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        for ch in json.loads(line[6:])["choices"]:
                            finish = ch["finish_reason"] or finish
        except httpx.TransportError:
            pass  # the process may go before the stream's last bytes
        assert finish in (None, "abort")
        # Between the failure and the exit, a new request is told the server is going.
        r = srv.http.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        assert srv.proc.wait(10) == 101
        assert time.monotonic() - t0 < 10
        assert "injected failure" in srv.output()
        assert "exiting with code 101" in srv.output()
    finally:
        srv.close()
