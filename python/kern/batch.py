"""What one forward pass runs: a ragged batch of sequence chunks, and its index tensors.

A step is a list of :class:`SeqChunk`, one per sequence. Each chunk is the next
``len(token_ids)`` tokens of its sequence, from position ``start_pos`` on: a chunk of a prompt
after a cached prefix (``start_pos`` may fall mid-page), one decode token, or ``rows`` tokens
to verify (the last accepted token followed by the drafts). The runner writes their K/V at
their positions through ``block_table`` and reads the whole context ``[0, start_pos + n)``
back through it; a stateful model reads and writes the sequence's recurrent state in
``slot``.

:func:`build_step` turns the list into the index tensors every layer shares, once per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kern.arith import cdiv
from kern.chunk import SeqChunk


@dataclass(frozen=True, slots=True)
class Step:
    """Index tensors for one forward (built once, read by every layer). Plans are the
    backend's own index structures for attention and for the recurrent mixers."""

    token_ids: Tensor  # [T] int64
    positions: Tensor  # [T] int64
    page_ids: Tensor  # [T] int64: page each row's K/V goes to
    page_offsets: Tensor  # [T] int64: offset in that page
    slot_mapping: Tensor  # [T] int64: page * page_tokens + offset
    logit_rows: Tensor  # [N] int64: rows whose logits are returned, in order
    q_starts: list[int]
    q_lens: list[int]
    ctx_lens: list[int]
    block_tables: Tensor  # [B, max_pages] int64, zero padded
    rope: object = None
    attention: object = None
    recurrent: object = None
    # Rows a model reads beside its tokens, [T, ...] (the MTP layer: the target's hidden).
    inputs: Tensor | None = None


def validate(
    batch: Sequence[SeqChunk], page_tokens: int, num_pages: int, stateful: bool, num_slots: int
) -> None:
    """Raise ``ValueError`` naming the first chunk that cannot run."""
    if not batch:
        raise ValueError("empty batch")
    slots = set()
    for i, c in enumerate(batch):
        n = len(c.token_ids)
        if n == 0:
            raise ValueError(f"chunk {i}: no tokens")
        if c.start_pos < 0:
            raise ValueError(f"chunk {i}: start_pos {c.start_pos} < 0")
        need = cdiv(c.start_pos + n, page_tokens)
        if len(c.block_table) < need:
            raise ValueError(
                f"chunk {i}: block_table has {len(c.block_table)} pages, positions up to "
                f"{c.start_pos + n - 1} need {need}"
            )
        if any(not 0 <= p < num_pages for p in c.block_table[:need]):
            raise ValueError(f"chunk {i}: a page id is outside [0, {num_pages})")
        if c.logits not in ("last", "all", "none"):
            raise ValueError(f"chunk {i}: logits must be 'last', 'all' or 'none'")
        if stateful:
            if c.slot is None or not 0 <= c.slot < num_slots:
                raise ValueError(f"chunk {i}: a stateful model needs a slot in [0, {num_slots})")
            if c.slot in slots:
                raise ValueError(f"chunk {i}: slot {c.slot} appears twice in the batch")
            slots.add(c.slot)


def build_step(batch: Sequence[SeqChunk], page_tokens: int, device: torch.device) -> Step:
    """The shared index tensors of ``batch`` (assumed valid, see :func:`validate`)."""
    q_lens = [len(c.token_ids) for c in batch]
    q_starts = [0] * len(batch)
    total = 0
    for i, n in enumerate(q_lens):
        q_starts[i] = total
        total += n
    ctx_lens = [c.start_pos + n for c, n in zip(batch, q_lens, strict=True)]
    token_ids = torch.tensor([t for c in batch for t in c.token_ids], dtype=torch.long)
    lens = torch.tensor(q_lens)
    seq_of_row = torch.repeat_interleave(torch.arange(len(batch)), lens)
    first = torch.tensor([c.start_pos for c in batch]) - torch.tensor(q_starts)
    positions = torch.arange(total) + first[seq_of_row]
    num_pages = [cdiv(n, page_tokens) for n in ctx_lens]
    width = max(num_pages)
    tables = torch.zeros(len(batch), width, dtype=torch.long)
    used = torch.arange(width)[None, :] < torch.tensor(num_pages)[:, None]
    tables[used] = torch.tensor(
        [p for c, n in zip(batch, num_pages, strict=True) for p in c.block_table[:n]]
    )
    page_ids = tables[seq_of_row, positions // page_tokens]
    page_offsets = positions % page_tokens
    logit_rows = []
    for c, s, n in zip(batch, q_starts, q_lens, strict=True):
        if c.logits == "last":
            logit_rows.append(s + n - 1)
        elif c.logits == "all":
            logit_rows.extend(range(s, s + n))
    return Step(
        token_ids=token_ids.to(device),
        positions=positions.to(device),
        page_ids=page_ids.to(device),
        page_offsets=page_offsets.to(device),
        slot_mapping=(page_ids * page_tokens + page_offsets).to(device),
        logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=device),
        q_starts=q_starts,
        q_lens=q_lens,
        ctx_lens=ctx_lens,
        block_tables=tables,
    )
