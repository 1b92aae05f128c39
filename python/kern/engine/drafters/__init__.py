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
  (``Runner.rewind``), so nothing rejected or unsent is ever read, and the request-end
  snapshot sits where rows 1 puts it. Drafts use only the step budget the decode rows leave,
  never past ``max_tokens``, and a request with a grammar decodes one row at a time.
* A :class:`Drafter` is the one view of where drafts come from, for the scheduler and for
  ``kern run`` (kern.engine.generate, one sequence over memory of its own) alike: it plans a
  request's drafts inside the step's room, runs what it planned, and hears what a verify
  accepted; it also hears of every forward (``stepped``), for a drafter that reads the
  target's hidden states. One module per drafter: n-gram lookup in the request's own context
  (``ngram``), a draft checkpoint (``model``) and the target's own multi-token-prediction
  layer (``mtp``); each also has a :class:`Drafting`, what the engine asks of it before and
  after the load, and ``factory.drafting`` picks one. A drafter that runs a model runs it
  through ``kern.engine.runner.Runner``, over the target's arena (the server) or an arena of
  its own (``kern run``). Per-request state is a ``kern.engine.request.DraftState`` (the
  drafts and the pool memory the drafter holds; each drafter subclasses it for the rest) on
  ``Request.draft``.
* Draft checkpoints: after the step is planned, the draft model runs for the requests that
  draft: one forward of catch-up chunks (every token its KV lacks: the prompt at the first
  decode step, then what the last verify accepted, counted in the step budget with the
  drafts), then ``rows - 2`` one-row steps, batched, greedy (``model.draft_greedy``, which
  ``kern run`` runs for its one sequence too). Its pages are pool pages
  (``DraftState.table``), taken with the same make-room calls but never by preempting
  (``Memory.take_draft_pages``): a request that cannot have them decodes one row that step.
  A target allocation that fails drops every running request's draft pages before it
  preempts anyone (``Memory.drop_drafts``), so draft memory can never deadlock the target's.
  The pages (and a stateful draft's two slots, ``model``) are freed when the request
  is released (end, abort, preemption) and never inserted into the tree. After a verify,
  ``DraftState.computed`` keeps the accepted drafts the draft itself computed (all but its
  last); a stateful draft past a rejected one is restored to its saved state instead.
* Drafting is greedy (argmax): a point-mass proposal, so accepting a draft while it equals
  the target's own draw at that row is standard speculative sampling, exact for greedy and
  sampled requests alike. A drafter only changes how many tokens a step yields, never which.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kern.chunk import SeqChunk
from kern.engine.request import Request

if TYPE_CHECKING:
    from kern.kern_toml import Target
    from kern.models.config import ModelConfig

__all__ = [
    "DraftMemory",
    "Drafter",
    "Drafting",
    "Rewinder",
    "SoloMemory",
    "accept",
    "num_drafts",
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


class Rewinder(Protocol):
    """What a verify's rewind asks of the target's runner (``kern.engine.runner.Runner``)."""

    def rewind(
        self, block_table: Sequence[int], start_pos: int, slot: int | None, num_rows: int
    ) -> None: ...


def settle(req: Request, sent: int, accepted: int, runner: Rewinder, drafter: Drafter) -> None:
    """After ``req``'s verify yielded ``accepted`` tokens of which ``sent`` were sent (a stop
    or ``max_tokens`` may cut them short): the KV and state now hold the last token and the
    drafts that were sent; the rest (rejected, or accepted past a stop) is never read: the
    next chunk starts at ``num_computed`` and overwrites it, and the pages' and the slot's
    state is rewound to the row of the last token sent, exactly where rows 1 would leave it.
    The drafter hears what was accepted."""
    runner.rewind(req.block_table, req.num_computed, req.slot, sent, req.window)
    req.num_computed += sent
    drafter.accepted(req, accepted)


class DraftMemory(Protocol):
    """Where a drafter takes the pages and slots it holds for a request: the pool's
    (``kern.engine.memory.Memory``) or one sequence's own (``kern run``)."""

    def take_draft_pages(self, n: int) -> list[int] | None: ...
    def take_draft_slot(self) -> int | None: ...
    def free_draft(self, req: Request) -> None: ...


class SoloMemory:
    """``kern run``'s draft memory: its one sequence's drafter takes pages ``0 ..
    num_pages - 1`` and slots ``0 .. num_slots - 1`` of an arena of its own, lowest first
    (the server's drafters take the pool's, through ``kern.engine.memory.Memory``)."""

    def __init__(self, num_pages: int = 0, num_slots: int = 0) -> None:
        self._pages = list(range(num_pages))
        self._slots = list(range(num_slots))

    def take_draft_pages(self, n: int) -> list[int] | None:
        if n <= 0:
            return []
        if n > len(self._pages):
            return None
        taken, self._pages = self._pages[:n], self._pages[n:]
        return taken

    def take_draft_slot(self) -> int | None:
        return self._slots.pop(0) if self._slots else None

    def free_draft(self, req: Request) -> None:
        d = req.draft
        if d is None:
            return
        self._pages = sorted(self._pages + d.table)
        self._slots = sorted(self._slots + [s for s in (d.slot, d.saved) if s is not None])
        d.table = []
        d.computed = 0
        d.slot = d.saved = None


class Drafter(Protocol):
    """Where a scheduler's (or ``kern run``'s) drafts come from (see the design notes)."""

    # Positions a decode step verifies per sequence: 1 + up to rows - 1 drafts.
    rows: int

    def plan(self, req: Request, room: int) -> tuple[int, int] | None:
        """Plan ``req``'s drafts for this decode step within ``room`` tokens of the step's
        budget: (budget it takes, drafts it adds to the chunk), or None for none."""
        ...

    def run(self, reqs: Sequence[Request], memory: DraftMemory) -> None:
        """Draft for ``reqs`` (planned this step and still running): set each one's
        ``draft.drafts``, taking what it needs from ``memory``."""
        ...

    def accepted(self, req: Request, accepted: int) -> None:
        """``req``'s verify of its drafts yielded ``accepted`` tokens (:func:`accept`)."""
        ...

    def stepped(
        self, batch: Sequence[SeqChunk], reqs: Sequence[Request], memory: DraftMemory
    ) -> None:
        """The step's forward ran ``batch`` (``reqs[i]`` ran ``batch[i]``), its tokens are
        appended and its verifies settled."""
        ...


class Drafting(Protocol):
    """One drafter as the engine sees it, before there is a scheduler: what it refuses
    before anything loads, what it adds to the pool's sizes, what it loads beside the
    target, and the :class:`Drafter` it makes for a scheduler or for ``kern run``. Objects
    from torch-side modules: the arguments are typed loosely here."""

    # The target's checkpoint is read with its multi-token-prediction layers.
    reads_mtp: bool

    def check(self, target: Target, config: ModelConfig | None = None) -> None:
        """Refuse (``UsageError``, naming the key) what cannot run; ``config`` is the target
        checkpoint's (read from it when None)."""
        ...

    def prepare(self, config: ModelConfig, layout: object, ops: object, target: Target) -> int:
        """Size what the drafter needs in the target's pool pages; the slot bytes its state
        needs (0: none)."""
        ...

    def load(self, runner: object, checkpoint: object) -> None:
        """Load what the drafter runs, over ``runner``'s arena (the target's, loaded)."""
        ...

    def drafter(self, rows: int, runner: object) -> Drafter:
        """A drafter for one scheduler over ``runner`` (the target's)."""
        ...


def num_drafts(rows: int, req: Request) -> int:
    """Drafts ``req`` may verify at most: none past ``max_tokens`` (nothing past it is ever
    computed), none before its first token, none with a grammar (whose matcher the drafts
    would have to advance: it decodes one row at a time)."""
    if req.num_output == 0 or req.grammar is not None:
        return 0
    return min(rows - 1, req.max_tokens - req.num_output - 1)
