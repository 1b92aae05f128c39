"""``kern.batch``: the step's index tensors against a row-by-row statement of what they mean,
on random ragged batches (prompt chunks after a cached prefix, decode rows, verify chunks,
every ``logits`` kind), and ``validate``'s refusals."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kern.batch import build_step, validate
from kern.chunk import SeqChunk

PAGE = 4


@st.composite
def batches(draw) -> list[SeqChunk]:
    out = []
    for _ in range(draw(st.integers(1, 6))):
        n = draw(st.sampled_from([1, 1, 2, 3, 9]))
        start = draw(st.integers(0, 30))
        need = -(-(start + n) // PAGE)
        pages = draw(st.lists(st.integers(0, 99), min_size=need, max_size=need + 2, unique=True))
        tokens = draw(st.lists(st.integers(0, 511), min_size=n, max_size=n))
        logits = draw(st.sampled_from(["last", "all", "none"]))
        out.append(SeqChunk(tokens, start, pages, logits=logits))
    return out


@settings(max_examples=200, deadline=None)
@given(batches())
def test_the_step_is_what_each_row_means(batch):
    step = build_step(batch, PAGE, torch.device("cpu"))
    rows = [(c, c.start_pos + j) for c in batch for j in range(len(c.token_ids))]
    assert step.token_ids.tolist() == [t for c in batch for t in c.token_ids]
    assert step.positions.tolist() == [pos for _, pos in rows]
    assert step.page_ids.tolist() == [c.block_table[pos // PAGE] for c, pos in rows]
    assert step.page_offsets.tolist() == [pos % PAGE for _, pos in rows]
    slots = [c.block_table[pos // PAGE] * PAGE + pos % PAGE for c, pos in rows]
    assert step.slot_mapping.tolist() == slots
    starts = [sum(len(c.token_ids) for c in batch[:i]) for i in range(len(batch))]
    assert step.q_starts == starts and step.q_lens == [len(c.token_ids) for c in batch]
    assert step.ctx_lens == [c.start_pos + len(c.token_ids) for c in batch]
    want_logits = []
    for c, s in zip(batch, starts, strict=True):
        n = len(c.token_ids)
        want_logits += {"last": [s + n - 1], "all": list(range(s, s + n)), "none": []}[c.logits]
    assert step.logit_rows.tolist() == want_logits
    width = max(-(-n // PAGE) for n in step.ctx_lens)
    assert step.block_tables.shape == (len(batch), width)
    for row, c, n in zip(step.block_tables.tolist(), batch, step.ctx_lens, strict=True):
        k = -(-n // PAGE)
        assert row == list(c.block_table[:k]) + [0] * (width - k)
    for t in (step.token_ids, step.positions, step.slot_mapping, step.block_tables):
        assert t.dtype == torch.long
    assert all(type(v) is int for v in step.q_starts + step.ctx_lens)


@pytest.mark.parametrize(
    ("chunk", "message"),
    [
        (SeqChunk([], 0, [0]), "chunk 0: no tokens"),
        (SeqChunk([1], -1, [0]), "start_pos -1 < 0"),
        (SeqChunk([1, 2], 3, [0]), "block_table has 1 pages, positions up to 4 need 2"),
        (SeqChunk([1], 0, [10]), r"a page id is outside \[0, 10\)"),
        (SeqChunk([1], 0, [-1]), r"a page id is outside \[0, 10\)"),
        (SeqChunk([1], 0, [0], logits="some"), "logits must be"),
    ],
)
def test_validate_names_what_cannot_run(chunk, message):
    with pytest.raises(ValueError, match=message):
        validate([chunk], PAGE, 10, False, 0)
    validate([SeqChunk([1], 0, [9, 11])], PAGE, 10, False, 0)  # a page past the need: unread
