"""Ranks: the processes kern starts for a target with ``ranks = N``, the one broadcast per
runner call that keeps them in step, and the watchdog that ends them all when one fails.

Design notes
------------
* Rank 0 is the process the user started (``kern serve``, ``hypercorn kern.app:app``,
  ``kern run``): it runs the app, the scheduler and the cache's books, and starts ranks
  1 .. N-1 itself (``python -m kern.engine.ranks``; on other machines a user starts them, see
  docs/serve.md). They join through ``torch.distributed``: a TCPStore that rank 0 serves
  (where it puts its target first, so a rank needs nothing else to know what to load), a
  process group for the model's collectives (NCCL on CUDA, gloo on the CPU) and a gloo
  group for the control messages.
* One scheduler, many ranks: rank 0's runner is a :class:`RankedRunner`. Each call the
  scheduler makes (``forward``, ``park``, ``wake``, ``copy_pages``, ``copy_slots``,
  ``keep_rows``) is broadcast once (``broadcast_object_list`` on the control group: the
  batch of ``SeqChunk`` values and the plans as bytes), then every rank runs the same method
  on its own runner, over its shard of the weights and of the arena. Every rank's arena has
  the same geometry (rank 0's pool books, sent once at start), so page and slot ids mean the
  same everywhere and one plan lands on every rank. The broadcast's time is counted
  (``broadcast_seconds``) and reported by the benchmark.
* Loading: every rank reads only its slices (``kern.engine.shard.load_shard``); the progress bar
  is rank 0's. The engine is ready when every rank has built its runner (a barrier).
* Faults (the bound is :data:`HANG_S` + :data:`BEAT_S`, about 11 s; a death is seen within
  :data:`BEAT_S`): every rank but 0 adds to its counter in the store every :data:`BEAT_S`
  from a thread of its own, whatever its main thread is doing (loading, in a collective,
  idle; a rank gets :data:`START_S` for its first one, while it imports torch). Rank 0's
  watchdog thread reads the counters and polls the processes it started; a
  rank that exited, or whose counter has not moved for :data:`HANG_S` (a stopped or hung
  process: SIGSTOP stops all its threads), ends the whole server: one line naming the rank
  on stderr, every other rank killed, exit code :data:`EXIT_CODE` (the app's crash code),
  which closes the listening socket. A collective that fails on rank 0 (gloo reports a
  peer's closed connection) waits for the watchdog to name the rank before it re-raises.
  The process groups' own timeouts are long on purpose: a rank waits in the control
  broadcast for as long as the server is idle, and liveness is the watchdog's business.
  Ranks other than 0 end when rank 0 does: the kernel kills them (``PR_SET_PDEATHSIG``)
  when it was their parent, and their heartbeat fails when the store (in rank 0) is gone.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kern.backend import make_ops
from kern.checkpoint import Checkpoint
from kern.engine.arena import Geometry
from kern.engine.layout import Layout
from kern.engine.runner import Runner
from kern.engine.shard import Comm, Shard, check_shard, load_shard, shard_model
from kern.errors import UsageError
from kern.kern_toml import Target

__all__ = ["BEAT_S", "EXIT_CODE", "HANG_S", "RankedRunner", "Ranks", "rendezvous"]

BEAT_S = 0.5  # a rank's heartbeat period, and the watchdog's polling period
HANG_S = 10.0  # a rank whose heartbeat has not moved for this long is hung
START_S = 300.0  # the first heartbeat (after importing torch) must come within this
EXIT_CODE = 101  # as kern.app.CRASH_EXIT_CODE: the server ends because part of it failed
# Collectives wait at most this long by their own clock: the watchdog is the real bound.
_PG_TIMEOUT = timedelta(days=365)
_STORE_TIMEOUT = timedelta(seconds=60)
_LOCAL = "127.0.0.1"


@dataclass(frozen=True, slots=True)
class _Plan:
    """A CopyPlan's four id lists (little-endian uint32 bytes), as a picklable value."""

    src_pages: bytes
    dst_pages: bytes
    src_states: bytes
    dst_states: bytes

    @classmethod
    def of(cls, p: Any) -> _Plan:
        return cls(bytes(p.src_pages), bytes(p.dst_pages), bytes(p.src_states), bytes(p.dst_states))


