"""What the app submits to the engine: a :class:`Request`, the :data:`Event` stream it gets
back, and the :class:`LimitError` a request that can never fit is refused with; and the
:class:`DraftState` speculation keeps on it.

Torch-free: the app and the scheduler share these values, and none of them holds a tensor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kern.chunk import SeqChunk
from kern.engine.params import Context, LogprobEntry, Pick, SamplingParams

__all__ = ["DraftState", "Event", "LimitError", "Request"]

log = logging.getLogger("kern")

# An event for one request: (token id or None, logprob entry or None, finish reason or None).
Event = tuple[int | None, LogprobEntry | None, str | None]


class LimitError(ValueError):
    """A request that can never fit: its message names the limit (the app answers 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(eq=False, slots=True)
class DraftState:
    """One request's speculation, the part the scheduler and memory read: the drafts its
    next verify checks, and the pool memory its drafter holds for it (``table``: pages of the
    drafter's page size, ``computed`` of its tokens in them; a stateful draft's working
    ``slot`` and the ``saved`` state at the last accepted token). Private to the request,
    never in the prefix tree. A drafter keeps what else it needs in a subclass
    (kern.engine.drafters)."""

    drafts: list[int] = field(default_factory=list)
    table: list[int] = field(default_factory=list)
    computed: int = 0
    slot: int | None = None
    saved: int | None = None

    def holds_memory(self) -> bool:
        """Whether it holds pool pages or slots."""
        return bool(self.table) or self.slot is not None


# weakref_slot: the runner side keys the request's token log weakly on it (kern.engine.sampler).
@dataclass(eq=False, slots=True, weakref_slot=True)
class Request:
    """One sequence to generate. The app builds it; after ``submit`` only the scheduler
    thread mutates it, except ``aborted`` and ``end_reason`` (set by ``Scheduler.abort``)."""

    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams = SamplingParams()
    stop_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    num_logprobs: int | None = None
    # End of sequence and stop ids are banned until this many tokens are out.
    min_tokens: int = 0
    # Structured output: a matcher the sampler masks with and this thread feeds each token
    # (kern.engine.masks.Matcher; opaque here).
    grammar: Any = None
    # False for the 2nd..nth sequence of a request of n choices: its prompt counts once (in
    # the prompt and prefix-cache metrics).
    counts_prompt: bool = True
    # Admission order: lower first, equal ones in arrival order (vLLM's ``priority``); the
    # highest is preempted first.
    priority: int = 0
    # Opaque to the scheduler: where the app routes this request's events.
    sink: Any = None
    index: int = 0
    tokens: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_output: int = 0
    block_table: list[int] = field(default_factory=list)
    node: int | None = None
    slot: int | None = None
    # Window pages by index (a page kind with them: kern.models.window), -1 where given back;
    # None on other models.
    window: list[int] | None = None
    # Window pages it keeps for its next rows (with the held ones, always RESERVE of them).
    window_spare: list[int] = field(default_factory=list)
    cached_tokens: int | None = None
    finish_reason: str | None = None
    aborted: bool = False
    # The finish reason an abort ends it with: "stop" when the app matched a stop string.
    end_reason: str = "abort"
    order: int = 0
    # The prompt-end snapshot (stateful models) is taken or not needed.
    prompt_snapshot_done: bool = False
    # Speculative decoding's state for this request (its drafter's, kern.engine.drafters),
    # made at its first decode step when the scheduler has a drafter; None otherwise.
    draft: DraftState | None = None
    # perf_counter() seconds: submitted, first admitted, first and latest token (0: not yet).
    t_submit: float = 0.0
    t_admit: float = 0.0
    t_first: float = 0.0
    t_last: float = 0.0

    def next_chunk(self, k: int, eos: frozenset[int]) -> tuple[SeqChunk, list[Pick]]:
        """The chunk of this request's next ``k`` rows and how each of its logits rows
        becomes a token: a verify (the last token, then the drafts; a row each) while it has
        drafts, else the next ``k`` tokens (the last's row when they end the prompt)."""
        nc = self.num_computed
        drafts = [] if self.draft is None else self.draft.drafts
        table, slot, window = self.block_table, self.slot, self.window
        if drafts:
            chunk = [self.tokens[nc], *drafts]
            verify = SeqChunk(chunk, nc, table, slot=slot, logits="all", window=window)
            return verify, [self.pick(drafts[:j], eos) for j in range(k)]
        done = nc + k == len(self.tokens)
        tokens = self.tokens[nc : nc + k]
        logits = "last" if done else "none"
        chunk = SeqChunk(tokens, nc, table, slot=slot, logits=logits, window=window)
        return chunk, [self.pick([], eos)] if done else []

    def pick(self, drafts: list[int], eos: frozenset[int]) -> Pick:
        """How the logits row of the next token after ``drafts`` (a verify row's: the drafts
        before it, as if accepted) becomes a token: as plain decoding draws it at that
        position (kern.engine.drafters). ``eos``: the model's end-of-sequence ids."""
        context = self._context(drafts, eos)
        # A row behind drafts sees a new list, converted whole; otherwise the runner side
        # keeps this request's token log across steps.
        owner = None if drafts else self
        return Pick(self.params, self.num_output + len(drafts), context, self.num_logprobs, owner)

    def _context(self, drafts: list[int], eos: frozenset[int]) -> Context | None:
        banned: frozenset[int] = frozenset()
        if self.num_output + len(drafts) < self.min_tokens:
            banned = self.stop_ids | eos
        if not banned and not self.params.processes and self.grammar is None:
            return None
        if drafts:
            return Context(self.tokens + drafts, len(self.prompt_ids), banned, self.grammar)
        return Context(self.tokens, len(self.prompt_ids), banned, self.grammar)

    def append(self, tok: int, eos: frozenset[int]) -> str | None:
        """Add a produced token (scheduler thread) and feed the grammar; the finish reason it
        brings (``stop``, ``length``, ``abort`` for a grammar that refuses it), or None."""
        self.tokens.append(tok)
        self.num_output += 1
        if self.grammar is not None and not self.grammar.accept(tok):
            # The mask allowed only what the grammar accepts: a refusal is a bug.
            log.error("the structured-output grammar refused token %d; ending", tok)
            return "abort"
        if tok in self.stop_ids or (tok in eos and not self.ignore_eos):
            return "stop"
        if self.num_output >= self.max_tokens:
            return "length"
        return None
