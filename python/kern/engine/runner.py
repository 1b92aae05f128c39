"""The model runner: one forward pass over a ragged batch, KV in pages, states in slots.

Design notes
------------
* The runner owns every tensor: the model, the device arena, the host arena (``kern.engine.arena``)
  and the backend (``ops``: CPU torch ops, CUDA Triton kernels, or the torch references). The
  scheduler hands it batches and the cache's plans, as ints and bytes, and never indexes a
  tensor itself.
* One device arena per budget, viewed as pages and as slots (``kern.engine.arena``), laid out by
  ``kern.engine.layout.Layout``:
  - KV pages: ``kv_arena[num_pages, num_attention_layers, 2, Hk, page_tokens, D]``, or for
    latent attention ``kv_arena[num_pages, num_attention_layers, page_tokens, C]`` (the page
    classes of ``kern.engine.layout``). A page is ``page_tokens`` positions of every attention
    layer, contiguous, so copying, parking or waking a page is one row of the arena. Layer
    ``l`` reads and writes the strided view ``kv_arena[:, l]``; how K and V sit inside a page
    is the backend's choice (the CPU stores K transposed, see ``kern.backend.cpu_attention``),
    so read positions through :meth:`Runner.kv_at`, not by indexing the arena.
  - State slots (stateful models): ``delta_states[num_slots, L_lin, Hv, Dk, Dv]`` (float32,
    as the delta rule keeps it) and ``conv_states[num_slots, L_lin, C, K-1]`` (model dtype),
    one row per slot across all linear layers for the same reason.
* ``forward`` builds the step's index tensors once (``kern.batch.build_step`` plus the
  backend's attention / recurrent plans) and every layer reads them. Logits are computed
  only for the rows that need them: the final norm and LM head run on those rows alone.
* A chunk at ``start_pos == 0`` starts a sequence: its slot is cleared first, so the
  scheduler never has to (and a slot whose bytes were pages a moment ago starts clean).
* Verify chunks of stateful models (``logits="all"``, see ``SeqChunk``) also record the state
  after each row; ``keep_rows(slot, n)`` rewinds the slot to the state after its first ``n``
  rows of the last forward. Attention KV needs no rewind: rejected positions are simply
  overwritten when the sequence gets there again.
* A draft checkpoint's runner (:meth:`Runner.draft_runner`) views this runner's device arena
  with a layout of its own: its pages are the first bytes of pool pages (``Placement.page_stride``
  is the pool's page size), so the draft's KV comes from the same pool and budget, and this
  runner still owns the one tensor both read.
* ``keep_hidden`` (off unless an MTP drafter runs, kern.engine.mtp): ``forward`` also keeps
  every row's last hidden state after the final norm in ``hidden`` (transformers'
  ``hidden_states[-1]``), until the next forward. The norm runs apart from the logits' own, so
  the logits are the same bits with it on or off; off, it costs nothing.
* Park and wake plans land as one batched copy per arena per list (``kern.engine.arena.land``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from kern.backend import Ops, make_ops
from kern.backend.compressed_attention import plan as plan_compressed
from kern.backend.compressed_attention import rewind as rewind_compressed
from kern.batch import Step, build_step, validate
from kern.checkpoint import Checkpoint
from kern.chunk import SeqChunk
from kern.engine.arena import Arena, Placement, land
from kern.engine.compressed_layout import CompressedPage
from kern.engine.layout import Layout
from kern.models import Caches, build_model
from kern.pool import CopyPlan
from kern.rope import rope_frequencies

if TYPE_CHECKING:
    from kern.engine.cuda_graphs import DecodeGraphs

__all__ = ["Runner"]


class Runner:
    """Runs a checkpoint's model on ``ops``' device over the arena ``placement`` cuts (and a
    host arena for parked cache entries when ``host`` is given). ``layout`` must be the one
    the placement was sized from (``Layout.of(config, ops.dtype, page_tokens)``).

    :meth:`with_pages` builds one over pages and slots of its own, without a pool;
    :meth:`draft_runner` one for a draft checkpoint over this one's pool pages.
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
    ) -> None:
        if layout.dtype != ops.dtype:
            raise ValueError(f"the layout is {layout.dtype}, the backend computes {ops.dtype}")
        if placement.num_pages < 1:
            raise ValueError("the arena holds no page")
        if layout.stateful and placement.num_slots < 1:
            raise ValueError("a stateful model needs at least one state slot")
        self.ops = ops
        self.config = c = checkpoint.config
        self.layout = layout
        self.model = build_model(ops, c, checkpoint.tensors)
        self.device = ops.device
        self.dtype = ops.dtype
        self.page_tokens = layout.page_tokens
        self.stateful = layout.stateful
        # Compressed pages hold their pooling state at their last written token.
        self.whole_page_hits = layout.page_class == "compressed"
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
        self._kv = [self.kv_arena[:, i] for i in range(layout.num_attention_layers)]
        if layout.page_class == "compressed":
            page = CompressedPage.of(c, ops.dtype, layout.page_tokens)
            self._kv = page.views(self.arena.page_rows)  # type: ignore[assignment]
            self._state_ends = page.positions(self.arena.page_rows)
            self._state_ends.fill_(-1)
        self._rope = rope_frequencies(c)
        self._row_states: dict[int, tuple[int, int]] = {}  # slot -> (first row, num rows)
        # Compressed pages: the last forward's plan and its verify chunks' first kept rows.
        self._verify_plan = None
        self._verified: dict[tuple[int, int], int] = {}
        self._row_conv: Tensor | None = None
        self._row_delta: Tensor | None = None
        # Opt-in: the last forward's post-final-norm hidden rows [T, hidden] (see the notes).
        self.keep_hidden = False
        self.hidden: Tensor | None = None
        # Captured decode steps (kern.engine.cuda_graphs.DecodeGraphs), set after start-up.
        self.graphs: DecodeGraphs | None = None

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
        own (ignored by stateless models), on ``ops`` (default: the CPU backend)."""
        if num_pages < 1 or page_tokens < 1:
            raise ValueError("num_pages and page_tokens must be positive")
        ops = ops or make_ops("cpu")
        layout = Layout.of(checkpoint.config, ops.dtype, page_tokens)
        if layout.stateful and num_slots < 1:
            raise ValueError(
                f"{checkpoint.config.model_type} keeps a recurrent state: num_slots must be >= 1"
            )
        return cls(checkpoint, ops, layout, Placement.separate(layout, num_pages, num_slots))

    def draft_runner(self, checkpoint: Checkpoint, layout: Layout) -> Runner:
        """A runner for ``checkpoint`` (a draft model, ``layout`` from
        ``kern.engine.draft.draft_layout``) whose page ``p`` is the first ``layout.page_bytes`` of
        this runner's page ``p``, and slot ``s`` (a stateful draft) this arena's slot ``s``:
        the same arena bytes, so the same pool's pages and slots. Raises ``ValueError`` when
        the layout's pages or states do not fit this runner's placement."""
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
        return Runner(checkpoint, self.ops, layout, placement, buffer=self.arena.buffer)

    @torch.inference_mode()
    def forward(self, batch: Sequence[SeqChunk]) -> Tensor:
        """Run one step; returns float32 logits [num_logit_rows, vocab], rows in batch order
        (per chunk: its last row for ``"last"``, every row for ``"all"``, none for
        ``"none"``). With ``keep_hidden``, ``hidden`` is then every row's post-norm hidden
        state, rows in batch order.

        Mutates: writes each chunk's K/V at its positions through its block table and, for
        stateful models, replaces each chunk's slot state with the state after its rows.
        Raises ``ValueError`` for a malformed batch (before touching any memory).
        """
        validate(batch, self.page_tokens, self.num_pages, self.stateful, self.num_slots)
        # A decode batch the captured graphs take (kern.engine.cuda_graphs); else eager.
        if self.graphs is not None and (logits := self.graphs.run(batch)) is not None:
            return logits
        return self.forward_eager(batch)

    @torch.inference_mode()
    def forward_eager(self, batch: Sequence[SeqChunk]) -> Tensor:
        """:meth:`forward` without the graphs, on a batch already validated."""
        step = build_step(batch, self.page_tokens, self.device)
        c = self.config
        attention = None
        if self.layout.page_class == "compressed":
            return self._forward_compressed(batch, step)
        if self.layout.page_class == "latent":
            attention = self.ops.plan_latent_attention(step, self.kv_arena, c.num_attention_heads)
        elif self.model.num_attention_layers:
            attention = self.ops.plan_attention(
                step, self.kv_arena, c.num_attention_heads // c.num_key_value_heads
            )
        caches = Caches(self._kv, [], [])
        recurrent = None
        self._row_states = {}
        if self.conv_states is not None and self.delta_states is not None:
            slots = [ch.slot for ch in batch]
            fresh = [ch.slot for ch in batch if ch.start_pos == 0]
            if fresh:
                idx = torch.tensor(fresh, device=self.device)
                self.conv_states[idx] = 0
                self.delta_states[idx] = 0
            verify = [b for b, ch in enumerate(batch) if ch.logits == "all"]
            recurrent, first = self.ops.plan_recurrent(
                step, slots, verify, c.linear_conv_kernel_dim
            )
            num_linear = self.model.num_linear_layers
            caches.conv = [self.conv_states[:, i] for i in range(num_linear)]
            caches.delta = [self.delta_states[:, i] for i in range(num_linear)]
            if verify:
                num_rows = sum(step.q_lens[b] for b in verify)
                self._row_conv = self.conv_states.new_empty(num_rows, *self.conv_states.shape[1:])
                self._row_delta = self.delta_states.new_empty(
                    num_rows, *self.delta_states.shape[1:]
                )
                caches.conv_snap = [self._row_conv[:, i] for i in range(num_linear)]
                caches.delta_snap = [self._row_delta[:, i] for i in range(num_linear)]
                self._row_states = {slots[b]: (first[b], step.q_lens[b]) for b in verify}
        rope = self.ops.plan_rope(step.positions, c.rope_theta, c.rotary_dim, *self._rope)
        step = replace(step, rope=rope, attention=attention, recurrent=recurrent)
        hidden = self.model.forward(step, caches)
        if self.keep_hidden:
            self.hidden = self.ops.rms_norm(hidden, self.model.final_norm, c.rms_norm_eps)
        return self.model.logits(hidden[step.logit_rows])

    def _forward_compressed(self, batch: Sequence[SeqChunk], step: Step) -> Tensor:
        """:meth:`forward_eager` for DeepSeek-V4's compressed pages (one plan, every layer).
        The pooling state after each row of a verify chunk is kept for :meth:`keep_positions`."""
        model = self.model
        keep, self._verified = [], {}
        for b, chunk in enumerate(batch):
            if chunk.logits == "all":
                # Keyed by the page it writes first: no other running sequence holds it.
                page = chunk.block_table[chunk.start_pos // self.page_tokens]
                self._verified[(chunk.start_pos, page)] = len(keep)
                keep.extend(range(step.q_starts[b], step.q_starts[b] + step.q_lens[b]))
        window = self.config.sliding_window
        attention = plan_compressed(step, self.page_tokens, window, model.rates, keep)
        self._verify_plan = attention
        step = replace(step, rope=model.ropes, attention=attention)
        hidden = model.forward(step, Caches(self._kv, [], []))
        rows = attention.state_rows
        self._state_ends[attention.row_page[rows]] = step.positions[rows].int()
        if self.keep_hidden:
            self.hidden = self.ops.rms_norm(hidden, model.final_norm, self.config.rms_norm_eps)
        return model.logits(hidden[step.logit_rows])

    def state_end(self, page: int) -> int:
        """Compressed pages: the position whose pooling state ``page`` holds (-1: none)."""
        return int(self._state_ends[page])

    def keep_positions(self, block_table: Sequence[int], start_pos: int, num_rows: int) -> None:
        """Compressed pages: after a verify chunk at ``start_pos`` of the last forward, leave
        the pooling state as its first ``num_rows`` rows left it (in the page of its last
        kept row). Rejected rows' window entries and closed entries are rewritten before
        anything reads them."""
        pt = self.page_tokens
        first = self._verified[(start_pos, block_table[start_pos // pt])]
        last = start_pos + num_rows - 1
        rewind_compressed(self._verify_plan, first + num_rows - 1, block_table[last // pt])
        self._state_ends[block_table[last // pt]] = last

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
        not repeat and must not overlap ``src``.
        """
        _copy(self.arena.page_rows, src, dst)

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy recurrent states ``src[i] -> dst[i]`` (state snapshots). Mutates ``dst``
        slots; a no-op for stateless models."""
        if self.arena.slot_rows is not None:
            _copy(self.arena.slot_rows, src, dst)

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

    def kv_at(self, block_table: Sequence[int], positions: Sequence[int]) -> Tensor:
        """A copy of the K/V at ``positions`` of a sequence: [n, layers, 2, Hk, D], for
        latent pages the cached vectors, [n, layers, C], for compressed pages the window
        entries, [n, layers, D]."""
        pos = torch.tensor(list(positions), device=self.device)
        pages = torch.tensor(list(block_table), device=self.device)[pos // self.page_tokens]
        offsets = pos % self.page_tokens
        if self.layout.page_class == "compressed":
            return torch.stack([v.window[pages, offsets] for v in self._kv], dim=1)
        if self.layout.page_class == "latent":
            return torch.stack([layer[pages, offsets] for layer in self._kv], dim=1)
        out = []
        for layer in self._kv:
            k, v = self.ops.kv_views(layer)
            out.append(torch.stack([k[pages, offsets], v[pages, offsets]], dim=1))
        return torch.stack(out, dim=1)


def _copy(rows: Tensor, src: Sequence[int], dst: Sequence[int]) -> None:
    if len(src) != len(dst):
        raise ValueError("src and dst differ in length")
    if src:
        s = torch.tensor(list(src), device=rows.device)
        d = torch.tensor(list(dst), device=rows.device)
        rows.index_copy_(0, d, rows.index_select(0, s))
