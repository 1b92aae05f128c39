"""One sequence's tokens for the next forward: the value the scheduler hands the runner.

Torch-free, so the scheduler builds steps without importing torch; :mod:`kern.batch` turns a
list of them into the index tensors every layer shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["LogitsMode", "SeqChunk"]

LogitsMode = Literal["last", "all", "none"]


@dataclass(frozen=True, slots=True)
class SeqChunk:
    """The next tokens of one sequence. A value: the runner does not keep it.

    token_ids: this call's tokens (at least one), positions ``start_pos`` onwards.
    start_pos: tokens already in the sequence's KV (and state), i.e. the cached prefix.
    block_table: page ids holding positions ``0 .. start_pos + len(token_ids) - 1``, in order
        (page ``i`` holds positions ``i * page_tokens ..``); the runner never reads past them.
    slot: the recurrent-state slot (stateful models only). A chunk with ``start_pos == 0``
        starts from a zero state: the runner clears the slot first.
    window: the window pages (a page kind with them, ``kern.models.pages``): index ``j`` holds
        positions ``j * window_tokens ..``, -1 where given back; the runner reads only those
        the chunk's rows reach. None on a runner that owns its memory: derived from
        ``block_table``.
    logits: ``"last"`` (the chunk completes a prompt or is a decode step), ``"all"`` (verify:
        one row of logits per token) or ``"none"`` (a prompt chunk with more to come). On a
        stateful model an ``"all"`` chunk also keeps the state after each of its rows until
        the next forward, so ``Runner.keep_rows`` can rewind it to an accepted prefix.
    """

    token_ids: Sequence[int]
    start_pos: int
    block_table: Sequence[int]
    slot: int | None = None
    logits: LogitsMode = "last"
    window: Sequence[int] | None = None
