"""Speculative decoding: drafts a decode step verifies, where they come from, and the one rule
that keeps a verified token.

Design notes
------------
* Speculative rows (``rows`` > 1, docs/serve.md): a decode step of a request verifies its
  last token and up to ``rows - 1`` drafts as one chunk with a row of logits each. Row j is
  sampled as plain decoding samples that position (its context with the drafts before it,
  draw index ``num_output + j``), drafts are kept while they equal those tokens
  (:func:`accept`), and the first mismatch is replaced by the row's token: the answer is the
  rows-1 answer. ``kern run`` (kern.engine.generate) and the scheduler use the same rule.
  Tokens are sent one by one up to a stop or ``max_tokens``; ``num_computed`` then moves by
  the tokens sent and a recurrent state is rewound to the row of the last one
  (``Runner.keep_rows``), so nothing rejected or unsent is ever read, and the request-end
  snapshot sits where rows 1 puts it. Drafts use only the step budget the decode rows leave,
  never past ``max_tokens``, and a request with a grammar decodes one row at a time.
* A :class:`Drafter` is the scheduler's one view of where drafts come from: it plans a
  request's drafts inside the step's room, runs what it planned, and hears what a verify
  accepted; it also hears of every forward (``stepped``), for a drafter that reads the
  target's hidden states. Three kinds: n-gram lookup in the request's own context
  (:class:`NgramDrafts`, kern.engine.ngram), a draft checkpoint (:class:`ModelDrafts`,
  kern.engine.draft) and the target's own multi-token-prediction layer
  (``kern.engine.mtp.MtpDrafts``). Per-request state is one :class:`DraftState` on
  ``Request.draft``.
* Draft checkpoints: after the step is planned, the draft model runs for the requests that
  draft: one forward of catch-up chunks (every token its KV lacks: the prompt at the first
  decode step, then what the last verify accepted, counted in the step budget with the
  drafts), then ``rows - 2`` one-row steps, batched, greedy (:func:`draft_greedy`, which
  ``kern run`` runs for its one sequence too). Its pages are pool pages
  (``DraftState.table``), taken with the same make-room calls but never by preempting
  (``Memory.take_draft_pages``): a request that cannot have them decodes one row that step.
  A target allocation that fails drops every running request's draft pages before it
  preempts anyone (``Memory.drop_drafts``), so draft memory can never deadlock the target's.
  The pages (and a stateful draft's two slots, kern.engine.draft) are freed when the request
  is released (end, abort, preemption) and never inserted into the tree. After a verify,
  ``DraftState.computed`` keeps the accepted drafts the draft itself computed (all but its
  last); a stateful draft past a rejected one is restored to its saved state instead.
* Drafting is greedy (argmax): a point-mass proposal, so accepting a draft while it equals
  the target's own draw at that row is standard speculative sampling, exact for greedy and
  sampled requests alike. A drafter only changes how many tokens a step yields, never which.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kern.arith import cdiv
from kern.chunk import SeqChunk
from kern.engine.memory import Memory
from kern.engine.ngram import NgramDrafter
from kern.engine.request import Request

if TYPE_CHECKING:
    from kern.engine.sampler import Sampler

__all__ = [
    "DraftState",
    "Drafter",
    "ModelDrafts",
    "NgramDrafts",
    "accept",
    "draft_greedy",
    "settle",
]


def accept(drafts: Sequence[int], verified: Sequence[int]) -> int:
    """The tokens a verify of ``drafts`` yields: 1 (the row after the last token) plus the
    drafts kept while each equals the token its row verified (``verified[j]`` is row j's
    token, as plain decoding draws it at that position). The first mismatch is replaced by
    its row's token, so ``verified[:accept(...)]`` are the tokens to send."""
    accepted = 1
    while accepted <= len(drafts) and drafts[accepted - 1] == verified[accepted - 1]:
        accepted += 1
    return accepted


@dataclass(eq=False, slots=True)
class DraftState:
    """One sequence's speculation: the drafts its next step verifies, the n-gram index over
    its tokens (built at its first drafting step), and a draft checkpoint's KV for it (pool
    pages of the draft's page size, ``computed`` of its tokens in them) with a stateful
    draft's slots: its working state and the state at the last accepted token kept while it
    drafts past it (kern.engine.draft)."""

    drafts: list[int] = field(default_factory=list)
    index: NgramDrafter | None = None
    table: list[int] = field(default_factory=list)
    computed: int = 0
    slot: int | None = None
    saved: int | None = None
    # What a draft checkpoint does this step: (``computed`` when planned, catch-up, drafts).
    planned: tuple[int, int, int] | None = None

    def accepted(self, accepted: int, copy_slots: CopySlots) -> None:
        """The last verify of ``drafts`` yielded ``accepted`` tokens: keep the accepted drafts
        the draft model computed (all but its last); a stateful draft past a rejected one
        goes back to its saved state and sees the accepted tokens again in its next
        catch-up."""
        num = len(self.drafts)
        kept = min(accepted - 1, num - 1)
        if self.slot is not None and kept < num - 1:
            assert self.saved is not None
            copy_slots([self.saved], [self.slot])
            kept = 0
        self.computed += kept


