"""Ranks (kern.engine.ranks, kern.engine.ranks.shard): what each rank reads, identity within a rank
count (served under load == kern run at the same ranks), and faults: a rank killed while loading,
while a step runs and while idle, or stopped (SIGSTOP), ends the server with exit code 101, one line
naming the rank, and a free port, within the watchdog's bound.

Every rank runs one thread (this machine has two cores for all of them).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from kern.engine.ranks.launch import BEAT_S, EXIT_CODE, HANG_S
from kern.engine.ranks.runner import RankedRunner
from kern.engine.ranks.shard import Shard, ShardError, load_shard
from kern.kern_toml import TomlConfigError, load_toml_config

PROMPTS = ["hello world, how", "the cat sat on the", "1, 2, 3, 4,", "once upon a time"]


@pytest.fixture(scope="module")
def toml(tmp_path_factory, tiny_dir) -> Path:
    path = tmp_path_factory.mktemp("ranks") / "kern.toml"
    qwen3, moe = tiny_dir("qwen3"), tiny_dir("qwen3_moe")
    path.write_text(
        f'[targets.tp]\ncheckpoint = "{qwen3}"\nranks = 2\nparallel = "tp"\nthreads = 1\n'
        f'pool_bytes = "4MiB"\n'
        f'[targets.ep]\ncheckpoint = "{moe}"\nranks = 2\nparallel = "ep"\nthreads = 1\n'
        f'pool_bytes = "4MiB"\n'
        f'[targets.hybrid]\ncheckpoint = "{tiny_dir("qwen3_5")}"\nranks = 2\nthreads = 1\n'
        f'pool_bytes = "1MiB"\n'
        f'[targets.park]\ncheckpoint = "{qwen3}"\nranks = 2\nthreads = 1\n'
        f'pool_bytes = "512KiB"\nhost_bytes = "4MiB"\n'
        f'[targets.one]\ncheckpoint = "{qwen3}"\nthreads = 1\n'
        f'[targets.ep_dense]\ncheckpoint = "{qwen3}"\nranks = 2\nparallel = "ep"\n'
        f'[targets.three]\ncheckpoint = "{qwen3}"\nranks = 3\n'
    )
    return path


def kern(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kern.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def run_ids(toml: Path, target: str, prompt: str | list[int], steps: int) -> list[int]:
    given = (
        ["--prompt", prompt]
        if isinstance(prompt, str)
        else ["--prompt-ids", ",".join(map(str, prompt))]
    )
    out = kern("run", "--config", str(toml), "--target", target, *given, "--steps", str(steps),
               "--ignore-eos", "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["ids"]


# --- what a rank reads ------------------------------------------------------------------------


def test_each_rank_reads_only_its_slices(tiny, tiny_dir):
    full = tiny("qwen3")
    parts = [load_shard(tiny_dir("qwen3"), Shard(r, 2, "tp")) for r in range(2)]
    for name, t in full.tensors.items():
        if name.endswith(
            (
                "q_proj.weight",
                "k_proj.weight",
                "v_proj.weight",
                "up_proj.weight",
                "gate_proj.weight",
            )
        ):
            assert all(p.tensors[name].shape[0] * 2 == t.shape[0] for p in parts), name
            assert (parts[0].tensors[name] == t[: t.shape[0] // 2]).all()
            assert (parts[1].tensors[name] == t[t.shape[0] // 2 :]).all()
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert (parts[1].tensors[name] == t[:, t.shape[1] // 2 :]).all(), name
        elif name == "lm_head.weight":
            assert (parts[0].tensors[name] == t).all()
            assert parts[1].tensors[name].shape[0] == 1  # rank 1 computes no logits
        else:
            assert all((p.tensors[name] == t).all() for p in parts), name
    c = parts[1].config
    assert c.num_attention_heads * 2 == full.config.num_attention_heads
    assert c.num_key_value_heads * 2 == full.config.num_key_value_heads
    assert c.intermediate_size * 2 == full.config.intermediate_size


def test_deltanet_layers_split_by_heads(tiny, tiny_dir):
    full = tiny("qwen3_5")
    c = full.config
    parts = [load_shard(tiny_dir("qwen3_5"), Shard(r, 2, "tp")) for r in range(2)]
    d = c.delta
    key_dim = d.num_key_heads * d.key_head_dim
    sizes = (key_dim, key_dim, d.num_value_heads * d.value_head_dim)
    for name in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
        name = next(n for n in full.tensors if n.endswith(name))
        whole = full.tensors[name].split(sizes)  # q, k, v
        halves = [p.tensors[name].split([s // 2 for s in sizes]) for p in parts]
        for j in range(3):
            assert (torch.cat([halves[0][j], halves[1][j]]) == whole[j]).all(), (name, j)
    assert parts[0].config.delta.num_value_heads * 2 == d.num_value_heads
    assert parts[1].config.delta.num_key_heads * 2 == d.num_key_heads


def test_expert_parallel_ranks_hold_disjoint_experts(tiny, tiny_dir):
    full = tiny("qwen3_moe")
    parts = [load_shard(tiny_dir("qwen3_moe"), Shard(r, 2, "ep")) for r in range(2)]
    experts = [{n for n in p.tensors if ".experts." in n} for p in parts]
    assert not experts[0] & experts[1]
    assert experts[0] | experts[1] == {n for n in full.tensors if ".experts." in n}
    assert all(".experts.1." not in n for n in experts[0])
    for name in experts[1]:
        assert (parts[1].tensors[name] == full.tensors[name]).all()  # whole experts


def test_what_does_not_split_is_refused_by_name(tiny):
    c = tiny("qwen3").config
    with pytest.raises(ShardError, match="does not divide the model's num_attention_heads"):
        Shard(0, 3, "tp").check(c)
    ep_families = (
        "qwen3_moe, qwen3_next, qwen3_5_moe, gpt_oss, deepseek_v3, kimi_linear, deepseek_v4"
    )
    with pytest.raises(ShardError, match=f"'ep' is implemented for {ep_families}, not qwen3"):
        Shard(0, 2, "ep").check(c)
    with pytest.raises(ShardError, match=f"'ep' is implemented for {ep_families}, not qwen3_5"):
        Shard(0, 2, "ep").check(tiny("qwen3_5").config)
    with pytest.raises(ShardError, match=r"does not divide the model's linear_num_key_heads \(2\)"):
        Shard(0, 4, "tp").check(
            dataclasses.replace(
                tiny("qwen3_5").config,
                num_key_value_heads=4,
                num_attention_heads=4,
                intermediate_size=128,
            )
        )


def test_config_keys(tmp_path, toml):
    bad = tmp_path / "bad.toml"
    bad.write_text('[targets.a]\ncheckpoint = "c"\nranks = 2\nparallel = "pp"\n')
    with pytest.raises(TomlConfigError, match=r"targets.a.parallel: 'pp' is not one of tp, ep"):
        load_toml_config(bad)
    bad.write_text('[targets.a]\ncheckpoint = "c"\nparallel = "tp"\n')
    with pytest.raises(TomlConfigError, match="targets.a.parallel: says how ranks split"):
        load_toml_config(bad)
    assert load_toml_config(toml).target("ep").parallel == "ep"
    for target, message in (
        ("ep_dense", "targets.ep_dense.ranks: parallel = 'ep' is implemented for qwen3_moe"),
        ("three", "targets.three.ranks: ranks = 3 does not divide"),
    ):
        out = kern(
            "run", "--config", str(toml), "--target", target, "--prompt", "a", "--steps", "1"
        )
        assert out.returncode == 2 and message in out.stderr, out.stderr
    out = kern("test", "--config", str(toml), "--target", "tp")
    assert out.returncode == 2 and "kern test checks one rank's backend" in out.stderr


def test_a_runner_call_that_is_not_broadcast_is_refused():
    class Fake:
        stateful = False

        def kv_at(self) -> str:
            return "rank 0's heads"

        def discard(self) -> None:
            raise AssertionError("must not run on rank 0 alone")

    runner = RankedRunner(Fake(), send=None, guard=None)  # type: ignore[arg-type]
    assert runner.stateful is False and runner.kv_at() == "rank 0's heads"
    with pytest.raises(AttributeError, match=r"Runner.discard is not broadcast"):
        runner.discard()


# --- identity within a rank count ------------------------------------------------------------


class Server:
    """``kern serve --config TOML --target NAME`` on a free port, as a subprocess."""

    def __init__(self, toml: Path, target: str, log: Path, *, hypercorn: bool = False) -> None:
        self.target = target
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._log = open(log, "wb")  # noqa: SIM115 - closed in close()
        cmd = [sys.executable, "-m", "kern.cli", "serve", "--config", str(toml)]
        cmd += ["--target", target, "--port", str(self.port)]
        env = dict(os.environ)
        if hypercorn:
            cmd = [sys.executable, "-m", "hypercorn", "kern.app:app"]
            cmd += ["--bind", f"127.0.0.1:{self.port}"]
            env.update(KERN_CONFIG=str(toml), KERN_TARGET=target)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, self.output()
            time.sleep(0.2)
        raise AssertionError(f"server did not start:\n{self.output()}")

    def rank_pids(self, timeout: float = 60) -> list[int]:
        """The rank processes this server started (waits for them to appear)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = _children(self.proc.pid, "kern.engine.ranks")
            if pids:
                return pids
            time.sleep(0.02)
        raise AssertionError("no rank process appeared")

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith((name + " ", name + "{"))
        )

    def usage(self, prompt: str | list[int], max_tokens: int) -> tuple[list[int], int]:
        body = {"model": self.target, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        return r.json()["choices"][0]["token_ids"], cached

    def complete(self, prompt: str, max_tokens: int) -> list[int]:
        body = {
            "model": self.target,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        r = httpx.post(self.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_exit(self, timeout: float) -> tuple[int, float]:
        t0 = time.monotonic()
        code = self.proc.wait(timeout=timeout)
        return code, time.monotonic() - t0

    def close(self) -> None:
        self._log.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_is_free(port: int) -> bool:
    """Nothing listens on ``port`` (a closed connection's TIME_WAIT may remain: a server
    binds with SO_REUSEADDR, as this does)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _children(ancestor: int, needle: str) -> list[int]:
    """Processes below ``ancestor`` (children, or further down: hypercorn runs its app in a
    worker process) whose command line holds ``needle``."""
    parents: dict[int, int] = {}
    cmdlines: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdlines[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])

    def below(pid: int) -> bool:
        while pid > 1:
            pid = parents.get(pid, 0)
            if pid == ancestor:
                return True
        return False

    return [pid for pid, cmd in cmdlines.items() if needle in cmd and below(pid)]


# tp (qwen3) and ep (qwen3_moe) at 2 ranks are gated end to end (tools/e2e: qwen3-tp2,
# qwen3_moe-ep2), ep at 4 ranks below; here the stateful hybrid (states split by heads).
@pytest.mark.parametrize("target", ["hybrid"])
def test_served_under_load_equals_kern_run_at_the_same_ranks(toml, tmp_path, target):
    steps = 24
    server = Server(toml, target, tmp_path / "serve.log")
    try:
        server.wait_ready()
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            served = list(pool.map(lambda p: server.complete(p, steps), PROMPTS))
        # A repeat hits the prefix cache: pages written by both ranks, read back by both.
        again = server.complete(PROMPTS[0], steps)
    finally:
        server.close()
    assert server.proc.returncode == 0, server.output()
    assert again == served[0]
    for prompt, ids in zip(PROMPTS, served, strict=True):
        assert ids == run_ids(toml, target, prompt, steps), prompt


def test_plans_land_on_every_rank_parked_and_woken(toml, tmp_path):
    """A small pool with a host tier: fillers park a prefix (each rank copies its own pages
    to its host arena), its next turn wakes it; the answer equals kern run at 2 ranks."""
    gen = torch.Generator().manual_seed(0)
    first = torch.randint(0, 500, (40,), generator=gen).tolist()
    server = Server(toml, "park", tmp_path / "serve.log")
    try:
        server.wait_ready()
        answer, _ = server.usage(first, 8)
        for _ in range(40):
            if server.metric("kern_parked_total") > 0:
                break
            server.usage(torch.randint(0, 500, (200,), generator=gen).tolist(), 1)
        assert server.metric("kern_parked_total") > 0
        turn = first + answer + [5, 6, 7]
        got, cached = server.usage(turn, 8)
        assert server.metric("kern_woken_total") > 0
        assert cached >= len(first) + len(answer) - 1
    finally:
        server.close()
    assert server.proc.returncode == 0, server.output()
    assert got == run_ids(toml, "park", turn, 8)


def test_hypercorn_serves_ranks(toml, tmp_path):
    server = Server(toml, "ep", tmp_path / "serve.log", hypercorn=True)
    try:
        server.wait_ready()
        (pid,) = server.rank_pids()
        served = server.complete(PROMPTS[2], 12)
    finally:
        server.close()
    assert server.proc.returncode == 0, server.output()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)  # the rank ends with its parent (PR_SET_PDEATHSIG)
    assert not Path(f"/proc/{pid}").exists()
    assert served == run_ids(toml, "ep", PROMPTS[2], 12)


def test_four_ranks_served_equal_kern_run_at_four(tmp_path_factory):
    """4 ranks (expert parallel, attention split four ways): served at once == kern run."""
    from kern.tiny import make_tiny

    folder = tmp_path_factory.mktemp("four")
    ckpt = make_tiny("qwen3_moe", folder / "moe", seed=1, kv_heads=4)
    toml = folder / "kern.toml"
    toml.write_text(
        f'[targets.ep4]\ncheckpoint = "{ckpt}"\nranks = 4\nparallel = "ep"\nthreads = 1\n'
        'pool_bytes = "4MiB"\n'
    )
    server = Server(toml, "ep4", folder / "serve.log")
    try:
        server.wait_ready()
        assert len(server.rank_pids()) == 3
        with ThreadPoolExecutor(2) as pool:
            served = list(pool.map(lambda p: server.complete(p, 12), PROMPTS[:2]))
    finally:
        server.close()
    assert server.proc.returncode == 0, server.output()
    for prompt, ids in zip(PROMPTS[:2], served, strict=True):
        assert ids == run_ids(toml, "ep4", prompt, 12), prompt


# --- faults ------------------------------------------------------------------------------------


def _ends_naming_rank_1(server: Server, bound: float, log_needle: str) -> float:
    code, took = server.wait_exit(timeout=bound + 30)
    out = server.output()
    assert code == EXIT_CODE, out
    assert "kern: rank 1 of 2 (pid " in out and log_needle in out, out
    assert "ending all ranks (exit code 101)" in out, out
    assert _port_is_free(server.port)
    assert took <= bound, (took, out)
    return took


def test_a_rank_killed_while_loading_ends_the_server(toml, tmp_path):
    server = Server(toml, "tp", tmp_path / "serve.log")
    try:
        (pid,) = server.rank_pids()
        os.kill(pid, signal.SIGKILL)
        _ends_naming_rank_1(server, 4 * BEAT_S + 5, "was killed by signal 9")
    finally:
        server.close()


def test_a_rank_killed_while_idle_ends_the_server(toml, tmp_path):
    server = Server(toml, "ep", tmp_path / "serve.log")
    try:
        server.wait_ready()
        (pid,) = server.rank_pids()
        os.kill(pid, signal.SIGKILL)
        _ends_naming_rank_1(server, 4 * BEAT_S + 5, "was killed by signal 9")
    finally:
        server.close()


def test_a_rank_killed_mid_step_ends_the_server_and_its_streams(toml, tmp_path):
    server = Server(toml, "tp", tmp_path / "serve.log")
    try:
        server.wait_ready()
        (pid,) = server.rank_pids()
        body = {
            "model": "tp",
            "prompt": "a",
            "max_tokens": 3000,
            "ignore_eos": True,
            "stream": True,
        }
        got = 0
        with pytest.raises(httpx.HTTPError):  # noqa: PT012 - the stream breaks mid-way
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        got += 1
                        if got == 20:
                            os.kill(pid, signal.SIGKILL)
        assert got >= 20
        _ends_naming_rank_1(server, 4 * BEAT_S + 5, "was killed by signal 9")
    finally:
        server.close()


def _gone(pid: int) -> bool:
    """Exited (or a zombie): nothing of it runs any more."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith(("Z", "X"))
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_a_stopped_rank_ends_the_server_within_the_bound(toml, tmp_path):
    server = Server(toml, "tp", tmp_path / "serve.log")
    try:
        server.wait_ready()
        (pid,) = server.rank_pids()
        os.kill(pid, signal.SIGSTOP)
        took = _ends_naming_rank_1(server, HANG_S + 4 * BEAT_S + 3, "stopped responding")
        assert took >= HANG_S - 1
        # SIGKILL is delivered at once but a process with torch mapped takes a moment to exit
        # on a loaded machine (CI saw it still in state R, reparented): wait for it to go.
        deadline = time.monotonic() + 30
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pid), Path(f"/proc/{pid}/stat").read_text()
    finally:
        server.close()


def test_two_nodes_on_loopback_join_through_the_environment(toml, tmp_path):
    """Rank 0 as one "node" (it starts no rank itself: KERN_LOCAL_RANKS=1) and rank 1 as
    another, started apart in a session of its own, joined by MASTER_ADDR / MASTER_PORT:
    the answer is the one kern run gives when it starts both ranks itself."""
    port = _free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env.pop("KERN_LOCAL_RANKS", None)
    node0 = subprocess.Popen(
        [sys.executable, "-m", "kern.cli", "run", "--config", str(toml), "--target", "tp",
         "--prompt", PROMPTS[1], "--steps", "12", "--ignore-eos", "--json"],
        env={**env, "KERN_LOCAL_RANKS": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    node1 = subprocess.Popen(
        [sys.executable, "-m", "kern.engine.ranks"],
        env={**env, "RANK": "1", "WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "lo"},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = node0.communicate(timeout=120)
        assert node0.returncode == 0, err
        _, err1 = node1.communicate(timeout=30)
        assert node1.returncode == 0, err1
    finally:
        for proc in (node0, node1):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert json.loads(out)["ids"] == run_ids(toml, "tp", PROMPTS[1], 12)
