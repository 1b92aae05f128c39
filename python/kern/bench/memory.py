"""Memory against the budgets: ``python -m kern.bench.memory``.

For each family (a ``make-tiny`` checkpoint unless ``--model`` is given), a ``kern serve``
subprocess is started on a loopback port with ``--pool-bytes`` and ``--host-bytes``, answers
one request, and is measured: the arenas it allocated (``kern_device_arena_bytes`` and
``kern_host_arena_bytes`` from ``/metrics``) and its peak resident memory (``VmHWM`` from
``/proc``). The same server on a 1 MiB pool with no host tier, measured the same way, is the
baseline: the difference is what the budgets cost. The host arena is allocated but only
touched where entries are parked, so a fresh server's RSS grows by the device budget alone.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

MIB = 2**20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, body: dict | None = None) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=120) as r:
        return r.read()


def measure(checkpoint: Path, pool: str, host: str, work: Path) -> dict[str, float]:
    """Serve ``checkpoint`` with these budgets; its arenas and peak RSS after one request."""
    port = _free_port()
    config = work / f"mem-{port}.toml"
    config.write_text(
        f'[targets.m]\ncheckpoint = "{checkpoint}"\npool_bytes = "{pool}"\nhost_bytes = "{host}"\n'
    )
    cmd = [sys.executable, "-m", "kern.cli", "serve", "--config", str(config), "--target", "m"]
    cmd += ["--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                _get(url + "/health")
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read().decode() if proc.stderr else ""
                    raise SystemExit(f"the server did not start:\n{err}") from None
                time.sleep(0.2)
        body = {"model": "m", "prompt": list(range(3, 40)), "max_tokens": 8, "temperature": 0}
        _get(url + "/v1/completions", body)
        out = {"rss": _peak_rss(proc.pid)}
        for line in _get(url + "/metrics").decode().splitlines():
            for name in ("kern_device_arena_bytes", "kern_host_arena_bytes"):
                if line.startswith(name):
                    out[name] = float(line.rsplit(" ", 1)[1])
        return out
    finally:
        proc.terminate()
        proc.wait(30)


def _peak_rss(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024.0
    raise RuntimeError("no VmHWM")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kern.bench.memory", description=__doc__)
    p.add_argument("--families", default="qwen3,qwen3_5,qwen3_moe")
    p.add_argument("--model", type=Path, help="a checkpoint folder instead of make-tiny ones")
    p.add_argument("--pool-bytes", default="256MiB")
    p.add_argument("--host-bytes", default="512MiB")
    args = p.parse_args(argv)
    from kern.tiny import make_tiny

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.model is not None:
            models = {args.model.name: args.model.resolve()}
        else:
            models = {f: make_tiny(f, work / f, seed=1) for f in args.families.split(",") if f}
        print(f"pool_bytes = {args.pool_bytes}, host_bytes = {args.host_bytes}")
        print(
            "| model | weights MiB | device arena MiB | host arena MiB | peak RSS MiB "
            "| RSS on a 1 MiB pool | RSS added by the budgets MiB |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for name, path in models.items():
            weights = sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) / MIB
            base = measure(path, "1MiB", "0", work)
            big = measure(path, args.pool_bytes, args.host_bytes, work)
            dev = big.get("kern_device_arena_bytes", float("nan")) / MIB
            host = big.get("kern_host_arena_bytes", float("nan")) / MIB
            print(
                f"| {name} | {weights:.1f} | {dev:.1f} | {host:.1f} | {big['rss'] / MIB:.0f} "
                f"| {base['rss'] / MIB:.0f} | {(big['rss'] - base['rss']) / MIB:.0f} |"
            )


if __name__ == "__main__":
    main()