class Rewinder(Protocol):
    """What a verify's rewind asks of the target's runner (``kern.engine.runner.Runner``)."""

    stateful: bool
    whole_page_hits: bool

    def keep_rows(self, slot: int, num_rows: int) -> None: ...
    def keep_positions(self, block_table: Sequence[int], start_pos: int, num_rows: int) -> None: ...


def settle(req: Request, sent: int, accepted: int, runner: Rewinder, drafter: Drafter) -> None:
    """After ``req``'s verify yielded ``accepted`` tokens of which ``sent`` were sent (a stop
    or ``max_tokens`` may cut them short): the KV and state now hold the last token and the
    drafts that were sent; the rest (rejected, or accepted past a stop) is never read: the
    next chunk starts at ``num_computed`` and overwrites it, and the state is rewound to the
    row of the last token sent, exactly where rows 1 would leave it. The drafter hears what
    was accepted."""
    if runner.whole_page_hits:
        # DeepSeek-V4: the pooling state sits in the page of the last row the verify wrote.
        runner.keep_positions(req.block_table, req.num_computed, sent)
    req.num_computed += sent
    if runner.stateful:
        assert req.slot is not None
        runner.keep_rows(req.slot, sent)
    drafter.accepted(req, accepted)


class CopySlots(Protocol):
    def __call__(self, src: Sequence[int], dst: Sequence[int]) -> None: ...


# One sequence for the draft model: its tokens, its draft state, tokens of catch-up, drafts.
DraftRun = tuple[Sequence[int], DraftState, int, int]


def draft_greedy(sampler: Sampler, go: Sequence[DraftRun]) -> None:
    """Run a draft model (``sampler``'s runner) for ``go``: (a sequence's tokens, its draft
    state, tokens of catch-up, drafts). One forward of catch-up chunks, then one 1-row step
    per further draft, batched across sequences; sets each state's ``drafts`` (greedy) and
    moves its ``computed`` past the catch-up. Mutates the draft's pages and slots."""
    draft = sampler.runner
    batch = [
        SeqChunk(
            tokens[d.computed : d.computed + catch],
            d.computed,
            d.table,
            slot=d.slot,
            logits="last" if num else "none",
        )
        for tokens, d, catch, num in go
    ]
    picked = sampler.greedy(batch)
    drafting: list[tuple[DraftState, int]] = []
    for _, d, catch, num in go:
        d.computed += catch
        if num:
            d.drafts = [picked[len(drafting)]]
            drafting.append((d, num))
    if draft.stateful:
        # The state at the last accepted token, restored if a verify rejects a draft the
        # draft computed past it (DraftState.accepted).
        saved = [(d.slot, d.saved) for d, num in drafting if num > 1]
        draft.copy_slots([s for s, _ in saved], [t for _, t in saved])
    for j in range(1, max((num for _, num in drafting), default=0)):
        more = [d for d, num in drafting if num > j]
        batch = [SeqChunk([d.drafts[-1]], d.computed + j - 1, d.table, d.slot) for d in more]
        for d, tok in zip(more, sampler.greedy(batch), strict=True):
            d.drafts.append(tok)


class Drafter(Protocol):
    """Where a scheduler's drafts come from (see the design notes)."""

    # Positions a decode step verifies per sequence: 1 + up to rows - 1 drafts.
    rows: int

    def plan(self, req: Request, room: int) -> tuple[int, int] | None:
        """Plan ``req``'s drafts for this decode step within ``room`` tokens of the step's
        budget: (budget it takes, drafts it adds to the chunk), or None for none."""
        ...

    def run(self, reqs: Sequence[Request], memory: Memory) -> None:
        """Draft for ``reqs`` (planned this step and still running): set each one's
        ``draft.drafts``, taking what it needs from ``memory``."""
        ...

    def accepted(self, req: Request, accepted: int) -> None:
        """``req``'s verify of its drafts yielded ``accepted`` tokens (:func:`accept`)."""
        ...

    def stepped(self, batch: Sequence[SeqChunk], reqs: Sequence[Request], memory: Memory) -> None:
        """The step's forward ran ``batch`` (``reqs[i]`` ran ``batch[i]``), its tokens are
        appended and its verifies settled."""
        ...


