"""A soak: hours of mixed, partly hostile load on one server, watching for what only time shows
(memory or file descriptors that creep, books that stop balancing, a rare 5xx).

    python -m kern.bench.soak [--minutes 30] [--concurrency 64] [--url URL [--pid PID]]

Without ``--url`` it starts ``kern serve`` of the embedded tiny model itself (a subprocess on
a free loopback port) with a small pool and a host tier, so parking, waking and preemption
happen all the time (``--pool-bytes 1MiB --host-bytes 8MiB``: 128 device pages of 16 tokens,
1,024 host pages), and speculative rows (``--rows 4``, n-gram drafts). The workers
(kern.bench.soak_load) mix whole answers, streams, hang-ups at random points, bad bodies and
long prompts that share prefixes.

Every ``--sample-seconds`` it reads the server process's RSS, open file descriptors and
threads from ``/proc/PID`` (with ``--url``: ``--pid``, else the ``process_*`` series of
``/metrics``) and the pool's gauges, one table row each.

Verdict (exit 1 unless all hold):
* no 5xx, no timeout, no transport error, no stream cut short, no unreadable 2xx answer,
  no bad body accepted;
* RSS flat after the warm-up (the first ``--warmup-minutes``, default a third of the run, at
  most 5): the least-squares trend of the samples after it grows by at most
  max(8 MiB, 2% of the first of them) over that span;
* file descriptors back: once the load has stopped and the client's connections are closed,
  the count returns to the idle count before the load within 10 s;
* books balanced once idle: no page or slot held by a request, device pages free + cached ==
  total, host pages free + parked == the host tier's size.

``--malloc-arena-max N`` runs the server under ``MALLOC_ARENA_MAX=N`` and ``--server-env
NAME=VALUE`` sets any variable of it (default: neither, as ``kern serve`` runs): RSS that
creeps while the Python objects stay flat is glibc's to explain or the project's. Measured
(docs/performance.md, "Soak"): ``MALLOC_ARENA_MAX=2`` changed nothing, while a fixed
``MALLOC_MMAP_THRESHOLD_=131072`` (large tensors mapped and unmapped, not carved from a heap
that fragments) made RSS flat after a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kern.bench.soak_load import Tally, Workload

__all__ = ["main"]

MIB = 2**20
# Seconds the server gets to close its ends of the connections after the load: past kern
# serve's 10 s keep-alive, so a connection the client left open is closed by then.
FDS_SETTLE_SECONDS = 20.0


@dataclass
class Sample:
    t: float  # seconds since the load started
    rss: float  # bytes
    fds: int
    threads: int
    requests: int  # requests sent so far
    gauges: dict[str, float]


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name{labels but model_name}: value}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        name, _, labels = key.partition("{")
        kept = [p for p in labels.rstrip("}").split(",") if p and not p.startswith("model_name=")]
        out[name + (f"{{{','.join(kept)}}}" if kept else "")] = float(value)
    return out


class Target:
    """The server under load: started here (``proc``) or reached at ``url``."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.key: str | None = os.environ.get("KERN_API_KEY")
        self.pid: int | None = args.pid
        self.log_path: Path | None = None
        if args.url:
            self.url = args.url.rstrip("/")
            return
        self.key = secrets.token_hex(16)
        env = {**os.environ, "KERN_API_KEY": self.key}
        if args.malloc_arena_max:
            env["MALLOC_ARENA_MAX"] = str(args.malloc_arena_max)
        for item in args.server_env:
            name, _, value = item.partition("=")
            env[name] = value
        with socket.socket() as probe:  # a free loopback port (kern serve's tests do the same)
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "kern.cli", "serve", "--port", str(port)]
        command += ["--pool-bytes", args.pool_bytes, "--host-bytes", args.host_bytes]
        command += ["--rows", str(args.rows), "--log-level", "warning", "--stats-interval", "0"]
        self.log_path = workdir / "server.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.pid = self.proc.pid
        deadline = time.monotonic() + 120
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"soak: the server did not start:\n{self.log_path.read_text()}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> int | None:
        """SIGTERM, then the exit code (None: not ours)."""
        if self.proc is None:
            return None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _proc(pid: int) -> tuple[float, int, int]:
    """(RSS bytes, open fds, threads) of ``pid`` from /proc."""
    rss = threads = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return float(rss), len(os.listdir(f"/proc/{pid}/fd")), threads


