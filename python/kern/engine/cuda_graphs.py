"""CUDA graphs for the decode step: a batch of one-token chunks replayed, not launched op by op.

Design notes
------------
* Why: a decode step of a small model is a few hundred microseconds of GPU work behind tens
  of milliseconds of Python issuing some 20 kernels per layer (docs/performance.md). A graph
  captured once per batch size replays the whole forward with one launch.
* Batch sizes: ``capture_sizes`` (1, 2, 4, ... up to the scheduler's batch, at most 256). A
  decode batch of n sequences runs in the smallest captured size >= n (:func:`bucket`); the
  rows past n are padding: token 0 at position 0 of a scratch page of their own, which no
  sequence owns (taken from the pool at start-up), so they write nowhere a real row reads,
  and their logits are dropped. A real row's bits do not change: every kernel of the CUDA
  path is batch invariant (the identity promise), so a row computes the same at any size.
* A graph reads fixed addresses: the step's indices live in static buffers
  (:class:`StaticInputs`), filled from the host before each replay (three copies); the
  attention plan over them is made before the capture (its tiles depend only on the size).
  The block tables are ``cdiv(max_model_len, page_tokens)`` wide; the kernel reads a row's
  pages up to its length only, so columns past it are never read.
* Which steps: every chunk one token with ``logits="last"``, n at most the largest size,
  and no hidden rows kept (MTP); anything else (prefill, verify chunks, larger batches) runs
  eagerly. Which models: those whose forward reads nothing back to the host (their registry
  row's ``cuda_graphs``; an MoE routes on the host, a stateful model clears and plans its
  slots there) and whose RoPE the kernel computes (YaRN's tables are built per step).
* Modes: ``"graph"`` captures and replays (CUDA); ``"static"`` runs the captured function
  eagerly over the same static buffers (the torch reference backend on the CPU: the wiring
  checked without a GPU); ``"padded"`` runs the padded batch through the runner's eager
  forward (the CPU backend, whose plans are built from host values: the padding checked).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from torch import Tensor

from kern.arith import cdiv
from kern.batch import Step
from kern.chunk import SeqChunk
from kern.models import registry
from kern.models.layers.caches import Caches
from kern.models.pages import KvViews

if TYPE_CHECKING:
    from kern.engine.runner import Runner

log = logging.getLogger("kern")

__all__ = [
    "MAX_SIZE",
    "DecodeGraphs",
    "StaticInputs",
    "bucket",
    "capture_sizes",
    "graphs_at_load",
    "is_decode",
    "pad",
    "why_not",
]

MAX_SIZE = 256  # the largest captured batch (the scheduler's default max_running)
Mode = Literal["graph", "static", "padded"]
_ROWS = ("token_ids", "positions", "page_ids", "page_offsets", "slot_mapping")


def capture_sizes(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... below ``min(max_batch, MAX_SIZE)``, then that bound itself."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    top = min(max_batch, MAX_SIZE)
    sizes = []
    s = 1
    while s < top:
        sizes.append(s)
        s *= 2
    return (*sizes, top)


def bucket(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest of ``sizes`` (ascending) that holds ``n`` rows; None when none does."""
    return next((s for s in sizes if s >= n), None)


def is_decode(batch: Sequence[SeqChunk]) -> bool:
    """Every chunk one token whose logits are returned: what a captured step runs."""
    return all(len(c.token_ids) == 1 and c.logits == "last" for c in batch)


def pad(batch: Sequence[SeqChunk], size: int, scratch_page: int) -> list[SeqChunk]:
    """``batch`` and ``size - len(batch)`` padding rows: token 0 at position 0 of
    ``scratch_page`` (they write there alone and read back only what they wrote)."""
    if size < len(batch):
        raise ValueError(f"cannot pad {len(batch)} rows to {size}")
    return [*batch, *[SeqChunk([0], 0, [scratch_page])] * (size - len(batch))]


def why_not(runner: Runner) -> str | None:
    """Why ``runner``'s decode steps cannot be captured, or None when they can."""
    family = runner.config.model_type
    if not registry.of(runner.config).cuda_graphs:
        return f"{family} reads device values back on the host in its forward"
    if runner.model.rope[0] is not None:
        return "YaRN's RoPE tables are built on the host every step"
    if runner.window_tokens:
        return "its window pages' tables are built on the host every step"
    return None