def _num_drafts(rows: int, req: Request) -> int:
    """Drafts ``req`` may verify at most: none past ``max_tokens`` (nothing past it is ever
    computed), none before its first token, none with a grammar (whose matcher the drafts
    would have to advance: it decodes one row at a time)."""
    if req.num_output == 0 or req.grammar is not None:
        return 0
    return min(rows - 1, req.max_tokens - req.num_output - 1)


class NgramDrafts:
    """Drafts from n-gram lookup in each request's own context (kern.engine.ngram), planned
    at once: no model, no memory."""

    def __init__(self, rows: int) -> None:
        if rows < 2:
            raise ValueError(f"speculation needs rows >= 2, got {rows}")
        self.rows = rows

    def plan(self, req: Request, room: int) -> tuple[int, int] | None:
        """Up to ``rows - 1`` drafts, fewer than ``room`` (what the step's budget leaves)."""
        k = min(_num_drafts(self.rows, req), room)
        if k <= 0:
            return None
        d = req.draft
        if d is None:
            d = req.draft = DraftState()
        if d.index is None:
            d.index = NgramDrafter(req.tokens)
        else:
            d.index.sync(req.tokens)
        d.drafts = d.index.draft(k)
        return len(d.drafts), len(d.drafts)

    def run(self, reqs: Sequence[Request], memory: Memory) -> None:
        pass  # drafted when planned

    def accepted(self, req: Request, accepted: int) -> None:
        pass  # the index catches up with the tokens at the next plan

    def stepped(self, batch: Sequence[SeqChunk], reqs: Sequence[Request], memory: Memory) -> None:
        pass


class ModelDrafts:
    """Drafts from a draft checkpoint (``sampler``'s runner, over the pool's pages), run for
    every drafting request at once after the step is planned."""

    def __init__(self, rows: int, sampler: Sampler) -> None:
        if rows < 2:
            raise ValueError(f"speculation needs rows >= 2, got {rows}")
        self.rows = rows
        self.sampler = sampler

    def plan(self, req: Request, room: int) -> tuple[int, int] | None:
        """The catch-up (every token the draft has not seen: the prompt at its first decode
        step, then what the last verify accepted) counts against ``room`` with the drafts; a
        catch-up longer than the room is done in part, drafting nothing, as a prompt is
        chunked."""
        num = _num_drafts(self.rows, req)
        if num <= 0 or room <= 0:
            return None
        d = req.draft
        if d is None:
            d = req.draft = DraftState()
        catch = len(req.tokens) - d.computed
        if catch + num > room:
            num = room - catch if catch < room else 0
            catch = min(catch, room)
        d.planned = (d.computed, catch, num)
        return catch + num, num

    def run(self, reqs: Sequence[Request], memory: Memory) -> None:
        """Take the draft's pages from the pool (making room, never preempting: a request
        whose pages cannot be had, or whose draft KV was dropped since it was planned,
        decodes one row this step), then draft (:func:`draft_greedy`)."""
        draft = self.sampler.runner
        dpt = draft.page_tokens
        go: list[DraftRun] = []
        for req in reqs:
            d = req.draft
            assert d is not None and d.planned is not None
            computed, catch, num = d.planned
            d.planned = None
            if d.computed != computed:
                continue  # dropped for a target page since planned
            end = computed + catch + max(num - 1, 0)  # positions the draft writes
            need = cdiv(end, dpt) - len(d.table)
            if need > 0:
                pages = memory.take_draft_pages(need)
                if pages is None:
                    continue
                d.table.extend(pages)
            if draft.stateful:
                if d.slot is None:
                    d.slot = memory.take_draft_slot()
                    if d.slot is None:
                        continue
                if num > 1 and d.saved is None:
                    d.saved = memory.take_draft_slot()
                    if d.saved is None:
                        num = 1  # one draft needs no rollback
            go.append((req.tokens, d, catch, num))
        if go:
            draft_greedy(self.sampler, go)

    def accepted(self, req: Request, accepted: int) -> None:
        assert req.draft is not None
        req.draft.accepted(accepted, self.sampler.runner.copy_slots)

    def stepped(self, batch: Sequence[SeqChunk], reqs: Sequence[Request], memory: Memory) -> None:
        pass  # catches up from the tokens when it next drafts