async def _sample(client: httpx.AsyncClient, pid: int | None, t0: float, sent: int) -> Sample:
    m = parse_metrics((await client.get("/metrics")).text)
    if pid is not None:
        rss, fds, threads = _proc(pid)
    else:
        rss, fds = m.get("process_resident_memory_bytes", 0.0), int(m.get("process_open_fds", 0))
        threads = 0
    return Sample(time.monotonic() - t0, rss, fds, threads, sent, m)


async def _idle(client: httpx.AsyncClient, seconds: float) -> dict[str, float]:
    """/metrics once nothing runs or waits (or after ``seconds``)."""
    deadline = time.monotonic() + seconds
    while True:
        m = parse_metrics((await client.get("/metrics")).text)
        busy = m["kern_num_requests_running"] or m["kern_num_requests_waiting"]
        if not busy or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.2)


def _trend(samples: list[Sample]) -> float:
    """Least-squares RSS growth (bytes) over the samples' span."""
    n = len(samples)
    if n < 2:
        return 0.0
    mt = sum(s.t for s in samples) / n
    mr = sum(s.rss for s in samples) / n
    var = sum((s.t - mt) ** 2 for s in samples)
    if var == 0:
        return 0.0
    slope = sum((s.t - mt) * (s.rss - mr) for s in samples) / var
    return slope * (samples[-1].t - samples[0].t)


def _row(s: Sample) -> str:
    g = s.gauges
    return (
        f"{s.t / 60:7.1f} {s.requests:9d} {s.rss / MIB:8.1f} {s.fds:5d} {s.threads:7d} "
        f"{g['kern_num_requests_running']:7.0f} {g['kern_num_requests_waiting']:7.0f} "
        f"{g['kern_pool_pages_cached']:6.0f} {g['kern_host_pages_parked']:6.0f}"
    )


async def soak(args: argparse.Namespace, target: Target) -> bool:
    """Run the load and print the report; True when every check of the verdict holds."""
    headers = {"Authorization": f"Bearer {target.key}"} if target.key else {}
    async with httpx.AsyncClient(base_url=target.url, headers=headers, timeout=30) as admin:
        try:
            models = await admin.get("/v1/models")
        except httpx.TransportError as e:
            raise SystemExit(f"soak: cannot reach {target.url}: {e}") from None
        if models.status_code != 200:
            raise SystemExit(f"soak: {target.url}/v1/models: HTTP {models.status_code}")
        model = models.json()["data"][0]["id"]
        before = await _idle(admin, 30)
        pid = target.pid
        idle_fds = _proc(pid)[1] if pid is not None else int(before.get("process_open_fds", 0))
        load = Workload(
            target.url,
            target.key,
            model,
            seed=args.seed,
            max_tokens=args.max_tokens,
            timeout=args.request_timeout,
        )
        tally = load.tally
        t0 = time.monotonic()
        deadline = t0 + args.minutes * 60
        print(f"soak: {args.concurrency} workers for {args.minutes:g} min against {target.url}")
        print(f"{'min':>7} {'requests':>9} {'RSS MiB':>8} {'fds':>5} {'threads':>7} "
              f"{'running':>7} {'waiting':>7} {'cached':>6} {'parked':>6}")  # fmt: skip
        workers = [asyncio.create_task(load.run(deadline)) for _ in range(args.concurrency)]
        samples: list[Sample] = []
        while True:
            s = await _sample(admin, pid, t0, sum(tally.sent.values()))
            samples.append(s)
            print(_row(s), flush=True)
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(min(args.sample_seconds, max(0.0, deadline - time.monotonic())))
        await asyncio.gather(*workers)
        await load.close()
        after = await _idle(admin, 60)
        # The client's connections are closed; the server closes its ends when it reads EOF,
        # and any the client left open after its keep-alive (10 s under kern serve): wait past it.
        fds_back = None
        settle = time.monotonic() + FDS_SETTLE_SECONDS
        while True:
            fds_back = _proc(pid)[1] if pid is not None else None
            if fds_back is None or fds_back <= idle_fds or time.monotonic() > settle:
                break
            await asyncio.sleep(0.2)
        if pid is None:
            fds_back = int(parse_metrics((await admin.get("/metrics")).text)["process_open_fds"])
    return _report(args, tally, samples, before, after, idle_fds, fds_back or 0)


