"""Rank 0's side of a target with ``ranks = N``: where the ranks meet (:func:`rendezvous`),
the processes, the store and the process groups (:class:`Ranks`), and the watchdog that ends
them all when one fails (see the package's design notes)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import threading
import time
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from kern.backend import make_ops
from kern.checkpoint.load import Checkpoint
from kern.engine.arena import Placement
from kern.engine.layout import Layout
from kern.engine.ranks.runner import RankedRunner
from kern.engine.ranks.shard import Comm, Shard, check_shard, load_shard, shard_model
from kern.engine.runner import Runner
from kern.errors import UsageError
from kern.kern_toml import Target

__all__ = [
    "BEAT_S",
    "EXIT_CODE",
    "HANG_S",
    "PG_TIMEOUT",
    "START_S",
    "Ranks",
    "load_for_run",
    "rank_device",
    "rendezvous",
]

BEAT_S = 0.5  # a rank's heartbeat period, and the watchdog's polling period
HANG_S = 10.0  # a rank whose heartbeat has not moved for this long is hung
START_S = 300.0  # the first heartbeat (after importing torch) must come within this
EXIT_CODE = 101  # as kern.app.CRASH_EXIT_CODE: the server ends because part of it failed
# Collectives wait at most this long by their own clock: the watchdog is the real bound.
PG_TIMEOUT = timedelta(days=365)
_STORE_TIMEOUT = timedelta(seconds=60)
_LOCAL = "127.0.0.1"


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


def rank_device(device: str, local_rank: int) -> torch.device:
    """The device of the rank ``local_rank`` of its machine: ``cuda:local_rank``, or the CPU."""
    if device.startswith("cuda"):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class Ranks:
    """Rank 0's side: the processes, the store, the process groups and the watchdog.

    Build with :meth:`start`; then :meth:`load` (every rank reads its shard) and
    :meth:`runner` (every rank builds its runner over one placement)."""

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
        self.device = rank_device(t.device, 0)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            store=dist.PrefixStore("pg", self.store),
            rank=0,
            world_size=self.num_ranks,
            timeout=PG_TIMEOUT,
        )
        self.control = dist.new_group(backend="gloo", timeout=PG_TIMEOUT)
        self.comm = Comm(None, self.num_ranks)

    def send(self, msg: Any) -> None:
        """Broadcast ``msg`` to every rank on the control group."""
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
        self, checkpoint: Checkpoint, layout: Layout, placement: Placement, host: Placement | None
    ) -> RankedRunner:
        """Every rank builds its runner over ``placement`` (and ``host``); returns rank 0's,
        once all are built."""
        self.send({"placement": placement, "host": host})
        runner = Runner(checkpoint, make_ops(self.device), layout, placement, host)
        runner.model = shard_model(runner.model, self.shard, self.comm)
        with self.guard():
            dist.barrier(group=self.control)
        return RankedRunner(runner, self.send, self.guard)

    def runner_with_pages(self, checkpoint: Checkpoint, num_pages: int) -> RankedRunner:
        """A ranked runner over ``num_pages`` pages and one slot of its own (``kern run``)."""
        layout = Layout.of(checkpoint.config, make_ops(self.device).dtype, self.target.page_tokens)
        return self.runner(checkpoint, layout, Placement.separate(layout, num_pages, 1), None)

    def close(self) -> None:
        """Tell every rank to stop and wait for them (kern run, at its end)."""
        self.closing = True  # before the message: a rank that stops is no fault now
        self.send(("stop", ()))
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

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None and isinstance(exc, Exception) and not self.ranks.closing:
            # A peer's death reaches a collective as a gloo error at once; the watchdog
            # names the rank within BEAT_S and ends the process.
            deadline = time.monotonic() + 4 * BEAT_S
            while time.monotonic() < deadline:
                time.sleep(BEAT_S / 5)


def load_for_run(target: Target) -> tuple[Ranks, Checkpoint]:
    """For ``kern run``: start the ranks and read rank 0's shard; the runner comes once the
    prompt's length is known (:meth:`Ranks.runner_with_pages`)."""
    ranks = Ranks.start(target)
    return ranks, ranks.load()