def rendezvous(num_ranks: int) -> tuple[str, int, int]:
    """Where rank 0 serves the store, and how many ranks start on its machine, from the
    environment (torch.distributed's names where it has them):

    - ``MASTER_ADDR`` / ``MASTER_PORT``: the address and port of rank 0's store (default
      127.0.0.1 and a free port: every rank on this machine);
    - ``KERN_LOCAL_RANKS``: ranks 0 .. n-1 run on this machine, started by kern (default all
      of them); ranks n .. N-1 are started on the other machines, each with
      ``python -m kern.engine.ranks`` (``--store``, ``--rank``, ``--ranks``, ``--local-rank``, or
      ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``).
    """
    host = os.environ.get("MASTER_ADDR") or _LOCAL
    port = int(os.environ.get("MASTER_PORT") or 0)
    num_local = int(os.environ.get("KERN_LOCAL_RANKS") or num_ranks)
    if not 1 <= num_local <= num_ranks:
        raise UsageError(f"KERN_LOCAL_RANKS={num_local}: must be in 1 .. ranks ({num_ranks})")
    return host, port, num_local


def _device(device: str, local_rank: int) -> torch.device:
    if device.startswith("cuda"):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class Ranks:
    """Rank 0's side: the processes, the store, the process groups and the watchdog.

    Build with :meth:`start`; then :meth:`load` (every rank reads its shard) and
    :meth:`runner` (every rank builds its runner over one geometry)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.num_ranks = target.ranks
        self.shard = Shard(0, target.ranks, target.parallel)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.closing = False
        self._failed = threading.Event()

    @classmethod
    def start(cls, target: Target) -> Ranks:
        """Serve the store, start this machine's other ranks, join them all and start the
        watchdog. Several machines: see :func:`rendezvous`."""
        self = cls(target)
        host, port, num_local = rendezvous(target.ranks)
        # A checkpoint that does not split or does not match its config is one error here,
        # from the headers alone, not N ranks failing at once.
        check_shard(target.checkpoint, self.shard)
        if host == _LOCAL:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        self.store = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=_STORE_TIMEOUT
        )
        port = self.store.port
        self.store.set("kern/target", pickle.dumps(target))
        for rank in range(1, num_local):
            cmd = [sys.executable, "-m", "kern.engine.ranks", "--store", f"{host}:{port}"]
            cmd += ["--rank", str(rank), "--ranks", str(self.num_ranks), "--local-rank", str(rank)]
            cmd += ["--parent", str(os.getpid())]
            self.procs[rank] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        self.watchdog = threading.Thread(
            target=self._watch, args=(host, port), name="kern-watchdog", daemon=True
        )
        self.watchdog.start()
        self._join()
        return self

    def _join(self) -> None:
        t = self.target
        torch.set_num_threads(t.threads)
        self.device = _device(t.device, 0)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("pg", self.store),
            rank=0,
            world_size=self.num_ranks,
            timeout=_PG_TIMEOUT,
        )
        self.control = dist.new_group(backend="gloo", timeout=_PG_TIMEOUT)
        self.comm = Comm(None, self.num_ranks)

    def _send(self, msg: Any) -> None:
        with self.guard():
            dist.broadcast_object_list([msg], src=0, group=self.control)

    def load(self, *, progress: bool | None = None) -> Checkpoint:
        """Read rank 0's shard (every rank reads its own meanwhile)."""
        t = self.target
        if progress is None:
            progress = sys.stderr.isatty()
        return load_shard(
            t.checkpoint, self.shard, device=self.device, dtype=t.dtype, progress=progress
        )

    def runner(
        self, checkpoint: Checkpoint, layout: Layout, geometry: Geometry, host: Geometry | None
    ) -> RankedRunner:
        """Every rank builds its runner over ``geometry`` (and ``host``); returns rank 0's,
        once all are built."""
        self._send({"geometry": geometry, "host": host})
        runner = Runner(checkpoint, make_ops(self.device), layout, geometry, host)
        runner.model = shard_model(runner.model, self.shard, self.comm)
        with self.guard():
            dist.barrier(group=self.control)
        return RankedRunner(runner, self)

    def runner_with_pages(self, checkpoint: Checkpoint, num_pages: int) -> RankedRunner:
        """A ranked runner over ``num_pages`` pages and one slot of its own (``kern run``)."""
        layout = Layout.of(checkpoint.config, make_ops(self.device).dtype, self.target.page_tokens)
        return self.runner(checkpoint, layout, Geometry.separate(layout, num_pages, 1), None)

    def close(self) -> None:
        """Tell every rank to stop and wait for them (kern run, at its end)."""
        self.closing = True  # before the message: a rank that stops is no fault now
        self._send(("stop", ()))
        for proc in self.procs.values():
            try:
                proc.wait(timeout=HANG_S)
            except subprocess.TimeoutExpired:
                proc.kill()
        # The watchdog's store calls must be over before the interpreter ends: one caught
        # mid-call by the exit aborted kern run ("terminate called without an active
        # exception", exit -6) in a CI run of the two-node test.
        self.watchdog.join(timeout=4 * BEAT_S)
        dist.destroy_process_group()
        self.store = None

    # --- faults ---------------------------------------------------------------------------

    def guard(self) -> _Guard:
        """A context for a collective: when it raises, give the watchdog time to name the
        rank that failed (it then ends the process) before the error goes on."""
        return _Guard(self)

    def _watch(self, host: str, port: int) -> None:
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=_STORE_TIMEOUT)
            started = time.monotonic()
            seen = {r: (0, started) for r in range(1, self.num_ranks)}
            while not self.closing:
                for rank, proc in self.procs.items():
                    code = proc.poll()
                    if code is not None and not self.closing:
                        how = f"exited with code {code}"
                        if code < 0:
                            how = f"was killed by signal {-code}"
                        self.fail(rank, how)
                now = time.monotonic()
                for rank, (last, since) in seen.items():
                    count = int(store.add(f"kern/beat/{rank}", 0))
                    if count != last:
                        seen[rank] = (count, now)
                    elif now - since > (HANG_S if count else START_S) and not self.closing:
                        what = "stopped responding" if count else "did not start"
                        self.fail(rank, f"{what}: no heartbeat for {now - since:.1f} s")
                time.sleep(BEAT_S)
        except BaseException as e:  # noqa: BLE001 - a watchdog that dies must end the server
            if not self.closing:
                self.fail(0, f"lost its watchdog ({type(e).__name__}: {e})")

    def fail(self, rank: int, why: str) -> None:
        """End every rank and this process: one line naming ``rank``, exit :data:`EXIT_CODE`."""
        if self._failed.is_set():
            return
        self._failed.set()
        proc = self.procs.get(rank)
        pid = f" (pid {proc.pid})" if proc is not None else ""
        print(
            f"kern: rank {rank} of {self.num_ranks}{pid} {why}; ending all ranks "
            f"(exit code {EXIT_CODE})",
            file=sys.stderr,
            flush=True,
        )
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        os._exit(EXIT_CODE)


