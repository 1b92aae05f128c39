"""``draft = "mtp"``: a checkpoint's own multi-token-prediction (MTP) layer drafts the tokens a
speculative decode step verifies (the families whose registry row has ``mtp``: deepseek_v3).

Design notes
------------
* What the layer computes (transformers 5.23's ``MtpModel`` and MTP candidate generator, its
  oracle; the model is the family's, ``kern.models.deepseek_v3.mtp.MtpModel``, run by a
  ``Runner`` of its own over the target's arena or, for ``kern run``, pages of its own): the
  MTP entry of token position ``p`` (``p >= 1``) reads ``embed(token_p)`` and the
  target's last hidden state after its final norm at ``p - 1`` (``hidden_states[-1]``), runs
  one decoder block whose latent attention has a cache of its own (RoPE at ``p``), and its
  output, through the target's LM head, gives the logits of token ``p + 1``: the first draft.
  Further drafts reuse the one layer (as vLLM does): the next entry reads the drafted token
  and the layer's own previous output as the hidden. transformers, with one MTP layer,
  drafts one token a round; the first draft of a round is the same token in both. A
  checkpoint with several MTP layers (DeepSeek's have one) drafts with its first alone.
* Indices: the entry of position ``p`` sits at MTP index ``p - 1``: the MTP runs over
  ``tokens[1:]`` with hidden rows of positions ``0, 1, ...`` (the step's ``inputs``) and RoPE
  at index + 1. Index 0 is real, every index below a sequence's length is
  written, and the paged attention, which reads ``[0, ctx)``, needs no mask.
* When it runs: right after each target forward (``Drafter.stepped``, called by the scheduler
  and by ``kern run`` alike), over the indices whose token and target hidden
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
  * m`` tokens in a pool page (``kern.engine.drafters.model.draft_layout`` with a one-layer config;
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
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kern.arith import cdiv
from kern.checkpoint.config import load_config
from kern.checkpoint.load import Checkpoint
from kern.chunk import SeqChunk
from kern.engine.arena import Placement
from kern.engine.drafters import DraftMemory, SoloMemory, num_drafts
from kern.engine.drafters.model import draft_layout
from kern.engine.layout import Layout
from kern.engine.params import GREEDY
from kern.engine.request import DraftState, Request
from kern.engine.runner import Runner
from kern.engine.sampler import sample
from kern.errors import UsageError
from kern.kern_toml import Target
from kern.models import registry
from kern.models.config import ModelConfig

__all__ = [
    "CATCH_UP_ROWS",
    "CatchUp",
    "MtpDrafting",
    "MtpDrafts",
    "MtpState",
    "catch_up",
    "check_mtp_target",
    "draft_further",
    "mtp_layout",
    "mtp_runner",
]

# Rows of one catch-up forward at most (a long blind fill is split into several).
CATCH_UP_ROWS = 512


def check_mtp_target(target: Target, config: ModelConfig) -> None:
    """Refuse ``draft = "mtp"`` where kern cannot run it: a family without MTP layers (its
    registry row), a checkpoint without an MTP layer, ranks above 1, no row shape above 1.
    ``config`` is the target checkpoint's. Raises :class:`UsageError` naming the key, target
    and checkpoint."""
    where = target.where("draft")
    name, ckpt = target.name, target.checkpoint
    if registry.of(config).mtp is None:
        raise UsageError(
            f"{where}: draft = 'mtp' drafts with a {' or '.join(registry.with_mtp())} "
            f"checkpoint's own multi-token-prediction layer; target {name!r}'s checkpoint "
            f"{ckpt} is {config.model_type}"
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
    ``kern.engine.drafters.model.draft_layout``)."""
    return draft_layout(
        _one_layer(config), dtype, pool_page_bytes, page_tokens, where, any_stride=any_stride
    )


def mtp_runner(
    target: Runner, checkpoint: Checkpoint, layout: Layout | None = None, num_pages: int = 0
) -> Runner:
    """The checkpoint's first MTP layer (loaded with ``mtp=True``) run by a runner of its
    own, reading ``target``'s embedding and LM head: over ``target``'s arena in ``layout``
    (the pool's pages, as a draft checkpoint's), or, without one, over ``num_pages`` pages of
    its own of ``target``'s page size. It keeps its output rows (``hidden``)."""
    c = target.config
    if not c.num_mtp_layers or (
        f"model.layers.{c.num_hidden_layers}.eh_proj.weight" not in checkpoint.tensors
    ):
        raise ValueError(
            f"{checkpoint.path}: no multi-token-prediction layer loaded "
            "(load_checkpoint(..., mtp=True) reads it)"
        )
    mtp = registry.of(c).mtp
    assert mtp is not None
    model = registry.load(mtp.model)(target.ops, c, checkpoint.tensors, target.model)
    if layout is None:
        layout = Layout.of(_one_layer(c), target.dtype, target.page_tokens)
        placement = Placement.separate(layout, num_pages, 0)
        runner = Runner(checkpoint, target.ops, layout, placement, model=model)
    else:
        if layout.num_attention_layers != 1:
            raise ValueError("the MTP layer needs a one-layer layout")
        runner = target.over_arena(checkpoint, layout, model=model)
    runner.keep_hidden = True
    return runner


