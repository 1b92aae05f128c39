"""The engine: the one place that turns a target into a loaded model, its arenas, its cache's
books and a scheduler. ``kern serve``, ``hypercorn kern.app:app``, ``kern bench`` and the tests
all build through it.

Design notes
------------
* Sizes are computed once: ``Layout.of`` says what a page and a slot hold for this model on
  this backend; the cache's pool cuts the budgets into chunks from those byte counts; the
  runner allocates exactly the arenas the pool's Geometry describes (one device arena of
  ``num_chunks * chunk_bytes``, within one chunk of ``pool_bytes``; one host arena likewise
  for ``host_bytes``). Nothing is sized twice, so nothing has to be checked against itself.
* Everything here runs on the thread that will run the scheduler (``start_scheduler``): the
  model is loaded where it will be used (see ``kern.engine.thread.start_scheduler``).
* ``ops`` is the backend; a caller may pass its own (the reference path, or a failing one in
  the crash test) instead of threading flags through the layers.
* The drafter (``kern.engine.drafters``, chosen once by ``factory.drafting`` from the
  target's ``draft`` key) is checked first and sized into the pool before anything loads,
  and loaded here beside the target: a draft checkpoint (the same tokenizer, KV that fits
  the target's page) or the target's MTP layer (its checkpoint read with it), each run by a
  runner over the target runner's arena (``Runner.over_arena``): no budget of its own, its
  pages (and, for a stateful draft, its slots: the pool's slots are sized for the larger
  state) are the pool's, taken per request by the scheduler.
* The cache's books are built before the weights are read when the budgets are known (a
  budget too small for one page is then an error at once, naming its key or flag); the CUDA
  default budget depends on the memory free after loading, so that one waits for the weights.
* One recipe for one rank and for N: a target with ``ranks`` above 1 is laid out as rank 0's
  shard (the pool's pages hold its heads), its books are built in the same order, the ranks
  start (``kern.engine.ranks.launch.Ranks``) just before the weights are read, each rank
  reading its own shard, and the runner is rank 0's ``RankedRunner`` over the pool's
  placement, which every rank's arena takes too; the budgets are per rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kern.backend import Ops, make_ops
from kern.checkpoint.config import load_config
from kern.checkpoint.load import Checkpoint, load_checkpoint
from kern.engine.arena import Placement
from kern.engine.budgets import check_budgets
from kern.engine.drafters import Drafter, Drafting
from kern.engine.drafters.factory import drafting
from kern.engine.layout import Layout
from kern.engine.ranks.launch import Ranks, rank_device
from kern.engine.ranks.runner import RankedRunner
from kern.engine.ranks.shard import Shard
from kern.engine.request import Event, Request
from kern.engine.runner import Runner
from kern.engine.sampler import Sampler
from kern.engine.scheduler import Scheduler
from kern.errors import UsageError
from kern.kern_toml import Target
from kern.metrics import Metrics
from kern.pool import BudgetTooSmall, Cache

__all__ = ["CUDA_FREE_SHARE", "DEFAULT_POOL_BYTES", "Engine"]

# The CPU's device budget when a target names none: enough for the tiny models kern ships
# and benchmarks (the runner zero-fills it at start, so it is not free to oversize).
DEFAULT_POOL_BYTES = 256 * 2**20
# On CUDA with no pool_bytes: this share of the memory free once the weights are loaded
# (the rest is left to activations and the allocator's slack).
CUDA_FREE_SHARE = 0.85


@dataclass(frozen=True, eq=False)
class Engine:
    """A target, loaded: its checkpoint, layout, cache books and runner."""

    target: Target
    checkpoint: Checkpoint
    layout: Layout
    cache: Cache
    # A ranked target's runner broadcasts each call to its other ranks (kern.engine.ranks).
    runner: Runner | RankedRunner
    # What drafts at rows above 1 (kern.engine.drafters), loaded over the same pool pages.
    drafting: Drafting

    @classmethod
    def load(cls, target: Target, *, ops: Ops | None = None) -> Engine:
        """Pin the thread count, load ``target``'s checkpoint, size the arenas from its
        budgets and build the runner over them (on ``ops``, default: the target's device).
        A target with ``ranks`` above 1 is loaded by every rank, each its shard
        (``kern.engine.ranks``): the runner is then rank 0's :class:`RankedRunner`, and the
        budgets are per rank (every rank's arena is that size)."""
        # Before anything is read or allocated: a budget the machine cannot give is one line.
        check_budgets(target)
        drafts = drafting(target)
        # As kern.engine.targets.check_target checks before load: the tests and the benchmarks
        # build engines without it.
        drafts.check(target)
        if target.ranks > 1:
            if ops is not None:
                raise ValueError("a ranked target builds its backend on every rank; pass no ops")
            # Rank 0's view: the layout, so the pool's pages, hold its shard of the heads.
            shard = Shard(0, target.ranks, target.parallel)
            full = load_config(target.checkpoint)
            shard.check(full)
            config = shard.config(full)
            ops = make_ops(rank_device(target.device, 0))
        else:
            torch.set_num_threads(target.threads)
            ops = ops or make_ops(target.device)
            config = load_config(target.checkpoint)
        layout = Layout.of(config, ops.dtype, target.page_tokens)
        # A stateful draft's slots come from the same pool: slots fit either model's state.
        state_bytes = max(layout.state_bytes, drafts.prepare(config, layout, ops, target))
        cache = None
        if target.pool_bytes is not None:
            cache = _cache(target, layout, target.pool_bytes, state_bytes)
        ranks = Ranks.start(target) if target.ranks > 1 else None
        if ranks is None:
            ckpt = load_checkpoint(
                target.checkpoint, device=ops.device, dtype=ops.dtype, mtp=drafts.reads_mtp
            )
        else:
            ckpt = ranks.load()
        if cache is None:
            cache = _cache(target, layout, default_pool_bytes(ops.device), state_bytes)
        placement = Placement.of_pool(cache.device)
        host = None if cache.host is None else Placement.of_pool(cache.host)
        runner: Runner | RankedRunner
        if ranks is None:
            runner = Runner(ckpt, ops, layout, placement, host)
        else:
            runner = ranks.runner(ckpt, layout, placement, host)
        drafts.load(runner, ckpt)
        return cls(target, ckpt, layout, cache, runner, drafts)

    def scheduler(
        self,
        deliver: Callable[[list[tuple[Request, Event]]], None],
        *,
        metrics: Metrics | None = None,
        on_crash: Callable[[BaseException], None] | None = None,
        rows: int | None = None,
        max_model_len: int | None = None,
        **limits: int,
    ) -> Scheduler:
        """A scheduler over this engine's runner and cache (``limits``: ``max_step_tokens``,
        ``max_running``); ``rows`` (default: the target's ``decode_rows``) above 1 verifies
        drafts from the engine's drafter (a draft checkpoint when the target names one, its
        MTP layer with ``draft = "mtp"``, else n-gram drafts).
        ``max_model_len`` (default: the model's ``max_position_embeddings``) bounds a
        request's prompt and answer together."""
        rows = self.target.decode_rows if rows is None else rows
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        drafter: Drafter | None = None
        if isinstance(self.runner, Runner):
            self.runner.keep_hidden = False  # on again for a drafter that reads it only
        if rows > 1:
            drafter = self.drafting.drafter(rows, self.runner)
        return Scheduler(
            Sampler(self.runner),
            self.cache,
            eos_token_ids=self.checkpoint.tokenizer.eos_token_ids,
            max_model_len=max_model_len or self.checkpoint.config.max_position_embeddings,
            deliver=deliver,
            metrics=metrics,
            on_crash=on_crash,
            drafter=drafter,
            snapshot_pages=self.target.snapshot_pages or 1,
            **limits,
        )

    @property
    def arena_bytes(self) -> tuple[int, int]:
        """Bytes of the device arena and of the host arena (0 without a host tier)."""
        host = self.runner.host
        return self.runner.arena.nbytes, 0 if host is None else host.nbytes


# Slots the pool keeps for a model with window pages: a lone request's two and the snapshot
# its hit holds locked while it runs.
WINDOW_SLOTS = 3


def _cache(
    target: Target, layout: Layout, device_bytes: int, state_bytes: int | None = None
) -> Cache:
    """The cache's books for ``target`` (slots of ``state_bytes``, default the layout's: a
    stateful draft's state when larger); a budget too small for one page (or the two state
    slots of a stateful model) is a :class:`UsageError` naming its key or flag."""
    kwargs: dict[str, Any] = dict(
        page_tokens=target.page_tokens,
        page_bytes=layout.page_bytes,
        device_bytes=device_bytes,
        state_bytes=layout.state_bytes if state_bytes is None else state_bytes,
        host_bytes=target.host_bytes,
    )
    slots = "two state slots"
    if layout.windowed:
        # A lone request's two window pages and the snapshot its hit holds locked: it always
        # runs (kern.engine.window_pages).
        kwargs["min_slots"] = WINDOW_SLOTS
        slots = f"{WINDOW_SLOTS} window pages"
    try:
        cache = Cache(**kwargs)
    except BudgetTooSmall as e:
        key, value = "pool_bytes", device_bytes
        if target.host_bytes:
            try:
                Cache(**{**kwargs, "host_bytes": 0})
                key, value = "host_bytes", target.host_bytes
            except BudgetTooSmall:
                pass
        why = ""
        if layout.windowed and key == "pool_bytes":
            why = (
                f" (besides its pages, a sequence holds two window pages and its hit's "
                f"snapshot, {layout.state_bytes:,} bytes each: the pool keeps "
                f"{WINDOW_SLOTS} as its first slots)"
            )
        raise UsageError(f"{target.where(key)}: {key} = {value}: {e}{why}") from None
    if cache.pages_free < 1:
        # The slots' first chunks took the whole budget: no page for any request.
        raise UsageError(
            f"{target.where('pool_bytes')}: pool_bytes = {device_bytes}: no page is left beside "
            f"the {slots} the pool keeps ({layout.state_bytes:,} bytes each, in chunks of "
            f"{cache.device.chunk_bytes:,} bytes)"
        )
    return cache


def default_pool_bytes(device: torch.device) -> int:
    """The device budget when a target names none (see the constants above)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * CUDA_FREE_SHARE)
    return DEFAULT_POOL_BYTES