class _Guard:
    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if exc is not None and isinstance(exc, Exception) and not self.ranks.closing:
            # A peer's death reaches a collective as a gloo error at once; the watchdog
            # names the rank within BEAT_S and ends the process.
            deadline = time.monotonic() + 4 * BEAT_S
            while time.monotonic() < deadline:
                time.sleep(BEAT_S / 5)


# Runner methods that change nothing a rank holds: rank 0 runs them alone.
_READ_ONLY = frozenset({"kv_at"})


class RankedRunner:
    """Rank 0's runner: each call that changes what a rank holds is broadcast once, then run
    here; everything else is the local runner's (see the notes)."""

    def __init__(self, runner: Runner, ranks: Ranks) -> None:
        self._runner = runner
        self.ranks = ranks
        self.broadcast_seconds = 0.0
        self.broadcasts = 0

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._runner, name)
        if callable(value) and name not in _READ_ONLY:
            # A runner method this wrapper does not broadcast would change rank 0 alone and
            # leave the ranks apart: refuse it loudly instead.
            raise AttributeError(
                f"Runner.{name} is not broadcast to the other ranks "
                "(kern.engine.ranks.RankedRunner)"
            )
        return value

    def _call(self, name: str, *args: Any) -> Any:
        t0 = time.perf_counter()
        self.ranks._send((name, args))
        self.broadcast_seconds += time.perf_counter() - t0
        self.broadcasts += 1
        with self.ranks.guard():
            return getattr(self._runner, name)(*args)

    def forward(self, batch: Sequence[Any]) -> torch.Tensor:
        return self._call("forward", list(batch))

    def keep_rows(self, slot: int, num_rows: int) -> None:
        self._call("keep_rows", slot, num_rows)

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self._call("copy_pages", list(src), list(dst))

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self._call("copy_slots", list(src), list(dst))

    def park(self, plans: Sequence[Any]) -> None:
        self._call("park", [_Plan.of(p) for p in plans])

    def wake(self, plan: Any) -> None:
        self._call("wake", _Plan.of(plan))

    @property
    def comm_seconds(self) -> float:
        return self.ranks.comm.seconds


