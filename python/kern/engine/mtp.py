"""``draft = "mtp"``: a deepseek_v3 checkpoint's own multi-token-prediction (MTP) layer drafts
the tokens a speculative decode step verifies.

Design notes
------------
* What the layer computes (transformers 5.23's ``MtpModel`` and MTP candidate generator, its
  oracle): the MTP entry of token position ``p`` (``p >= 1``) reads ``embed(token_p)`` and the
  target's last hidden state after its final norm at ``p - 1`` (``hidden_states[-1]``), runs
  one decoder block whose latent attention has a cache of its own (RoPE at ``p``), and its
  output, through the target's LM head, gives the logits of token ``p + 1``: the first draft.
  Further drafts reuse the one layer (as vLLM does): the next entry reads the drafted token
  and the layer's own previous output as the hidden. transformers, with one MTP layer,
  drafts one token a round; the first draft of a round is the same token in both. A
  checkpoint with several MTP layers (DeepSeek's have one) drafts with its first alone.
* Indices: the entry of position ``p`` sits at MTP index ``p - 1``: the MTP runs over
  ``tokens[1:]`` with hidden rows of positions ``0, 1, ...`` and RoPE at index + 1
  (:meth:`MtpRunner.forward`). Index 0 is real, every index below a sequence's length is
  written, and the paged attention, which reads ``[0, ctx)``, needs no mask.
* When it runs: right after each target forward (the scheduler's ``Drafter.stepped``;
  ``kern run`` after each of its forwards), over the indices whose token and target hidden
  are now known: ``[computed, num_computed)``, a prefill chunk's rows or a verify's sent
  rows. For a decoding sequence the last of them reads the token just sampled and gives the
  first draft of its next step: catch-up and first draft are one forward. The target's
  hidden rows (``Runner.keep_hidden``) are read then and dropped at its next forward; what a
  sequence keeps between steps is its first draft and one hidden row (the MTP's output at
  its last index), from which its next step drafts further: ``rows - 2`` one-row steps,
  batched (:func:`draft_further`). So the memory is one hidden row per drafting sequence
  plus the MTP's KV; nothing grows with the context but the KV.
* Trust: ``DraftState.computed`` counts the MTP entries written from the target's hidden.
  Entries written while drafting further (from the MTP's own hidden) lie past it, and the
  next catch-up overwrites them before any entry reads them as context.
* Where the target's hidden is gone, the entries are filled blind: from the token with a
  zero hidden (``hnorm(0) = 0``). That is a prefix-cache hit (the tree keeps the target's
  pages, never hidden states nor draft pages), draft pages dropped for the target's
  (``Memory.drop_drafts``), a preempted request coming back, or a step whose MTP pages could
  not be had. The target is never run again for them: drafts are proposals, verification
  keeps every answer exact whatever they are, and only the acceptance of drafts that attend
  to blind entries may drop. A sequence whose pages were dropped still drafts its first
  draft (it needs no KV) until the next catch-up refills them.
* Memory: the MTP's KV pages are pool pages (``Memory.take_draft_pages``, as a draft
  checkpoint's, freed with the request, never in the tree): one latent layer, ``page_tokens
  * m`` tokens in a pool page (``kern.engine.draft.draft_layout`` with a one-layer config;
  on the CPU the attention also needs ``m`` to divide the target's attention layers, so a
  61-layer target gets ``m = 1`` there and 32 on CUDA). The catch-up is not counted in the
  step's token budget (one layer over the tokens the target just ran through all of its
  own); it runs in forwards of at most :data:`CATCH_UP_ROWS` rows.
* A request that can never draft again (a grammar, or ``max_tokens`` too close) is skipped,
  and its MTP pages go back to the pool at once.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from kern.arith import cdiv
from kern.batch import build_step, validate
from kern.checkpoint import Checkpoint
from kern.chunk import SeqChunk
from kern.engine.arena import Arena, Placement
from kern.engine.draft import draft_layout
from kern.engine.layout import Layout
from kern.engine.memory import Memory
from kern.engine.params import GREEDY
from kern.engine.request import Request
from kern.engine.runner import Runner
from kern.engine.sampler import sample
from kern.engine.spec import DraftState, _num_drafts
from kern.errors import UsageError
from kern.kern_toml import Target
from kern.model_config import ModelConfig
from kern.models import Caches
from kern.models.deepseek_v3 import MtpLayer
from kern.rope import rope_frequencies

__all__ = [
    "CATCH_UP_ROWS",
    "CatchUp",
    "MtpDrafts",
    "MtpRunner",
    "MtpSequence",
    "catch_up",
    "check_mtp_target",
    "draft_further",
    "mtp_layout",
]

# Rows of one catch-up forward at most (a long blind fill is split into several).
CATCH_UP_ROWS = 512


def check_mtp_target(target: Target, config: ModelConfig) -> None:
    """Refuse ``draft = "mtp"`` where kern cannot run it: a family other than deepseek_v3, a
    checkpoint without an MTP layer, ranks above 1, no row shape above 1. ``config`` is the
    target checkpoint's. Raises :class:`UsageError` naming the key, target and checkpoint."""
    where = target.where("draft")
    name, ckpt = target.name, target.checkpoint
    if config.model_type != "deepseek_v3":
        raise UsageError(
            f"{where}: draft = 'mtp' drafts with a deepseek_v3 checkpoint's own "
            f"multi-token-prediction layer; target {name!r}'s checkpoint {ckpt} is "
            f"{config.model_type}"
        )
    if config.num_mtp_layers < 1:
        raise UsageError(
            f"{where}: draft = 'mtp': target {name!r}'s checkpoint {ckpt} has no "
            "multi-token-prediction layer (config.json: num_nextn_predict_layers is 0)"
        )
    if target.ranks != 1:
        raise UsageError(
            f"{where}: draft = 'mtp' with ranks = {target.ranks} ({target.where('ranks')}) is "
            f"not supported for target {name!r} (the MTP layer runs on one rank); use "
            "ranks = 1 or draft = 'ngram'"
        )
    if target.widest_rows < 2:
        raise UsageError(
            f"{where}: draft = 'mtp' drafts nothing for target {name!r} at rows "
            f"{list(target.rows)} ({target.where('rows')}; a step at rows R verifies R - 1 "
            "drafts): use a row shape above 1, e.g. rows = [1, 4]"
        )