class StaticInputs:
    """The device buffers a captured step reads, for up to ``max_size`` rows, and the host
    copies they are filled from. ``width``: the most pages a sequence's table may hold."""

    def __init__(
        self,
        max_size: int,
        width: int,
        page_tokens: int,
        scratch_page: int,
        device: torch.device,
    ) -> None:
        self.max_size, self.width = max_size, width
        self.page_tokens, self.scratch_page = page_tokens, scratch_page
        self.device = device
        pin = device.type == "cuda"  # a pinned source makes each copy one DMA
        self.rows = torch.zeros(len(_ROWS), max_size, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(max_size, dtype=torch.int32, device=device)
        self.tables = torch.full((max_size, width), scratch_page, dtype=torch.int32, device=device)
        self._rows = torch.zeros(len(_ROWS), max_size, dtype=torch.long, pin_memory=pin)
        self._seq_lens = torch.ones(max_size, dtype=torch.int32, pin_memory=pin)
        self._tables = torch.full(
            (max_size, width), scratch_page, dtype=torch.int32, pin_memory=pin
        )
        self._tables_np = self._tables.numpy()
        self.logit_rows = torch.arange(max_size, device=device)

    def fits(self, batch: Sequence[SeqChunk]) -> bool:
        """Whether every chunk's pages fit a table row."""
        return all(cdiv(c.start_pos + 1, self.page_tokens) <= self.width for c in batch)

    def fill(self, batch: Sequence[SeqChunk]) -> None:
        """Copy a (padded) decode batch's indices into the first ``len(batch)`` rows."""
        n, pt = len(batch), self.page_tokens
        pos = [c.start_pos for c in batch]
        pages = [c.block_table[p // pt] for c, p in zip(batch, pos, strict=True)]
        offsets = [p % pt for p in pos]
        slots = [g * pt + o for g, o in zip(pages, offsets, strict=True)]
        tokens = [c.token_ids[0] for c in batch]
        self._rows[:, :n] = torch.tensor([tokens, pos, pages, offsets, slots])
        self._seq_lens[:n] = torch.tensor([p + 1 for p in pos], dtype=torch.int32)
        used = 1
        for i, (c, p) in enumerate(zip(batch, pos, strict=True)):
            k = p // pt + 1
            self._tables_np[i, :k] = c.block_table[:k]
            used = max(used, k)
        # From pinned buffers, without waiting: the copies queue ahead of the replay on the
        # same stream, and the host buffers are next written after this step's logits were
        # read back (the sampler waits on them), when the copies are long done.
        self.rows[:, :n].copy_(self._rows[:, :n], non_blocking=True)
        self.seq_lens[:n].copy_(self._seq_lens[:n], non_blocking=True)
        # the kernel reads a row's pages up to its own length: the columns past the widest
        # row are never read, so they are not copied
        self.tables[:n, :used].copy_(self._tables[:n, :used], non_blocking=True)

    def step(self, size: int) -> Step:
        """The :class:`Step` of the first ``size`` rows, every tensor a view of a buffer."""
        r = self.rows[:, :size]
        return Step(
            **{name: r[i] for i, name in enumerate(_ROWS)},
            logit_rows=self.logit_rows[:size],
            q_starts=list(range(size)),
            q_lens=[1] * size,
            ctx_lens=[],  # host lengths are not known at capture: plans read seq_lens
            block_tables=self.tables[:size],
        )


class DecodeGraphs:
    """The runner's decode steps at ``sizes``: captured graphs (``mode="graph"``, on CUDA)
    or their eager stand-ins (see the notes). Set as ``runner.graphs``; ``Runner.forward``
    hands it every batch and runs eagerly when :meth:`run` returns None."""

    def __init__(
        self,
        runner: Runner,
        sizes: Sequence[int],
        scratch_page: int,
        max_len: int,
        mode: Mode = "graph",
    ) -> None:
        reason = why_not(runner)
        if reason is not None:
            raise ValueError(f"decode graphs: {reason}")
        if not 0 <= scratch_page < runner.num_pages:
            raise ValueError(f"scratch page {scratch_page} is outside [0, {runner.num_pages})")
        if mode == "graph" and runner.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.runner, self.mode = runner, mode
        self.sizes = tuple(sorted(sizes))
        self.scratch_page = scratch_page
        width = cdiv(max_len, runner.page_tokens)
        self.inputs = StaticInputs(
            self.sizes[-1], width, runner.page_tokens, scratch_page, runner.device
        )
        self._plans: dict[int, object] = {}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.replays = 0  # steps that ran through a graph (or its stand-in)
        self.capture_seconds = 0.0

    def run(self, batch: Sequence[SeqChunk]) -> Tensor | None:
        """Logits [len(batch), vocab] of a decode batch through its size's graph, or None
        (nothing run) for a batch the graphs do not take. ``batch`` is validated."""
        size = bucket(len(batch), self.sizes)
        if size is None or self.runner.keep_hidden or self.runner.taps or not is_decode(batch):
            return None
        if not self.inputs.fits(batch):
            return None
        n = len(batch)
        padded = pad(batch, size, self.scratch_page)
        self.replays += 1
        if self.mode == "padded":
            return self.runner.forward_eager(padded)[:n]
        self.inputs.fill(padded)
        if self.mode == "static":
            return self._body(size)[:n]
        graph, out = self._graphs[size]
        graph.replay()
        # the output buffer is the next replay's: the caller gets rows of its own
        return out[:n].clone()

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size (``"graph"``; the stand-in modes only make the plans), largest
        first so the smaller graphs reuse its memory pool. Returns the seconds taken. Runs
        only the padding rows: nothing but the scratch page is written."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self.mode == "graph" else None
        for size in reversed(self.sizes) if self.mode != "padded" else ():
            self.inputs.fill(pad([], size, self.scratch_page))
            self._plan(size)
            if self.mode != "graph":
                continue
            current = torch.cuda.current_stream(self.runner.device)
            side = torch.cuda.Stream(self.runner.device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                # compiles and autotunes every kernel at this size: never inside a capture
                for _ in range(2):
                    self._body(size)
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._body(size)
            self._graphs[size] = (graph, out)
        if self.mode == "graph":
            torch.cuda.synchronize(self.runner.device)
        self.capture_seconds = time.perf_counter() - t0
        return self.capture_seconds

    def _plan(self, size: int) -> None:
        pages = self.runner.pages
        assert isinstance(pages, KvViews)
        self._plans[size] = pages.plan_decode(
            self.inputs.tables[:size], self.inputs.seq_lens[:size], size
        )

    def _body(self, size: int) -> Tensor:
        """What a graph holds: the forward of the first ``size`` static rows, every row's
        logits (float32). Mutates the KV pages the rows' slot_mapping names."""
        r = self.runner
        step = self.inputs.step(size)
        step = replace(step, rope=r.model.plan_rope(step), attention=self._plans[size])
        hidden = r.model.forward(step, Caches(r.pages.layers, [], []))
        return r.model.logits(hidden)


def start_graphs(engine, scheduler, *, max_len: int, mode: Mode = "graph") -> str:
    """Capture ``engine``'s decode graphs for ``scheduler``'s batches (at load, before anything
    listens, the scheduler idle): a scratch page is taken from the pool for the padding rows,
    and the scheduler's page count drops by it. Returns the start-up line's words. A capture
    that fails is logged in one line naming why and the decode runs eagerly, the page given
    back: a server that cannot capture still serves. ``mode``: as :class:`DecodeGraphs`'s (the
    stand-ins let the CPU tests run this path)."""
    from kern.engine.runner import Runner

    runner = engine.runner
    if not isinstance(runner, Runner) or (mode == "graph" and runner.device.type != "cuda"):
        return "eager"
    reason = why_not(runner)
    if reason is not None:
        return f"eager ({reason})"
    pages, _ = engine.cache.take_pages(1)
    if pages is None:
        return "eager (no page free for the padding rows)"
    scratch = int(np.frombuffer(pages, dtype=np.uint32)[0])
    sizes = capture_sizes(scheduler.max_running)
    try:
        graphs = DecodeGraphs(runner, sizes, scratch, max_len, mode=mode)
        seconds = graphs.capture()
    except Exception as e:  # noqa: BLE001 - any failure leaves an eager server, named
        engine.cache.free_pages(pages)
        why = f"{type(e).__name__}: {e}".splitlines()[0]
        log.warning("decode graphs: capture failed, decoding eagerly (%s)", why)
        return f"eager (capture failed: {why})"
    # the page is never freed: the requests' share of the pool is one page less
    scheduler.max_pages -= 1
    scheduler.memory.max_pages -= 1
    runner.graphs = graphs
    return f"cuda graphs at batch {','.join(map(str, sizes))} (captured in {seconds:.1f} s)"


def graphs_at_load(engine, scheduler, *, max_len: int, eager: bool) -> str:
    """What the app's load does for the decode steps (the start-up line's words): nothing on
    the CPU (""), eager when told (``--enforce-eager``, ``KERN_ENFORCE_EAGER``), else
    :func:`start_graphs`."""
    if engine.runner.device.type != "cuda":
        return ""
    if eager:
        return "eager (--enforce-eager)"
    return start_graphs(engine, scheduler, max_len=max_len)