def load_engine(target: Target, *, ops: Any = None) -> Any:
    """``Engine.load`` for a target with ``ranks`` above 1: rank 0's engine, whose runner is a
    :class:`RankedRunner` (the pool budgets are per rank: every rank's arena is that size)."""
    from kern.engine.load import Engine, _cache, default_pool_bytes
    from kern.model_config import load_config

    if ops is not None:
        raise ValueError("a ranked target builds its backend on every rank; pass no ops")
    shard = Shard(0, target.ranks, target.parallel)
    full = load_config(target.checkpoint)
    shard.check(full)
    device = _device(target.device, 0)
    layout = Layout.of(shard.config(full), make_ops(device).dtype, target.page_tokens)
    cache = None if target.pool_bytes is None else _cache(target, layout, target.pool_bytes)
    ranks = Ranks.start(target)
    ckpt = ranks.load()
    if cache is None:
        cache = _cache(target, layout, default_pool_bytes(device))
    host = None if cache.host is None else Geometry.of_pool(cache.host)
    runner = ranks.runner(ckpt, layout, Geometry.of_pool(cache.device), host)
    return Engine(target, ckpt, layout, cache, runner)  # type: ignore[arg-type]


def load_for_run(target: Target) -> tuple[Ranks, Checkpoint]:
    """For ``kern run``: start the ranks and read rank 0's shard; the runner comes once the
    prompt's length is known (:meth:`Ranks.runner_with_pages`)."""
    ranks = Ranks.start(target)
    return ranks, ranks.load()


# --- ranks 1 .. N-1 ---------------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    """Ask the kernel to kill this process when its parent ends (Linux), then check that
    the parent is still the one that started us (it may have gone before the call)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


def _heartbeat(host: str, port: int, rank: int) -> None:
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=HANG_S))
        while True:
            store.add(f"kern/beat/{rank}", 1)
            time.sleep(BEAT_S)
    except BaseException as e:  # noqa: BLE001 - rank 0 is gone: so is this rank
        print(
            f"kern rank {rank}: lost rank 0 ({type(e).__name__}: {e}); exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)


def worker(host: str, port: int, rank: int, num_ranks: int, local_rank: int) -> None:
    """Rank ``rank``'s life: join, load its shard, build its runner, then run every call
    rank 0 broadcasts until told to stop."""
    threading.Thread(
        target=_heartbeat, args=(host, port, rank), name="kern-heartbeat", daemon=True
    ).start()
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=START_S))

    def receive() -> Any:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        return box[0]

    # Rank 0 puts its target in the store before it starts anyone: the device, the backend
    # and the shard follow from it.
    target: Target = pickle.loads(store.get("kern/target"))
    device = _device(target.device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=dist.PrefixStore("pg", store),
        rank=rank,
        world_size=num_ranks,
        timeout=_PG_TIMEOUT,
    )
    control = dist.new_group(backend="gloo", timeout=_PG_TIMEOUT)
    torch.set_num_threads(target.threads)
    shard = Shard(rank, num_ranks, target.parallel)
    ckpt = load_shard(target.checkpoint, shard, device=device, dtype=target.dtype)
    layout = Layout.of(ckpt.config, make_ops(device).dtype, target.page_tokens)
    sizes = receive()
    runner = Runner(ckpt, make_ops(device), layout, sizes["geometry"], sizes["host"])
    runner.model = shard_model(runner.model, shard, Comm(None, num_ranks))
    dist.barrier(group=control)
    while True:
        name, args = receive()
        if name == "stop":
            break
        getattr(runner, name)(*args)
    dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog="python -m kern.engine.ranks",
        description="One rank of a target with ranks > 1, joining rank 0's store (kern starts "
        "the ranks of rank 0's machine itself; start the others' with this).",
    )
    store = f"{env('MASTER_ADDR')}:{env('MASTER_PORT')}" if env("MASTER_ADDR") else None
    p.add_argument(
        "--store",
        default=store,
        required=store is None,
        metavar="HOST:PORT",
        help="rank 0's store (default MASTER_ADDR:MASTER_PORT)",
    )
    for flag, var in (("--rank", "RANK"), ("--ranks", "WORLD_SIZE")):
        given = env(var)
        p.add_argument(
            flag,
            type=int,
            default=None if given is None else int(given),
            required=given is None,
            help=f"default ${var}",
        )
    p.add_argument(
        "--local-rank",
        type=int,
        default=int(env("LOCAL_RANK") or 0),
        help="this rank's CUDA device on its machine (default $LOCAL_RANK, else 0)",
    )
    p.add_argument("--parent", type=int, help="rank 0's pid, when it started this process")
    args = p.parse_args(argv)
    if args.parent is not None:
        _die_with_parent(args.parent)
    host, _, port = args.store.rpartition(":")
    try:
        worker(host, int(port), args.rank, args.ranks, args.local_rank)
    except BaseException:  # noqa: BLE001 - any failure ends this rank, loudly
        print(f"kern rank {args.rank}: failed:", file=sys.stderr, flush=True)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    # Not a normal interpreter exit: the heartbeat thread still holds a C++ TCPStore, and
    # tearing the interpreter down under it aborted the rank ("terminate called without an
    # active exception", exit -6) once in the first four runs of the two-node test here.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
