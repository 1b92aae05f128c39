"""Running kern in production: ``kern serve --model DIR`` with no kern.toml, start-up checks and
the start-up line, shutdown on SIGTERM/SIGINT, the log, and the metrics a vLLM dashboard reads.
Every server here is a ``kern serve`` subprocess on a free loopback port, driven over HTTP."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.server import KEY, MODEL, Server, parse_metrics

from kern import __version__
from kern.backend.cpu import onednn_rows_hold
from kern.checkpoint.load import load_checkpoint
from kern.engine.generate import generate

KERN = [sys.executable, "-m", "kern.cli"]


def kern(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*KERN, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def hybrid(tiny_dir, tmp_path_factory):
    """``kern serve --model`` on a make-tiny qwen3_5 folder (state slots): no kern.toml."""
    s = Server(
        tmp_path_factory.mktemp("model"),
        "model",
        pool_bytes="4MiB",
        model=tiny_dir("qwen3_5"),
        extra=("--stats-interval", "0.2"),
    )
    yield s
    s.close()


def _complete(srv: Server, **body) -> httpx.Response:
    body = {"model": MODEL, "temperature": 0, "return_token_ids": True, **body}
    return srv.http.post("/v1/completions", json=body)


# --- kern serve --model ---------------------------------------------------------------------


def test_serves_a_make_tiny_folder_without_kern_toml(hybrid, tiny_dir):
    ckpt = load_checkpoint(tiny_dir("qwen3_5"))
    prompt = ckpt.tokenizer.encode("Once upon a time")
    r = _complete(hybrid, prompt=prompt, max_tokens=12, ignore_eos=True)
    assert r.status_code == 200, r.text
    want = generate(ckpt, prompt, 12, page_tokens=16, threads=2).ids
    assert r.json()["choices"][0]["token_ids"] == want
    assert [m["id"] for m in hybrid.http.get("/v1/models").json()["data"]] == [MODEL]
    assert hybrid.http.get("/version").json() == {"version": __version__}
    hybrid.assert_no_leak(min_slots=2)


def test_start_up_line(hybrid, tiny_dir):
    lines = [line for line in hybrid.output().splitlines() if " serving " in line]
    assert len(lines) == 1, hybrid.output()
    line = lines[0]
    assert f"kern {__version__} serving '{MODEL}': qwen3_5 from {tiny_dir('qwen3_5')}" in line
    assert "on cpu/float32, threads 2" in line
    assert re.search(r"KV pool \d+ pages x 16 tokens, 2 state slots \(4\.0 MiB\)", line), line
    assert "host tier 0 pages (0.0 MiB)" in line
    assert ("linears in MKL tiles" in line) != onednn_rows_hold(), line
    assert line.endswith(f"listening on http://127.0.0.1:{hybrid.port}")
    assert "Running on" not in hybrid.output()  # hypercorn's own line says less


def test_version_flag():
    out = kern("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"kern {__version__}"
    from importlib.metadata import version

    assert version("kern") == __version__


# --- start-up mistakes: one line, exit 2, before anything loads -------------------------------


def _busy_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


@pytest.fixture(scope="module")
def kern_toml(tmp_path_factory, tiny_dir):
    folder = tmp_path_factory.mktemp("toml")
    ckpt = tiny_dir("qwen3")
    bad = folder / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "llama"}')
    path = folder / "kern.toml"
    path.write_text(
        f'[targets.ranks]\ncheckpoint = "{ckpt}"\nranks = 8\n'
        f'[targets.draft]\ncheckpoint = "{ckpt}"\ndraft = "/nonexistent"\nrows = [1, 2]\n'
        f'[targets.ngram]\ncheckpoint = "{ckpt}"\ndraft = "ngram"\nrows = [1, 3]\n'
        f'[targets.rows]\ncheckpoint = "{ckpt}"\nrows = [1, 4]\n'
        f'[targets.bf16]\ncheckpoint = "{ckpt}"\ndtype = "bfloat16"\n'
        f'[targets.gone]\ncheckpoint = "{folder / "missing"}"\n'
        f'[targets.llama]\ncheckpoint = "{bad}"\n'
    )
    return path


def test_start_up_mistakes_are_one_line_and_exit_2(kern_toml, tiny_dir):
    ckpt = str(tiny_dir("qwen3"))
    toml = str(kern_toml)
    held, port = _busy_port()
    cases = [
        (["--model", "/nonexistent/ckpt"], "/nonexistent/ckpt: no such checkpoint folder"),
        (["--port", "99999"], "argument --port: 99999 is not a port (0 to 65535)"),
        (["--port", "http"], "argument --port: 'http' is not a port number"),
        (["--model", ckpt, "--port", str(port)], f"--port {port}: 127.0.0.1:{port} is already"),
        (["--host", "no-such-host.invalid"], "--host no-such-host.invalid: "),
        (["--model", ckpt, "--config", toml], f"--config {toml} and --model {ckpt}: "),
        (["--model", ckpt, "--dtype", "bfloat16"], "is cpu/bfloat16: the cpu backend runs f"),
        (["--model", ckpt, "--pool-bytes", "1KiB"], "--pool-bytes: pool_bytes = 1024: pool "),
        (["--model", ckpt, "--host-bytes", "100"], "--host-bytes: host_bytes = 100: pool "),
        (["--model", ckpt, "--pool-bytes", "lots"], "argument --pool-bytes: expected bytes"),
        (["--model", ckpt, "--device", "tpu"], "argument --device: 'tpu' is not 'cpu'"),
        (["--config", toml, "--target", "ranks"], f"{toml}: targets.ranks.ranks: ranks = 8"),
        (["--config", toml, "--target", "draft"], f"{toml}: targets.draft.draft: draft = '/n"),
        (["--config", toml, "--target", "rows", "--rows", "3"], "--rows 3: target 'rows' decl"),
        (["--model", ckpt, "--rows", "0"], "argument --rows: "),
        (["--config", toml, "--target", "bf16"], f"{toml}: targets.bf16.dtype: target 'bf16'"),
        (["--config", toml, "--target", "gone"], "missing: no such checkpoint folder"),
        (["--config", toml, "--target", "llama"], "model_type 'llama' is not supported"),
        (["--config", toml], "--config needs --target NAME"),
        (["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
        (["--stats-interval", "-1"], "argument --stats-interval: '-1' is not a number"),
    ]
    import torch

    if not torch.cuda.is_available():
        cases.append((["--model", ckpt, "--device", "cuda"], "torch sees no CUDA device here"))
    try:
        for args, message in cases:
            out = kern("serve", *args)
            assert out.returncode == 2, (args, out.stderr)
            assert out.stdout == "", (args, out.stdout)
            assert out.stderr.count("\n") == 1 and out.stderr.startswith("kern serve: error: ")
            assert message in out.stderr, (args, out.stderr)
    finally:
        held.close()


def test_run_and_test_share_the_target_check(kern_toml, capsys):
    from kern import cli

    toml = str(kern_toml)
    for target, message in (
        ("ranks", "ranks = 8 does not divide the model's num_attention_heads (4)"),
        ("draft", "draft = '/nonexistent': no such checkpoint folder"),
    ):
        for command in (["run", "--prompt", "a", "--steps", "1"], ["test"]):
            assert cli.main([*command, "--config", toml, "--target", target]) == 2
            assert message in capsys.readouterr().err
    # n-gram drafts at rows > 1: both keys are implemented.
    for target in ("rows", "ngram"):
        args = ["run", "--config", toml, "--target", target, "--prompt", "ab", "--steps", "3"]
        assert cli.main(args) == 0, capsys.readouterr().err
        capsys.readouterr()


def test_loading_progress_bar_on_a_terminal():
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
    proc = subprocess.Popen(
        [*KERN, "serve", "--port", "0"], stdin=subprocess.DEVNULL, stdout=slave, stderr=slave
    )
    os.close(slave)
    seen = b""
    try:
        deadline = time.monotonic() + 60
        while b"listening on" not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1)
            if ready:
                try:
                    seen += os.read(master, 4096)
                except OSError:  # the process closed the terminal
                    break
        assert b"listening on http://127.0.0.1:" in seen, seen
        assert b"loading tiny-qwen3:" in seen, seen  # tqdm's bar, before the start-up line
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        os.close(master)


# --- shutdown -------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_shutdown_ends_streams_and_answers_waiting_requests(tmp_path, sig):
    # --shutdown-timeout 0: what is in flight ends at once (tests/test_drain.py: the grace).
    extra = ("--log-prompts", "--access-log", "--shutdown-timeout", "0")
    srv = Server(tmp_path, "stop", pool_bytes="16MiB", extra=extra)
    try:
        blocked: dict = {}

        def whole_answer() -> None:
            r = _complete(srv, prompt="wait for it", max_tokens=4000, ignore_eos=True)
            blocked["response"] = r

        waiter = threading.Thread(target=whole_answer)
        waiter.start()
        events: list[str] = []
        body = {"model": MODEL, "prompt": "stream", "max_tokens": 4000, "ignore_eos": True}
        body.update(stream=True, stream_options={"include_usage": True})
        t_signal = None
        with srv.http.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                if len(events) == 3 and t_signal is None:
                    # Both requests run now: the stream has tokens, the other was admitted.
                    deadline = time.monotonic() + 10
                    while srv.metrics()["kern_num_requests_running"] < 2:
                        assert time.monotonic() < deadline
                        time.sleep(0.02)
                    t_signal = time.monotonic()
                    srv.proc.send_signal(sig)
        assert srv.proc.wait(10) == 0
        took = time.monotonic() - t_signal
        waiter.join(10)
        assert events[-1] == "data: [DONE]"
        usage = json.loads(events[-2][6:])
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] > 0
        final = json.loads(events[-3][6:])
        assert final["choices"][0]["finish_reason"] == "abort"
        # The whole answer so far, ended with abort: not a 503, its tokens are kept.
        resp = blocked["response"]
        assert resp.status_code == 200
        assert resp.json()["choices"][0]["finish_reason"] == "abort"
        assert took < 2.0, took
        out = srv.output()
        assert "Traceback" not in out and "CancelledError" not in out, out
        assert f"{sig.name}: draining (2 requests in flight, 0 s at most" in out
        # --log-prompts puts the text in the request line; --access-log adds hypercorn's.
        assert "prompt_text='stream'" in out and "prompt_text='wait for it'" in out
        assert '"POST /v1/completions' in out
    finally:
        srv.close()


# --- logs -----------------------------------------------------------------------------------


def test_request_log_line_and_request_id(hybrid):
    r = _complete(hybrid, prompt="a secret prompt", max_tokens=5, ignore_eos=True)
    made = r.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made)
    r = hybrid.http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "a secret prompt", "max_tokens": 4, "ignore_eos": True},
        headers={"X-Request-Id": "client-id-7"},
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-id-7"
    # An id with a control character would forge a header or a log line: a new one is made.
    r = hybrid.http.post("/tokenize", json={"prompt": "x"}, headers={"X-Request-Id": "a\tb"})
    assert r.headers["x-request-id"] != "a\tb" and len(r.headers["x-request-id"]) == 32
    bad = hybrid.http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 0})
    assert bad.status_code == 400 and "x-request-id" in bad.headers
    # A request's line is logged once its response is sent: wait for the last one.
    bad_id = bad.headers["x-request-id"]
    deadline = time.monotonic() + 10
    while bad_id not in hybrid.output():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    out = hybrid.output()
    line = next(x for x in out.splitlines() if " client-id-7 " in x)
    assert re.search(
        r" INFO client-id-7 POST /v1/completions 200 prompt=\d+ cached=\d+ output=4 "
        r"finish=length ttft=\d+\.\d{3}s total=\d+\.\d{3}s$",
        line,
    ), line
    assert f" INFO {made} POST /v1/completions 200 " in out
    assert "secret" not in out  # no prompt text without --log-prompts
    assert re.search(rf" INFO {bad_id} POST /v1/completions 400 total=.* error='.*'", out)
    assert '"POST /v1/completions' not in out  # hypercorn's access log is off by default


def test_stats_line_while_busy(hybrid):
    before = hybrid.output().count(" INFO stats ")
    _complete(hybrid, prompt="keep me busy", max_tokens=40, ignore_eos=True)
    time.sleep(0.5)  # the interval is 0.2 s
    lines = [x for x in hybrid.output().splitlines() if " INFO stats " in x]
    assert len(lines) > before
    assert re.search(
        r"stats running=\d+ waiting=\d+ prompt=\d+\.\d tok/s generation=\d+\.\d tok/s "
        r"kv_usage=\d+\.\d% prefix_hit_rate=(\d+\.\d%|-)$",
        lines[-1],
    ), lines[-1]
    # Idle: no more stats lines.
    time.sleep(0.5)
    count = hybrid.output().count(" INFO stats ")
    time.sleep(0.6)
    assert hybrid.output().count(" INFO stats ") == count


def test_log_level_warning_is_quiet(tmp_path):
    srv = Server(tmp_path, "quiet", pool_bytes="2MiB", extra=("--log-level", "warning"))
    try:
        srv.complete("hello", 3)
        srv.metrics()
        time.sleep(0.3)  # a request's line is written just after its response
        out = srv.output()
    finally:
        srv.close()
    assert " INFO " not in out and "POST /v1/completions" not in out, out


# --- metrics --------------------------------------------------------------------------------


def test_metrics_parse_with_help_and_model_name(hybrid):
    _complete(hybrid, prompt="metrics", max_tokens=3)
    r = hybrid.http.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=")
    families = list(text_string_to_metric_families(r.text))
    names = {f.name for f in families}
    vllm = [
        "kern_num_requests_running",
        "kern_num_requests_waiting",
        "kern_kv_cache_usage_perc",
        "kern_prefix_cache_queries",
        "kern_prefix_cache_hits",
        "kern_prompt_tokens",
        "kern_generation_tokens",
        "kern_num_preemptions",
        "kern_request_success",
        "kern_time_to_first_token_seconds",
        "kern_inter_token_latency_seconds",
        "kern_request_time_per_output_token_seconds",
        "kern_e2e_request_latency_seconds",
        "kern_request_queue_time_seconds",
        "kern_request_prefill_time_seconds",
        "kern_request_decode_time_seconds",
        "kern_request_inference_time_seconds",
        "kern_request_prompt_tokens",
        "kern_request_generation_tokens",
    ]
    own = ["kern_parked", "kern_woken", "kern_dropped_resident", "kern_dropped_parked"]
    own += ["kern_aborted", "kern_pool_pages_free", "kern_pool_slots_total"]
    assert set(vllm + own) <= names, set(vllm + own) - names
    assert any(n.startswith("process_") for n in names)
    for f in families:
        assert f.documentation.strip(), f"{f.name} has no HELP"
        assert f.samples, f.name
        for s in f.samples:
            assert s.labels.get("model_name") == MODEL, s
    success = next(f for f in families if f.name == "kern_request_success")
    assert {s.labels["finished_reason"] for s in success.samples} == {"stop", "length", "abort"}


def test_request_metrics_count_per_request_and_per_token(hybrid):
    m0 = hybrid.idle_metrics()
    r = _complete(hybrid, prompt="count me", max_tokens=7, ignore_eos=True)
    n_prompt = r.json()["usage"]["prompt_tokens"]
    m1 = hybrid.idle_metrics()

    def d(name: str) -> float:
        return m1[name] - m0[name]

    assert d("kern_generation_tokens_total") == 7
    assert d("kern_prompt_tokens_total") == n_prompt
    assert d("kern_prefix_cache_queries_total") == n_prompt
    assert d('kern_request_success_total{finished_reason="length"}') == 1
    assert d("kern_time_to_first_token_seconds_count") == 1
    # Inter-token latency is per token (6 gaps after the first), TPOT once per request.
    assert d("kern_inter_token_latency_seconds_count") == 6
    assert d("kern_request_time_per_output_token_seconds_count") == 1
    for name in ("e2e_request_latency", "request_queue_time", "request_prefill_time"):
        assert d(f"kern_{name}_seconds_count") == 1, name
    assert d("kern_request_decode_time_seconds_count") == 1
    assert d("kern_request_generation_tokens_sum") == 7
    assert d("kern_request_prompt_tokens_sum") == n_prompt
    e2e = d("kern_e2e_request_latency_seconds_sum")
    parts = d("kern_request_queue_time_seconds_sum") + d("kern_request_prefill_time_seconds_sum")
    assert 0 < parts + d("kern_request_decode_time_seconds_sum") <= e2e + 1e-6


def test_n_choices_count_the_prompt_once(hybrid):
    m0 = hybrid.idle_metrics()
    r = _complete(hybrid, prompt="two answers please", max_tokens=3, n=2, seed=1, temperature=1)
    assert r.status_code == 200, r.text
    n_prompt = r.json()["usage"]["prompt_tokens"]
    m1 = hybrid.idle_metrics()
    assert m1["kern_prompt_tokens_total"] - m0["kern_prompt_tokens_total"] == n_prompt
    assert m1["kern_request_prompt_tokens_count"] - m0["kern_request_prompt_tokens_count"] == 1
    # Two sequences ran and finished; the prompt's lookup counts once, as its hits do.
    queries = m1["kern_prefix_cache_queries_total"] - m0["kern_prefix_cache_queries_total"]
    assert queries == n_prompt
    finished = "kern_request_generation_tokens_count"
    assert m1[finished] - m0[finished] == 2


def test_a_stop_string_is_not_an_abort(hybrid, tiny_dir):
    ckpt = load_checkpoint(tiny_dir("qwen3_5"))
    prompt = ckpt.tokenizer.encode("The answer is")
    ids = generate(ckpt, prompt, 16, page_tokens=16, threads=2).ids
    text = ckpt.tokenizer.decode(ids, skip_special_tokens=True)
    stop = next(text[i : i + 2] for i in range(2, len(text) - 1) if text[i : i + 2].strip())
    m0 = hybrid.idle_metrics()
    r = _complete(hybrid, prompt=prompt, max_tokens=16, stop=[stop], ignore_eos=True)
    assert r.json()["choices"][0]["finish_reason"] == "stop", r.text
    m1 = hybrid.idle_metrics()
    assert m1["kern_aborted_total"] == m0["kern_aborted_total"]
    stop_key = 'kern_request_success_total{finished_reason="stop"}'
    abort_key = 'kern_request_success_total{finished_reason="abort"}'
    assert m1[stop_key] == m0[stop_key] + 1
    assert m1[abort_key] == m0[abort_key]
    hybrid.assert_no_leak(min_slots=2)


def test_hang_up_is_an_abort(hybrid):
    m0 = hybrid.idle_metrics()
    body = {"model": MODEL, "prompt": "bye", "max_tokens": 2000, "ignore_eos": True}
    with hybrid.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n == 4:
                break
    m1 = hybrid.idle_metrics()
    assert m1["kern_aborted_total"] == m0["kern_aborted_total"] + 1
    abort_key = 'kern_request_success_total{finished_reason="abort"}'
    assert m1[abort_key] == m0[abort_key] + 1
    hybrid.assert_no_leak(min_slots=2)


def test_slot_gauges_add_up(hybrid):
    m = hybrid.idle_metrics()
    total = m["kern_pool_slots_total"]
    assert total >= 2
    assert m["kern_pool_slots_free"] + m["kern_pool_slots_held"] + m["kern_pool_slots_cached"] == (
        total
    )
    assert 0 <= m["kern_pool_slots_free"] <= total
    assert m["kern_kv_cache_usage_perc"] == 0  # nothing held once idle


def test_metrics_without_a_server():
    """The same names from an in-process registry: one per app, no global state."""
    from kern.metrics import GAUGES, Metrics

    a, b = Metrics("a"), Metrics("b")
    a.prompt_tokens.inc(3)
    assert a.value("kern_prompt_tokens_total") == 3 and b.value("kern_prompt_tokens_total") == 0
    from prometheus_client import generate_latest

    parsed = parse_metrics(generate_latest(b.registry).decode(), "b")
    assert set(GAUGES) <= set(parsed)


# --- kern bench -----------------------------------------------------------------------------


def test_bench_counts_failures_and_checks_its_arguments(tmp_path):
    out = kern("bench", "--url", "http://127.0.0.1:9", "--requests", "1")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "kern bench: error: --url http://127.0.0.1:9: no server answers" in out.stderr
    for args, message in (
        (["--requests", "0"], "argument --requests: 0 is not a positive integer"),
        (["--concurrency", "2,0"], "every level must be at least 1"),
        (["--prompt-tokens", "8"], "--shared-prefix 32 is longer than --prompt-tokens 8"),
        (["--request-rate", "0"], "the rate must be above 0"),
    ):
        out = kern("bench", *args)
        assert out.returncode == 2 and message in out.stderr, (args, out.stderr)
    # 8 pages of 16 tokens: a 64 + 100 token request can never fit, every one is a 400.
    srv = Server(tmp_path, "bench", pool_bytes="64KiB")
    try:
        base = ["bench", "--url", srv.url, "--api-key", KEY, "--json"]
        out = kern(*base, "--concurrency", "2", "--requests", "3", "--max-tokens", "100")
        assert out.returncode == 0, out.stderr
        assert "Failed requests:                                 3" in out.stdout
        row = json.loads(out.stdout.strip().rsplit("\n", 1)[1])[0]
        assert row["completed"] == 0 and row["failed"] == 3
        [(error, count)] = row["errors"].items()
        assert count == 3 and error.startswith("HTTP 400: prompt (64 tokens) + max_tokens (100)")
        assert row["mean_ttft_ms"] is None
        # Poisson arrivals at 50 requests/s: all succeed, every latency is reported.
        out = kern(
            *base,
            "--concurrency",
            "2",
            "--requests",
            "4",
            "--max-tokens",
            "4",
            "--request-rate",
            "50",
        )
        assert out.returncode == 0, out.stderr
        row = json.loads(out.stdout.strip().rsplit("\n", 1)[1])[0]
        assert row["completed"] == 4 and row["failed"] == 0
        for key in ("ttft", "tpot", "itl", "e2el"):
            for stat in ("mean", "median", "p99"):
                assert row[f"{stat}_{key}_ms"] > 0, (key, stat)
        for title in ("Time to First Token", "Inter-token Latency", "End-to-end Latency"):
            assert title in out.stdout
    finally:
        srv.close()