def _step(mtp: Runner, batch: Sequence[SeqChunk], hidden: Tensor) -> tuple[Tensor, list[int]]:
    """One MTP forward over ``batch`` (chunks of MTP indices: ``start_pos`` the first index,
    each token the one at position index + 1), ``hidden`` [T, hidden_size] the hidden each
    row reads: the layer's output at the logits rows [N, hidden_size] and their greedy
    tokens (the target's head, ``Sampler.greedy``'s tie-break). Writes the rows' entries."""
    logits = mtp.forward(batch, inputs=hidden)
    assert mtp.hidden is not None
    rows: list[int] = []
    start = 0
    for chunk in batch:
        n = len(chunk.token_ids)
        if chunk.logits == "last":
            rows.append(start + n - 1)
        elif chunk.logits == "all":
            rows.extend(range(start, start + n))
        start += n
    out = mtp.hidden[rows]
    n = logits.shape[0]
    if not n:
        return out, []
    return out, sample(logits, [GREEDY] * n, [0] * n)


@dataclass(eq=False, slots=True)
class MtpState(DraftState):
    """A request's drafts and its MTP pages (``DraftState``'s), and what this step drafts:
    (``num_computed`` when planned, 0, drafts)."""

    planned: tuple[int, int, int] | None = None


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
    mtp: Runner, items: Sequence[CatchUp], max_rows: int = CATCH_UP_ROWS
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
        rows, tokens = _step(mtp, batch, torch.cat(parts))
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


def draft_further(mtp: Runner, go: Sequence[tuple[DraftState, int, Tensor, int]]) -> None:
    """``go``: (a state whose ``drafts`` hold its first draft, ``n`` its sequence's tokens in
    the target's KV, the MTP's output row behind the first draft, drafts wanted). One 1-row
    step per further draft, batched: draft ``j + 1`` is the entry of index ``n + j - 1``
    (the token ``drafts[-1]``, the previous output as the hidden). Those entries lie past
    ``computed``: the next catch-up overwrites them. The tables must hold their pages."""
    rows = [row for _, _, row, _ in go]
    for j in range(1, max((num for *_, num in go), default=0)):
        more = [i for i, (*_, num) in enumerate(go) if num > j]
        batch = [SeqChunk([go[i][0].drafts[-1]], go[i][1] + j - 1, go[i][0].table) for i in more]
        out, tokens = _step(mtp, batch, torch.cat([rows[i] for i in more]))
        for k, i in enumerate(more):
            go[i][0].drafts.append(tokens[k])
            rows[i] = out[k : k + 1]


def _may_draft(rows: int, req: Request) -> bool:
    """Whether ``req`` can draft at a later step (``num_drafts``' rule, from its first
    token on): the catch-up is skipped for one that never will."""
    if req.grammar is not None:
        return False
    return min(rows - 1, req.max_tokens - max(req.num_output, 1) - 1) > 0


class MtpDrafts:
    """The MTP drafter (a ``kern.engine.drafters.Drafter``): catch-up and first drafts after
    each forward (:meth:`stepped`), further drafts before a verify (:meth:`run`), its pages
    from the pool or, for ``kern run``, its own (see the notes)."""

    def __init__(self, rows: int, mtp: Runner, target: Runner) -> None:
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
        num = min(num_drafts(self.rows, req), room)
        ready = self._ready.get(req)
        if num <= 0 or ready is None or ready[0] != req.num_computed:
            return None
        d = req.draft
        assert isinstance(d, MtpState)
        if d.computed != req.num_computed:
            num = 1
        d.planned = (req.num_computed, 0, num)
        return num, num

    def run(self, reqs: Sequence[Request], memory: DraftMemory) -> None:
        """The first draft, then the further ones (pages from the pool, never preempting: a
        request whose pages cannot be had, or were dropped since it was planned, verifies
        its first draft alone)."""
        go: list[tuple[DraftState, int, Tensor, int]] = []
        for req in reqs:
            d = req.draft
            assert isinstance(d, MtpState) and d.planned is not None
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

    def stepped(
        self, batch: Sequence[SeqChunk], reqs: Sequence[Request], memory: DraftMemory
    ) -> None:
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
                d = req.draft = MtpState()
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

    @classmethod
    def solo(
        cls, rows: int, runner: Runner, checkpoint: Checkpoint, num_tokens: int
    ) -> tuple[MtpDrafts, SoloMemory]:
        """``kern run``'s: the MTP layer over pages of its own, of the target's page size."""
        num_pages = cdiv(num_tokens, runner.page_tokens)
        mtp = mtp_runner(runner, checkpoint, num_pages=num_pages)
        return cls(rows, mtp, runner), SoloMemory(num_pages)


class MtpDrafting:
    """The MTP drafter as the engine sees it (a ``kern.engine.drafters.Drafting``): checked
    before anything loads, the target read with its MTP layers, their pages in the target's
    pool pages."""

    reads_mtp = True

    def __init__(self) -> None:
        self.layout: Layout | None = None
        self.runner: Runner | None = None

    def check(self, target: Target, config: ModelConfig | None = None) -> None:
        check_mtp_target(target, config or load_config(target.checkpoint))

    def prepare(self, config: ModelConfig, layout: Layout, ops: Any, target: Target) -> int:
        self.layout = mtp_layout(
            config,
            ops.dtype,
            layout.page_bytes,
            target.page_tokens,
            target.where("draft"),
            any_stride=not ops.is_cpu,
        )
        return 0

    def load(self, runner: Runner, checkpoint: Checkpoint) -> None:
        assert self.layout is not None
        self.runner = mtp_runner(runner, checkpoint, self.layout)

    def drafter(self, rows: int, runner: Runner) -> MtpDrafts:
        assert self.runner is not None
        return MtpDrafts(rows, self.runner, runner)