def _one_layer(config: ModelConfig) -> ModelConfig:
    return dataclasses.replace(config, num_hidden_layers=1)


def mtp_layout(
    config: ModelConfig,
    dtype: torch.dtype,
    pool_page_bytes: int,
    page_tokens: int,
    where: str,
    *,
    any_stride: bool = False,
) -> Layout:
    """The MTP's one latent layer inside pool pages of ``pool_page_bytes`` (see the notes and
    ``kern.engine.draft.draft_layout``)."""
    return draft_layout(
        _one_layer(config), dtype, pool_page_bytes, page_tokens, where, any_stride=any_stride
    )


class MtpRunner:
    """The checkpoint's first MTP layer (loaded with ``mtp=True``) over latent pages of a
    one-layer layout, reading ``target``'s embedding and LM head. Built over the target's
    pool pages (:meth:`over_pool`) or pages of its own (:meth:`with_pages`)."""

    def __init__(
        self,
        target: Runner,
        checkpoint: Checkpoint,
        layout: Layout,
        placement: Placement,
        *,
        buffer: Tensor | None = None,
    ) -> None:
        c = target.config
        if not c.num_mtp_layers or (
            f"model.layers.{c.num_hidden_layers}.eh_proj.weight" not in checkpoint.tensors
        ):
            raise ValueError(
                f"{checkpoint.path}: no multi-token-prediction layer loaded "
                "(load_checkpoint(..., mtp=True) reads it)"
            )
        if layout.page_class != "latent" or layout.num_attention_layers != 1:
            raise ValueError("the MTP layer needs a one-layer latent layout")
        self.ops = target.ops
        self.config = c
        self.target = target.model
        self.layer = MtpLayer(self.ops, c, checkpoint.tensors, 0)
        self.layout = layout
        self.page_tokens = layout.page_tokens
        self.device = target.device
        self.arena = Arena(layout, placement, self.device, buffer=buffer)
        self.num_pages = self.arena.num_pages
        self._kv = [self.arena.pages[:, 0]]
        self._rope = rope_frequencies(c)

    @classmethod
    def over_pool(cls, target: Runner, checkpoint: Checkpoint, layout: Layout) -> MtpRunner:
        """Page ``p`` is the first ``layout.page_bytes`` of ``target``'s page ``p``: the same
        pool's pages (as ``Runner.draft_runner``)."""
        g = target.placement
        if layout.page_bytes > g.page_bytes:
            raise ValueError(
                f"a {layout.page_bytes}-byte MTP page does not fit a {g.page_bytes}-byte page"
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
        return cls(target, checkpoint, layout, placement, buffer=target.arena.buffer)

    @classmethod
    def with_pages(cls, target: Runner, checkpoint: Checkpoint, num_pages: int) -> MtpRunner:
        """Pages ``0 .. num_pages - 1`` of its own, of ``target``'s page size."""
        layout = Layout.of(_one_layer(target.config), target.dtype, target.page_tokens)
        return cls(target, checkpoint, layout, Placement.separate(layout, num_pages, 0))

    @torch.inference_mode()
    def forward(self, batch: Sequence[SeqChunk], hidden: Tensor) -> tuple[Tensor, list[int]]:
        """One step over ``batch``, chunks of MTP indices (``start_pos`` the first index; each
        token the one at position index + 1), ``hidden`` [T, hidden_size] the hidden each row
        reads. Returns the layer's output at the logits rows [N, hidden_size] and their greedy
        tokens (the target's head, ``Sampler.greedy``'s tie-break). Writes the rows' entries."""
        validate(batch, self.page_tokens, self.num_pages, False, 0)
        step = build_step(batch, self.page_tokens, self.device)
        c = self.config
        attention = self.ops.plan_latent_attention(step, self.arena.pages, c.num_attention_heads)
        rope = self.ops.plan_rope(step.positions + 1, c.rope_theta, c.rotary_dim, *self._rope)
        step = replace(step, rope=rope, attention=attention)
        embeds = self.target.embed[step.token_ids]
        out = self.layer(embeds, hidden, step, Caches(self._kv, [], []))[step.logit_rows]
        n = out.shape[0]
        if not n:
            return out, []
        logits = self.ops.linear(out, self.target.w_head).float()
        return out, sample(logits, [GREEDY] * n, [0] * n)


@dataclass(eq=False, slots=True)
class CatchUp:
    """One sequence's catch-up: MTP indices ``[state.computed, end)``, index ``i`` reading
    ``tokens[i + 1]``, and ``rows``, the target's hidden rows of indices ``[first, end)``
    (indices below ``first`` are filled blind, see the notes). ``draft``: the last index's
    output gives the sequence's next first draft."""

    state: DraftState
    tokens: Sequence[int]
    end: int
    first: int
    rows: Tensor
    draft: bool


def catch_up(
    mtp: MtpRunner, items: Sequence[CatchUp], max_rows: int = CATCH_UP_ROWS
) -> list[tuple[int, Tensor] | None]:
    """Run ``items`` in forwards of at most ``max_rows`` rows (a sequence's pieces in order);
    moves each state's ``computed`` to its ``end``. Returns, for each item that asked for it
    and ran, its first draft and the MTP's output row there ([1, hidden_size]). The states'
    tables must hold the pages of their indices."""
    out: list[tuple[int, Tensor] | None] = [None] * len(items)
    at = [it.state.computed for it in items]
    inputs = []
    for it, c in zip(items, at, strict=True):
        if not c <= it.end or not it.first <= it.end:
            raise ValueError(f"a catch-up from {c} (hidden from {it.first}) to {it.end}")
        rows = it.rows[max(c - it.first, 0) :]
        if c < it.first:
            rows = torch.cat([rows.new_zeros(it.first - c, rows.shape[1]), rows])
        inputs.append(rows)
    base = list(at)
    todo = [i for i, it in enumerate(items) if at[i] < it.end]
    while todo:
        batch, parts, ran = [], [], []
        room = max_rows
        for i in todo:
            if room <= 0:
                break
            it = items[i]
            n = min(it.end - at[i], room)
            wants = it.draft and at[i] + n == it.end
            batch.append(
                SeqChunk(
                    it.tokens[at[i] + 1 : at[i] + n + 1],
                    at[i],
                    it.state.table,
                    logits="last" if wants else "none",
                )
            )
            parts.append(inputs[i][at[i] - base[i] : at[i] - base[i] + n])
            ran.append((i, n, wants))
            room -= n
        rows, tokens = mtp.forward(batch, torch.cat(parts))
        j = 0
        for i, n, wants in ran:
            at[i] += n
            if wants:
                out[i] = (tokens[j], rows[j : j + 1])
                j += 1
        todo = [i for i in todo if at[i] < items[i].end]
    for it, c in zip(items, at, strict=True):
        it.state.computed = c
    return out


def draft_further(mtp: MtpRunner, go: Sequence[tuple[DraftState, int, Tensor, int]]) -> None:
    """``go``: (a state whose ``drafts`` hold its first draft, ``n`` its sequence's tokens in
    the target's KV, the MTP's output row behind the first draft, drafts wanted). One 1-row
    step per further draft, batched: draft ``j + 1`` is the entry of index ``n + j - 1``
    (the token ``drafts[-1]``, the previous output as the hidden). Those entries lie past
    ``computed``: the next catch-up overwrites them. The tables must hold their pages."""
    rows = [row for _, _, row, _ in go]
    for j in range(1, max((num for *_, num in go), default=0)):
        more = [i for i, (*_, num) in enumerate(go) if num > j]
        batch = [SeqChunk([go[i][0].drafts[-1]], go[i][1] + j - 1, go[i][0].table) for i in more]
        out, tokens = mtp.forward(batch, torch.cat([rows[i] for i in more]))
        for k, i in enumerate(more):
            go[i][0].drafts.append(tokens[k])
            rows[i] = out[k : k + 1]


def _may_draft(rows: int, req: Request) -> bool:
    """Whether ``req`` can draft at a later step (kern.engine.spec's rule, from its first
    token on): the catch-up is skipped for one that never will."""
    if req.grammar is not None:
        return False
    return min(rows - 1, req.max_tokens - max(req.num_output, 1) - 1) > 0


class MtpDrafts:
    """The scheduler's MTP drafter (a ``kern.engine.spec.Drafter``): catch-up and first
    drafts after each forward (:meth:`stepped`), further drafts before a verify
    (:meth:`run`), its pages from the pool (see the notes)."""

    def __init__(self, rows: int, mtp: MtpRunner, target: Runner) -> None:
        if rows < 2:
            raise ValueError(f"speculation needs rows >= 2, got {rows}")
        self.rows = rows
        self.mtp = mtp
        self.target = target
        target.keep_hidden = True
        # Request -> (its num_computed then, its first draft, the MTP's output row there).
        self._ready: weakref.WeakKeyDictionary[Request, tuple[int, int, Tensor]] = (
            weakref.WeakKeyDictionary()
        )

    def plan(self, req: Request, room: int) -> tuple[int, int] | None:
        """Up to ``rows - 1`` drafts within ``room`` once ``req`` has a first draft for its
        position; one only when its MTP pages were dropped since (it needs none)."""
        num = min(_num_drafts(self.rows, req), room)
        ready = self._ready.get(req)
        if num <= 0 or ready is None or ready[0] != req.num_computed:
            return None
        d = req.draft
        assert d is not None
        if d.computed != req.num_computed:
            num = 1
        d.planned = (req.num_computed, 0, num)
        return num, num

    def run(self, reqs: Sequence[Request], memory: Memory) -> None:
        """The first draft, then the further ones (pages from the pool, never preempting: a
        request whose pages cannot be had, or were dropped since it was planned, verifies
        its first draft alone)."""
        go: list[tuple[DraftState, int, Tensor, int]] = []
        for req in reqs:
            d = req.draft
            assert d is not None and d.planned is not None
            n, _, num = d.planned
            d.planned = None
            _, first, row = self._ready[req]
            d.drafts = [first]
            if num < 2 or d.computed != n:
                continue
            pages = memory.take_draft_pages(cdiv(n + num - 1, self.mtp.page_tokens) - len(d.table))
            if pages is None:
                continue
            d.table.extend(pages)
            go.append((d, n, row, num))
        if go:
            draft_further(self.mtp, go)

    def accepted(self, req: Request, accepted: int) -> None:
        pass  # the catch-up after the verify (stepped) reads what it kept

    def stepped(self, batch: Sequence[SeqChunk], reqs: Sequence[Request], memory: Memory) -> None:
        """After a target forward of ``batch`` (``reqs[i]`` ran ``batch[i]``; tokens sampled,
        verifies settled): each running request that may draft catches up over the indices
        its KV now holds, and one that decodes gets its next first draft."""
        hidden = self.target.hidden
        assert hidden is not None
        items: list[CatchUp] = []
        owners: list[Request] = []
        row = 0
        for chunk, req in zip(batch, reqs, strict=True):
            first, row = row, row + len(chunk.token_ids)
            self._ready.pop(req, None)
            if req.finish_reason is not None or not req.block_table:
                continue  # ended this step
            if not _may_draft(self.rows, req):
                memory.free_draft(req)  # it never drafts again: its MTP pages go back now
                continue
            d = req.draft
            if d is None:
                d = req.draft = DraftState()
            start, end = chunk.start_pos, req.num_computed
            assert 0 < end - start <= len(chunk.token_ids) and d.computed <= start
            pages = memory.take_draft_pages(cdiv(end, self.mtp.page_tokens) - len(d.table))
            if pages is None:
                continue
            d.table.extend(pages)
            rows = hidden[first : first + end - start]
            items.append(CatchUp(d, req.tokens, end, start, rows, end == len(req.tokens) - 1))
            owners.append(req)
        if not items:
            return
        for req, got in zip(owners, catch_up(self.mtp, items), strict=True):
            if got is not None:
                self._ready[req] = (req.num_computed, *got)


class MtpSequence:
    """``kern run``'s MTP drafter: one sequence over MTP pages of its own, driven by
    ``kern.engine.generate`` (:meth:`stepped` after each target forward, :meth:`drafts`
    before a verify)."""

    def __init__(self, target: Runner, checkpoint: Checkpoint, num_tokens: int) -> None:
        self.mtp = MtpRunner.with_pages(target, checkpoint, cdiv(num_tokens, target.page_tokens))
        self.target = target
        target.keep_hidden = True
        self.state = DraftState(table=list(range(self.mtp.num_pages)))
        self._ready: tuple[int, int, Tensor] | None = None

    def stepped(self, tokens: Sequence[int], start: int, end: int) -> None:
        """The last target forward ran one chunk from ``start``, whose first ``end - start``
        rows are now the sequence's KV; ``tokens[end]`` is its next token."""
        hidden = self.target.hidden
        assert hidden is not None and len(tokens) == end + 1
        item = CatchUp(self.state, tokens, end, start, hidden[: end - start], True)
        got = catch_up(self.mtp, [item])[0]
        self._ready = None if got is None else (end, *got)

    def drafts(self, num: int) -> list[int]:
        """``num`` greedy drafts for the next verify."""
        if num <= 0 or self._ready is None:
            return []
        n, first, row = self._ready
        self.state.drafts = [first]
        if num > 1:
            draft_further(self.mtp, [(self.state, n, row, num)])
        return list(self.state.drafts)
