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
from dataclasses import dataclass, replace

import numpy as np
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
    # The step as layers that keep their K/V in window pages see it (their slots, tables and
    # attention plan: ``Pages.window_step``); None without such layers.
    window: Step | None = None


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
        # min and max run in C: a 2k-token context is 128 pages, 64 of them 8k per step
        pages = c.block_table[:need]
        if min(pages) < 0 or max(pages) >= num_pages:
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
    """The shared index tensors of ``batch`` (assumed valid, see :func:`validate`). The index
    arithmetic runs in numpy (a small array op is a microsecond there, several in torch), and
    each table row is filled from its chunk's list in one assignment."""
    n = len(batch)
    q_lens = [len(c.token_ids) for c in batch]
    lens = np.array(q_lens, dtype=np.int64)
    starts = np.array([c.start_pos for c in batch], dtype=np.int64)
    q_starts_np = np.cumsum(lens) - lens
    ctx = starts + lens
    total = int(q_starts_np[-1] + lens[-1])
    if total == n:  # a decode batch: one row a sequence
        seq_of_row = np.arange(n)
        positions = starts
        tokens = [c.token_ids[0] for c in batch]
    else:
        seq_of_row = np.repeat(np.arange(n), lens)
        positions = np.arange(total, dtype=np.int64) + (starts - q_starts_np)[seq_of_row]
        tokens = [t for c in batch for t in c.token_ids]
    num_pages = (ctx + page_tokens - 1) // page_tokens
    tables = np.zeros((n, int(num_pages.max())), dtype=np.int64)
    for row, c, k in zip(tables, batch, num_pages.tolist(), strict=True):
        row[:k] = c.block_table[:k]
    page_ids = tables[seq_of_row, positions // page_tokens]
    page_offsets = positions % page_tokens
    logit_rows = []
    q_starts = q_starts_np.tolist()
    for c, s, k in zip(batch, q_starts, q_lens, strict=True):
        if c.logits == "last":
            logit_rows.append(s + k - 1)
        elif c.logits == "all":
            logit_rows.extend(range(s, s + k))

    def on_device(a: np.ndarray) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    return Step(
        token_ids=torch.tensor(tokens, dtype=torch.long, device=device),
        positions=on_device(positions),
        page_ids=on_device(page_ids),
        page_offsets=on_device(page_offsets),
        slot_mapping=on_device(page_ids * page_tokens + page_offsets),
        logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=device),
        q_starts=q_starts,
        q_lens=q_lens,
        ctx_lens=ctx.tolist(),
        block_tables=torch.from_numpy(tables),
    )


def window_step(step: Step, batch: Sequence[SeqChunk], window: int) -> Step:
    """``step`` (of ``batch``, each chunk with its window table) as layers that keep their
    K/V in window pages of ``window`` positions see it: each row's slot in its window page
    (``page_ids``, ``page_offsets``, ``slot_mapping``) and each chunk's table of window pages,
    -1 before the ones its rows read (``block_tables``), so no kernel reads a window page the
    sequence has given back. Built on the host from the chunks (no device read)."""
    # The step's host lists, as build_step made them: no second pass over the chunks' tokens.
    lens = np.array(step.q_lens, dtype=np.int64)
    ends = np.array(step.ctx_lens, dtype=np.int64)
    starts = ends - lens
    tables = np.full((len(batch), cdiv(int(ends.max()), window)), -1, dtype=np.int64)
    for row, c, s, e in zip(tables, batch, starts.tolist(), step.ctx_lens, strict=True):
        assert c.window is not None
        first = max(0, s - window + 1) // window  # kern.models.window.window_span
        last = cdiv(e, window)
        row[first:last] = c.window[first:last]
    seq_of_row = np.repeat(np.arange(len(batch)), lens)
    offset = starts - np.array(step.q_starts, dtype=np.int64)
    positions = np.arange(int(lens.sum()), dtype=np.int64) + offset[seq_of_row]
    page_ids = tables[seq_of_row, positions // window]
    offsets = positions % window
    dev = step.page_ids.device

    def on_device(a: np.ndarray) -> Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

    return replace(
        step,
        page_ids=on_device(page_ids),
        page_offsets=on_device(offsets),
        slot_mapping=on_device(page_ids * window + offsets),
        block_tables=torch.from_numpy(tables),
        rope=None,
        attention=None,
        recurrent=None,
        inputs=None,
        window=None,
    )
