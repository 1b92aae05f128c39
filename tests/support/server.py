"""The server as a subprocess for the suites that drive one over real HTTP: ``Server`` starts
``kern serve`` (or a given command) on a free loopback port and waits for ``/health``;
``parse_metrics`` reads ``/metrics`` as prometheus_client does."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kern.tiny import default_model_path

KEY = "test-key"
MODEL = "tiny"


def parse_metrics(text: str, model: str) -> dict[str, float]:
    """Sample name, with its labels but ``model_name`` (asserted to be ``model``) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name") == model, s
            key = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            out[s.name + (f"{{{key}}}" if key else "")] = s.value
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(
        self,
        tmp: Path,
        name: str,
        *,
        pool_bytes: str,
        host_bytes: str = "0",
        env=None,
        checkpoint: Path | None = None,
        command: list[str] | None = None,
        model: Path | None = None,
        extra: tuple[str, ...] = (),
        key: str = KEY,
    ) -> None:
        """A kern.toml target ``MODEL`` of ``checkpoint``; or, with ``model``, the folder
        served by ``kern serve --model`` and flags, no kern.toml; or ``command``."""
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = tmp / f"{name}.toml"
        config.write_text(
            f'[targets.{MODEL}]\ncheckpoint = "{checkpoint or default_model_path()}"\n'
            f'pool_bytes = "{pool_bytes}"\nhost_bytes = "{host_bytes}"\n'
        )
        self.log = open(tmp / f"{name}.log", "w+b")  # noqa: SIM115 - closed in close()
        # The installed package, as a user runs it (the source tree has no built extension).
        # The key from the environment (a flag would show in ps, and kern serve warns).
        env = {**os.environ, "KERN_API_KEY": KEY, **(env or {})}
        serve = [sys.executable, "-m", "kern.cli", "serve", "--port", str(self.port)]
        serve += [*extra]
        if model is not None:
            command = [*serve, "--model", str(model), "--served-model-name", MODEL]
            command += ["--pool-bytes", pool_bytes, "--host-bytes", host_bytes]
        elif command is None:
            command = [*serve, "--config", str(config), "--target", MODEL]
        else:
            command = [c.replace("{port}", str(self.port)) for c in command]
            env.update(KERN_API_KEY=KEY, KERN_CONFIG=str(config), KERN_TARGET=MODEL)
        self.proc = subprocess.Popen(
            command,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.http = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {key}"}, timeout=60
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                output = self.output()
                self.close()
                raise RuntimeError(f"server did not start:\n{output}")
            time.sleep(0.2)
        self.start = self.metrics()

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as parsed by prometheus_client: sample name (with its labels other
        than ``model_name``, which every sample must carry) -> value."""
        return parse_metrics(self.http.get("/metrics").text, MODEL)

    def idle_metrics(self) -> dict[str, float]:
        """Metrics once nothing runs or waits (aborts land within a step)."""
        deadline = time.monotonic() + 10
        while True:
            m = self.metrics()
            if (
                m["kern_num_requests_running"] == 0 and m["kern_num_requests_waiting"] == 0
            ) or time.monotonic() > deadline:
                return m
            time.sleep(0.05)

    def assert_no_leak(self, min_slots: int | None = None, *, counts: bool = True) -> None:
        """Nothing held once idle: every page is free or cached in the tree (evictable,
        unlocked). On a stateful model (``min_slots``: the slots it starts with) the tree's
        state snapshots sit in chunks the slots took from the pages; this form assumes the
        fixture's layout of one page or one slot per chunk (``counts=False``: a layout of
        several a chunk, checked for nothing held only)."""
        m = self.idle_metrics()
        assert m["kern_pool_pages_held"] == 0
        assert m["kern_pool_slots_held"] == 0
        if not counts:
            return
        # Empty slot chunks count in pages_free already (the pages may take them back).
        taken = 0 if min_slots is None else max(0, m["kern_pool_slots_cached"] - min_slots)
        assert m["kern_pool_pages_free"] + m["kern_pool_pages_cached"] + taken == (
            self.start["kern_pool_pages_free"] + self.start["kern_pool_pages_cached"]
        )

    def complete(self, prompt, max_tokens: int = 16, **kw) -> dict:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        body["return_token_ids"] = True
        r = self.http.post("/v1/completions", json={**body, **kw})
        assert r.status_code == 200, r.text
        return r.json()

    def close(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# The tiny template without tools, whose generation prompt opens a <think> block unless
# enable_thinking is false (as Qwen3.5-style templates do).
THINKING_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' ~ m['role'] ~ '\\n' ~ m['content'] ~ "
    "'<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)


def thinking_server(tmp: Path) -> Server:
    """``kern serve`` of the embedded model with :data:`THINKING_TEMPLATE` and the qwen3
    reasoning parser."""
    import json
    import shutil

    ckpt = tmp / "ckpt"
    shutil.copytree(default_model_path(), ckpt)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    config["chat_template"] = THINKING_TEMPLATE
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config))
    return Server(
        tmp, "thinking", pool_bytes="4MiB", model=ckpt, extra=("--reasoning-parser", "qwen3")
    )
