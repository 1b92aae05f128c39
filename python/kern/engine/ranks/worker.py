"""Ranks 1 .. N-1: a rank's life (join rank 0's store, load its shard, build its runner, run
every call rank 0 broadcasts), its heartbeat, and its end with rank 0 (see the package's
design notes). ``python -m kern.engine.ranks`` runs :func:`main`."""

from __future__ import annotations

import argparse
import ctypes
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kern.backend import make_ops
from kern.engine.layout import Layout
from kern.engine.ranks.launch import BEAT_S, HANG_S, PG_TIMEOUT, START_S, rank_device
from kern.engine.ranks.shard import Comm, Shard, load_shard, shard_model
from kern.engine.runner import Runner
from kern.kern_toml import Target

__all__ = ["main", "worker"]


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
    device = rank_device(target.device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=dist.PrefixStore("pg", store),
        rank=rank,
        world_size=num_ranks,
        timeout=PG_TIMEOUT,
    )
    control = dist.new_group(backend="gloo", timeout=PG_TIMEOUT)
    torch.set_num_threads(target.threads)
    shard = Shard(rank, num_ranks, target.parallel)
    ckpt = load_shard(target.checkpoint, shard, device=device, dtype=target.dtype)
    layout = Layout.of(ckpt.config, make_ops(device).dtype, target.page_tokens)
    sizes = receive()
    runner = Runner(ckpt, make_ops(device), layout, sizes["placement"], sizes["host"])
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