def _report(
    args: argparse.Namespace,
    tally: Tally,
    samples: list[Sample],
    before: dict[str, float],
    after: dict[str, float],
    idle_fds: int,
    fds_back: int,
) -> bool:
    classes = tally.by_class()
    sent = sum(tally.sent.values())
    print(f"\nrequests sent {sent} ({', '.join(f'{k} {v}' for k, v in tally.sent.items())})")
    print(
        f"served {tally.served} (2xx read whole); status {classes['2xx']} 2xx, "
        f"{classes['4xx']} 4xx, {classes['5xx']} 5xx, {classes['other']} other; "
        f"hang-ups {tally.hangups}; timeouts {tally.timeouts}; transport errors "
        f"{tally.transport}; streams cut short {tally.incomplete}; unreadable answers "
        f"{tally.malformed}; bad bodies accepted "
        f"{tally.accepted_bad}; well-formed requests refused {tally.refused}"
    )
    if tally.latencies:
        lat = sorted(tally.latencies)
        print(
            f"served latency: median {lat[len(lat) // 2]:.2f} s, "
            f"p99 {lat[min(len(lat) - 1, int(len(lat) * 0.99))]:.2f} s"
        )
    for e in tally.errors:
        print(f"  first errors: {e}")
    warm = args.warmup_minutes if args.warmup_minutes is not None else min(5, args.minutes / 3)
    steady = [s for s in samples if s.t >= warm * 60]
    growth = _trend(steady)
    allowed = max(8 * MIB, 0.02 * steady[0].rss) if steady else 0.0
    flat = len(steady) >= 2 and growth <= allowed
    if steady:
        print(
            f"RSS after {warm:.1f} min warm-up: {steady[0].rss / MIB:.1f} -> "
            f"{steady[-1].rss / MIB:.1f} MiB (min {min(s.rss for s in steady) / MIB:.1f}, max "
            f"{max(s.rss for s in steady) / MIB:.1f}); trend {growth / MIB:+.1f} MiB over "
            f"{(steady[-1].t - steady[0].t) / 60:.1f} min, allowed {allowed / MIB:.1f}: "
            f"{'flat' if flat else 'NOT FLAT'}"
        )
    else:
        print("RSS: no sample after the warm-up (run longer or lower --warmup-minutes)")
    fds_ok = fds_back <= idle_fds
    print(f"open fds idle: {idle_fds} before the load, {fds_back} after: "
          f"{'back' if fds_ok else 'NOT BACK'}")  # fmt: skip

    def d(name: str, reason: str | None = None) -> float:
        if reason is not None:
            name += '{finished_reason="' + reason + '"}'
        return after.get(name, 0.0) - before.get(name, 0.0)

    total = after["kern_pool_pages_total"]
    free, cached = after["kern_pool_pages_free"], after["kern_pool_pages_cached"]
    host_total = before["kern_host_pages_free"] + before["kern_host_pages_parked"]
    host_free, parked = after["kern_host_pages_free"], after["kern_host_pages_parked"]
    held = after["kern_pool_pages_held"] + after["kern_pool_slots_held"]
    busy = after["kern_num_requests_running"] + after["kern_num_requests_waiting"]
    books = held == 0 and busy == 0 and free + cached == total and host_free + parked == host_total
    print(
        f"books once idle: pages free {free:.0f} + cached {cached:.0f} = {free + cached:.0f} of "
        f"{total:.0f}; held {held:.0f}; host free {host_free:.0f} + parked {parked:.0f} of "
        f"{host_total:.0f}; running+waiting {busy:.0f}: {'balanced' if books else 'NOT BALANCED'}"
    )
    print(
        f"during the run: parked {d('kern_parked_total'):.0f}, woken {d('kern_woken_total'):.0f}, "
        f"dropped resident {d('kern_dropped_resident_total'):.0f} / parked "
        f"{d('kern_dropped_parked_total'):.0f}, preemptions {d('kern_num_preemptions_total'):.0f}, "
        f"aborts {d('kern_aborted_total'):.0f} (client hang-ups {tally.hangups}), finished "
        f"stop {d('kern_request_success_total', 'stop'):.0f} / length "
        f"{d('kern_request_success_total', 'length'):.0f}; drafts accepted "
        f"{d('kern_spec_decode_num_accepted_tokens_total'):.0f} of "
        f"{d('kern_spec_decode_num_draft_tokens_total'):.0f}"
    )
    faults = [tally.timeouts, tally.transport, tally.incomplete, tally.malformed]
    faults.append(tally.accepted_bad)
    clean = not (classes["5xx"] or any(faults))
    ok = clean and flat and fds_ok and books
    print(f"verdict: {'PASS' if ok else 'FAIL'}")
    return ok


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m kern.bench.soak", description=(__doc__ or "").split("\n")[0]
    )
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=64, help="workers (requests in flight)")
    p.add_argument("--url", help="a running server (default: start kern serve here)")
    p.add_argument("--pid", type=int, help="with --url: the server's process, for /proc")
    p.add_argument("--pool-bytes", default="1MiB", help="of the server started here")
    p.add_argument("--host-bytes", default="8MiB", help="of the server started here")
    p.add_argument("--rows", type=int, default=4, help="of the server started here")
    p.add_argument(
        "--malloc-arena-max",
        type=int,
        default=0,
        metavar="N",
        help="run the server started here under MALLOC_ARENA_MAX=N (default 0: unset)",
    )
    p.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable of the server started here (repeatable), e.g. "
        "MALLOC_TRIM_THRESHOLD_=0",
    )
    p.add_argument("--sample-seconds", type=float, default=30.0)
    p.add_argument("--warmup-minutes", type=float, help="default: a third of the run, at most 5")
    p.add_argument("--max-tokens", type=int, default=64, help="the most a request asks for")
    p.add_argument("--request-timeout", type=float, default=120.0, metavar="SECONDS")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.url and (args.malloc_arena_max or args.server_env):
        p.error("--malloc-arena-max and --server-env apply to the server started here")
    if any("=" not in e for e in args.server_env):
        p.error("--server-env takes NAME=VALUE")
    if args.pid is not None and not args.url:
        p.error("--pid goes with --url")
    if args.minutes <= 0 or args.concurrency < 1 or args.sample_seconds <= 0:
        p.error("--minutes, --concurrency and --sample-seconds must be above 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    with tempfile.TemporaryDirectory(prefix="kern-soak-") as tmp:
        target = Target(args, Path(tmp))
        try:
            ok = asyncio.run(soak(args, target))
        finally:
            code = target.stop()
            if code is not None:
                print(f"server exit code after SIGTERM: {code}")
                if code != 0 and target.log_path is not None:
                    print(target.log_path.read_text()[-4000:])
    return 0 if ok and code in (None, 0) else 1


if __name__ == "__main__":
    sys.exit(main())
