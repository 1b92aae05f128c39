"""The model runner: one forward pass over a ragged batch, KV in pages, states in slots.

Design notes
------------
* The runner owns every tensor: the model, the device arena, the host arena (``kern.engine.arena``)
  and the backend (``ops``: CPU torch ops, CUDA Triton kernels, or the torch references). The
  scheduler hands it batches and the cache's plans, as ints and bytes, and never indexes a
  tensor itself.
* One device arena per budget, viewed as pages and as slots (``kern.engine.arena``), laid out by
  ``kern.engine.layout.Layout``:
  - Pages: ``kv_arena[num_pages, *page_shape]``, what a page holds being the family's page
    kind (``kern.models.pages``), bound to the arena as ``Runner.pages``: the per-layer views,
    the step's attention plan, and the rules a page kind brings (exact hits, a verify's
    rewind). A page is ``page_tokens`` positions of every attention layer, contiguous, so
    copying, parking or waking a page is one row of the arena. Read positions through
    :meth:`Runner.kv_at`, not by indexing the arena.
  - State slots (stateful models): ``delta_states[num_slots, L_lin, Hv, Dk, Dv]`` (float32,
    as the delta rule keeps it) and ``conv_states[num_slots, L_lin, C, K-1]`` (model dtype),
    one row per slot across all linear layers for the same reason.
* ``forward`` builds the step's index tensors once (``kern.batch.build_step`` plus the
  backend's attention / recurrent plans) and every layer reads them. Logits are computed
  only for the rows that need them: the final norm and LM head run on those rows alone.
* A chunk at ``start_pos == 0`` starts a sequence: its slot is cleared first, so the
  scheduler never has to (and a slot whose bytes were pages a moment ago starts clean).
* Verify chunks of stateful models (``logits="all"``, see ``SeqChunk``) also record the state
  after each row; :meth:`Runner.rewind` (``keep_rows`` for the slot, the page kind's own
  rewind for its pages) puts back the state after the first ``n`` rows of the last forward.
  KV and latent pages need no rewind: rejected positions are simply overwritten when the
  sequence gets there again.
* A drafter's runner (:meth:`Runner.over_arena`: a draft checkpoint's, or the target's MTP
  layer's, which reads the step's ``inputs``, the target's hidden rows, beside its tokens)
  views this runner's device arena with a layout of its own: its pages are the first bytes of
  pool pages (``Placement.page_stride`` is the pool's page size), so the drafter's KV comes
  from the same pool and budget, and this runner still owns the one tensor both read.
* ``keep_hidden`` (off unless a drafter reads it, kern.engine.drafters): ``forward`` also keeps
  every row's last hidden state after the final norm in ``hidden`` (transformers'
  ``hidden_states[-1]``), and ``taps`` the outputs of the layers it names in ``layer_hidden``
  (a block drafter reads several), until the next forward. The norm runs apart from the
  logits' own, so the logits are the same bits with them on or off; off, they cost nothing.
* Park and wake plans land as one batched copy per arena per list (``kern.engine.arena.land``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any, Protocol

import torch
from torch import Tensor

from kern.arith import cdiv
from kern.backend import Ops, make_ops
from kern.batch import Step, build_step, validate
from kern.checkpoint.load import Checkpoint
from kern.chunk import SeqChunk
from kern.engine.arena import Arena, Placement, land
from kern.engine.layout import Layout
from kern.models import registry
from kern.models.layers.caches import Caches
from kern.models.window import shadow_window, window_span
from kern.pool import CopyPlan

__all__ = ["Runner", "StepGraphs"]


class StepGraphs(Protocol):
    """Captured steps (``kern.engine.cuda_graphs.DecodeGraphs``): the logits of a batch they
    take, or None to run it eagerly."""

    def run(self, batch: Sequence[SeqChunk]) -> Tensor | None: ...


class Runner:
    """Runs a checkpoint's model on ``ops``' device over the arena ``placement`` cuts (and a
    host arena for parked cache entries when ``host`` is given). ``layout`` must be the one
    the placement was sized from (``Layout.of(config, ops.dtype, page_tokens)``).

    :meth:`with_pages` builds one over pages and slots of its own, without a pool;
    :meth:`over_arena` one for a drafter's model over this one's pool pages.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        ops: Ops,
        layout: Layout,
        placement: Placement,
        host: Placement | None = None,
        *,
        buffer: Tensor | None = None,
        model: Any = None,
    ) -> None:
        if layout.dtype != ops.dtype:
            raise ValueError(f"the layout is {layout.dtype}, the backend computes {ops.dtype}")
        if placement.num_pages < 1:
            raise ValueError("the arena holds no page")
        if layout.has_slots and placement.num_slots < 1:
            what = "window pages" if layout.windowed else "a recurrent state"
            raise ValueError(f"a model that keeps {what} needs at least one slot")
        self.ops = ops
        self.config = c = checkpoint.config
        self.layout = layout
        # The family's model, or one the caller built (a drafter's: the MTP layer).
        self.model = (
            model if model is not None else registry.of(c).build_model(ops, c, checkpoint.tensors)
        )
        self.device = ops.device
        self.dtype = ops.dtype
        self.page_tokens = layout.page_tokens
        self.stateful = layout.stateful
        # Window pages (kern.models.pages): in the slots, named by each chunk's window table;
        # a runner over its own memory (with_pages) derives the table from the block table.
        self.window_tokens = layout.pages.window_tokens
        self.own_windows = placement.own_windows
        self.arena = Arena(layout, placement, ops.device, buffer=buffer)
        self.placement = placement
        self.num_pages = self.arena.num_pages
        self.num_slots = self.arena.num_slots
        # The host tier: written only by parks and read only by wakes, so left unwritten.
        self.host: Arena | None = None
        if host is not None:
            pin = ops.device.type == "cuda"
            self.host = Arena(layout, host, torch.device("cpu"), zero=False, pin=pin)
        self.kv_arena = self.arena.pages
        self.conv_states = self.arena.conv
        self.delta_states = self.arena.delta
        # The page kind over this arena: layer views, attention plans, hit and rewind rules.
        windows = self.arena.slot_rows if layout.windowed else None
        self.pages = layout.pages.bind(self.arena.pages, self.arena.page_rows, ops, windows)
        # Whether a verify leaves state that must be rewound (Runner.rewind).
        self.rewinds = self.stateful or self.pages.rewinds
        self._row_states: dict[int, tuple[int, int]] = {}  # slot -> (first row, num rows)
        self._row_conv: Tensor | None = None
        self._row_delta: Tensor | None = None
        # Opt-in: the last forward's post-final-norm hidden rows [T, hidden], and the outputs
        # of the layers ``taps`` names (see the notes).
        self.keep_hidden = False
        self.hidden: Tensor | None = None
        self.taps: tuple[int, ...] = ()
        self.layer_hidden: dict[int, Tensor] = {}
        # Captured decode steps (kern.engine.cuda_graphs.DecodeGraphs), set after start-up.
        self.graphs: StepGraphs | None = None

    @classmethod
    def with_pages(
        cls,
        checkpoint: Checkpoint,
        *,
        num_pages: int,
        page_tokens: int,
        num_slots: int = 0,
        ops: Ops | None = None,
    ) -> Runner:
        """A runner over pages ``0 .. num_pages - 1`` and slots ``0 .. num_slots - 1`` of its
        own (ignored by stateless models), on ``ops`` (default: the CPU backend). A page kind
        with window pages gets ``cdiv(page_tokens, window_tokens)`` of them a page, and
        chunks without a window table read them through ``shadow_window``."""
        if num_pages < 1 or page_tokens < 1:
            raise ValueError("num_pages and page_tokens must be positive")
        ops = ops or make_ops("cpu")
        layout = Layout.of(checkpoint.config, ops.dtype, page_tokens)
        if layout.stateful and num_slots < 1:
            raise ValueError(
                f"{checkpoint.config.model_type} keeps a recurrent state: num_slots must be >= 1"
            )
        return cls(checkpoint, ops, layout, Placement.separate(layout, num_pages, num_slots))

    def over_arena(self, checkpoint: Checkpoint, layout: Layout, model: Any = None) -> Runner:
        """A runner for ``checkpoint`` (a drafter's: a draft model, or ``model``, the target's
        MTP layer) whose page ``p`` is the first ``layout.page_bytes`` of this runner's page
        ``p``, and slot ``s`` (a stateful draft) this arena's slot ``s``: the same arena
        bytes, so the same pool's pages and slots. Raises ``ValueError`` when the layout's
        pages or states do not fit this runner's placement."""
        g = self.placement
        if layout.page_bytes > g.page_bytes:
            raise ValueError(
                f"a {layout.page_bytes}-byte draft page does not fit a {g.page_bytes}-byte page"
            )
        placement = Placement(
            layout.page_bytes,
            g.num_pages,
            g.slot_stride,
            g.num_slots,
            g.arena_bytes,
            g.slot_offset,
            page_stride=g.page_bytes,
        )
        return Runner(
            checkpoint, self.ops, layout, placement, buffer=self.arena.buffer, model=model
        )

    def tap(self, layers: Iterable[int]) -> None:
        """Keep the outputs of ``layers`` (indices of the model's layers) after each forward,
        in ``layer_hidden`` (a drafter that reads several layers' hidden states)."""
        taps = tuple(sorted(set(layers)))
        n = len(self.model.layers)
        if any(not 0 <= i < n for i in taps):
            raise ValueError(f"layers to tap must be in [0, {n}), got {list(taps)}")
        self.taps = taps

    @torch.inference_mode()
    def forward(self, batch: Sequence[SeqChunk], inputs: Tensor | None = None) -> Tensor:
        """Run one step; returns float32 logits [num_logit_rows, vocab], rows in batch order
        (per chunk: its last row for ``"last"``, every row for ``"all"``, none for
        ``"none"``). With ``keep_hidden``, ``hidden`` is then every row's post-norm hidden
        state, rows in batch order; with ``taps``, ``layer_hidden`` the tapped layers'.
        ``inputs``: rows the model reads beside the tokens (the MTP layer's hidden rows).

        Mutates: writes each chunk's K/V at its positions through its block table and, for
        stateful models, replaces each chunk's slot state with the state after its rows.
        Raises ``ValueError`` for a malformed batch (before touching any memory).
        """
        validate(batch, self.page_tokens, self.num_pages, self.stateful, self.num_slots)
        if self.window_tokens:
            batch = self._windows(batch)
        # A decode batch the captured graphs take (kern.engine.cuda_graphs); else eager.
        if self.graphs is not None and inputs is None:
            logits = self.graphs.run(batch)
            if logits is not None:
                return logits
        return self.forward_eager(batch, inputs)

    @torch.inference_mode()
    def forward_eager(self, batch: Sequence[SeqChunk], inputs: Tensor | None = None) -> Tensor:
        """:meth:`forward` without the graphs, on a batch already validated."""
        step = build_step(batch, self.page_tokens, self.device)
        attention = self.pages.plan(step, batch)
        caches = Caches(self.pages.layers, [], [], taps=dict.fromkeys(self.taps))
        recurrent = self._plan_states(batch, step, caches) if self.stateful else None
        rope = self.model.plan_rope(step)
        window = self.pages.window_step(step, batch)
        step = replace(
            step,
            rope=rope,
            attention=attention,
            recurrent=recurrent,
            inputs=inputs,
            window=window,
        )
        hidden = self.model.forward(step, caches)
        self.pages.stepped(step)
        if self.keep_hidden:
            self.hidden = self.model.final_hidden(hidden)
        if self.taps:
            self.layer_hidden = caches.taps  # type: ignore[assignment]
        return self.model.logits(hidden[step.logit_rows])

    def _windows(self, batch: Sequence[SeqChunk]) -> Sequence[SeqChunk]:
        """``batch`` with every chunk's window table (derived where the runner owns its
        memory); ``ValueError`` naming a chunk whose table misses a window page it reaches."""
        w, out = self.window_tokens, []
        for i, c in enumerate(batch):
            end = c.start_pos + len(c.token_ids)
            span = window_span(c.start_pos, end, w)
            if c.window is None:
                if not self.own_windows:
                    raise ValueError(f"chunk {i}: this model's chunks need their window pages")
                table = shadow_window(c.block_table, self.page_tokens, w, end, span.start)
                c = replace(c, window=table)
            assert c.window is not None
            held = c.window[span.start : span.stop]
            if len(held) < len(span) or min(held) < 0 or max(held) >= self.num_slots:
                raise ValueError(
                    f"chunk {i}: window pages {span.start}..{span.stop - 1} (positions "
                    f"{c.start_pos}..{end - 1} and their window) must be in [0, {self.num_slots})"
                )
            out.append(c)
        return out

    def _plan_states(self, batch: Sequence[SeqChunk], step: Step, caches: Caches) -> object:
        """The recurrent mixers' plan; clears the slots of chunks that start a sequence, and
        points ``caches`` at the states (and, for verify chunks, at per-row snapshots)."""
        assert self.conv_states is not None and self.delta_states is not None
        self._row_states = {}
        slots = [ch.slot for ch in batch]
        fresh = [ch.slot for ch in batch if ch.start_pos == 0]
        if fresh:
            idx = torch.tensor(fresh, device=self.device)
            self.conv_states[idx] = 0
            self.delta_states[idx] = 0
        verify = [b for b, ch in enumerate(batch) if ch.logits == "all"]
        delta = self.config.delta
        assert delta is not None
        recurrent, first = self.ops.plan_recurrent(step, slots, verify, delta.conv_kernel_dim)
        num_linear = self.layout.num_linear_layers
        caches.conv = [self.conv_states[:, i] for i in range(num_linear)]
        caches.delta = [self.delta_states[:, i] for i in range(num_linear)]
        if verify:
            num_rows = sum(step.q_lens[b] for b in verify)
            self._row_conv = self.conv_states.new_empty(num_rows, *self.conv_states.shape[1:])
            self._row_delta = self.delta_states.new_empty(num_rows, *self.delta_states.shape[1:])
            caches.conv_snap = [self._row_conv[:, i] for i in range(num_linear)]
            caches.delta_snap = [self._row_delta[:, i] for i in range(num_linear)]
            self._row_states = {slots[b]: (first[b], step.q_lens[b]) for b in verify}
        return recurrent

    def rewind(
        self,
        block_table: Sequence[int],
        start_pos: int,
        slot: int | None,
        num_rows: int,
        window: Sequence[int] | None = None,
    ) -> None:
        """After a verify chunk of the last forward (at ``start_pos``, ``block_table``, state
        in ``slot``, window pages ``window``), leave its pages and state as its first
        ``num_rows`` rows left them: the page kind's rewind, then the slot's
        (:meth:`keep_rows`). Rejected rows' K/V is overwritten before anything reads it."""
        self.pages.rewind(block_table, start_pos, num_rows, window)
        if self.stateful:
            assert slot is not None
            self.keep_rows(slot, num_rows)

    def keep_rows(self, slot: int, num_rows: int) -> None:
        """After a forward in which ``slot``'s chunk verified R rows (``logits="all"``), set
        its state to the state after its first ``num_rows`` rows (1 <= num_rows <= R).

        Mutates the slot. Valid only until the next ``forward``; raises ``KeyError`` when the
        last forward kept no row states for ``slot``, ``ValueError`` for a bad count.
        """
        if slot not in self._row_states:
            raise KeyError(f"the last forward kept no row states for slot {slot}")
        first, rows = self._row_states[slot]
        if not 1 <= num_rows <= rows:
            raise ValueError(f"num_rows must be in [1, {rows}], got {num_rows}")
        assert self._row_conv is not None and self._row_delta is not None
        assert self.conv_states is not None and self.delta_states is not None
        self.conv_states[slot] = self._row_conv[first + num_rows - 1]
        self.delta_states[slot] = self._row_delta[first + num_rows - 1]

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy whole KV pages ``src[i] -> dst[i]`` (every layer), as one index copy.

        For copy-on-write of a partly filled prefix page. Mutates ``dst`` pages; ``dst`` must
        not repeat and must not overlap ``src``. On a runner over its own memory a page's
        window pages (``shadow_window``'s) travel with it.
        """
        _copy(self.arena.page_rows, src, dst)
        if self.own_windows and self.arena.slot_rows is not None:
            per = cdiv(self.page_tokens, self.window_tokens)
            _copy(self.arena.slot_rows, _windows_of(src, per), _windows_of(dst, per))

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy recurrent states ``src[i] -> dst[i]`` (state snapshots). Mutates ``dst``
        slots; a no-op for stateless models."""
        if self.arena.slot_rows is not None:
            _copy(self.arena.slot_rows, src, dst)

    def snapshot_window(self, window: Sequence[int], end: int, dst: int) -> None:
        """Make window page ``dst`` the snapshot at ``end`` of the sequence whose window pages
        are ``window`` (``Pages.snapshot``)."""
        self.pages.snapshot(window, end, dst)

    def restore_window(self, src: int, dst: Sequence[int]) -> None:
        """Copy snapshot ``src`` into window pages ``dst`` (``Pages.restore``)."""
        self.pages.restore(src, dst)

    def park(self, plans: Sequence[CopyPlan]) -> None:
        """Land the park plans of one make-room call (device -> host), in order, as one copy
        per arena. Must run before the device pages they free are written again."""
        if not plans:
            return
        if self.host is None:
            raise ValueError("a park plan for a runner without a host arena")
        pages = [(p.src_pages, p.dst_pages) for p in plans]
        slots = [(p.src_states, p.dst_states) for p in plans]
        land(self.host, self.arena, pages, slots)

    def wake(self, plan: CopyPlan) -> None:
        """Land a wake plan (host -> device) before the woken pages are read."""
        if self.host is None:
            raise ValueError("a wake plan for a runner without a host arena")
        land(
            self.arena,
            self.host,
            [(plan.src_pages, plan.dst_pages)],
            [(plan.src_states, plan.dst_states)],
        )

    def kv_at(
        self,
        block_table: Sequence[int],
        positions: Sequence[int],
        window: Sequence[int] | None = None,
    ) -> Tensor:
        """A copy of what the pages hold at ``positions`` of a sequence: for K/V pages
        [n, layers, 2, Hk, D], latent pages [n, layers, C], compressed pages the window
        entries [n, layers, D] (``Pages.kv_at``), read through the sequence's window pages
        ``window`` (derived on a runner over its own memory)."""
        if not self.window_tokens:
            return self.pages.kv_at(block_table, positions)
        if window is None and not self.own_windows:
            raise ValueError("this model's positions are read through their window pages")
        return self.pages.kv_at(block_table, positions, window)


def _copy(rows: Tensor, src: Sequence[int], dst: Sequence[int]) -> None:
    if len(src) != len(dst):
        raise ValueError("src and dst differ in length")
    if src:
        s = torch.tensor(list(src), device=rows.device)
        d = torch.tensor(list(dst), device=rows.device)
        rows.index_copy_(0, d, rows.index_select(0, s))


def _windows_of(pages: Sequence[int], per: int) -> list[int]:
    """The window pages ``shadow_window`` gives ``pages`` (``per`` a page)."""
    return [p * per + i for p in pages for i in range(per)]
