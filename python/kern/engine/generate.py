"""The offline run behind ``kern run``: prefill a prompt, then decode, through the same
Runner and paged path the server uses, so a served answer can be compared to it byte for byte.

Design notes
------------
* One sequence in a Runner of its own: the prompt is prefilled in one chunk, then each step
  is one decode chunk (``rows == 1``) or one verify chunk of ``1 + drafts`` rows
  (``rows > 1``). The drafts come from the server's drafters (kern.engine.drafters: n-gram
  lookup in the context, a draft checkpoint, or the checkpoint's own MTP layer), driven the
  scheduler's way over one request (plan, run, verify, ``settle``, ``stepped``), here on
  pages and slots of their own (``SoloMemory``: the server takes them from its pool, which
  changes no token).
* Verification keeps identity with ``rows == 1``: row j of a verify chunk yields the token
  plain decoding would pick at that position (same context, the sampler's draw index is the
  token's index), and drafts are accepted while they equal those tokens
  (:func:`kern.engine.drafters.accept`, the server's rule). The first mismatch
  is replaced by the verified token, so each step adds 1 to ``rows`` tokens. Rejected drafts'
  K/V are overwritten when the sequence reaches their positions again; the state a verify
  leaves (a recurrent state, a page kind's) is rewound (``Runner.rewind``, through
  ``settle``). Identity is bitwise wherever the backend's forward is invariant to rows and
  chunking (the CPU backend, see docs/invariance.md).
* ``threads`` pins torch's intra-op thread count: float32 results can differ between 1 and 2
  threads (docs/invariance.md), so ``kern run`` and the server run the same count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from kern.arith import cdiv
from kern.backend import make_ops
from kern.checkpoint.load import Checkpoint
from kern.chunk import SeqChunk
from kern.engine.drafters import Drafter, DraftMemory, accept, settle
from kern.engine.drafters.factory import solo_drafter
from kern.engine.params import SamplingParams
from kern.engine.request import Request
from kern.engine.runner import Runner
from kern.engine.sampler import sample

__all__ = ["GenerateResult", "generate"]


@dataclass(frozen=True)
class GenerateResult:
    """ids: the generated tokens (not the prompt). probes: for each requested step s, the
    top-k logits (float32, descending) and their token ids of the distribution token s was
    drawn from."""

    ids: list[int]
    probes: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    # Drafted tokens verified, and how many of them were accepted (0 at rows 1).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


def generate(
    checkpoint: Checkpoint,
    prompt_ids: list[int],
    steps: int,
    *,
    rows: int = 1,
    sampling: SamplingParams | None = None,
    probe_steps: list[int] | None = None,
    probe_k: int = 20,
    page_tokens: int = 16,
    threads: int | None = None,
    device: str = "cpu",
    reference: bool = False,
    runner: Runner | None = None,
    draft: Checkpoint | None = None,
    mtp: bool = False,
) -> GenerateResult:
    """Generate ``steps`` tokens after ``prompt_ids`` (greedy unless ``sampling`` says
    otherwise), verifying up to ``rows - 1`` drafted tokens per step, on ``device`` (the
    checkpoint's tensors are moved there by the runner), or through the torch reference path
    (``reference=True``, CPU float32, see ``kern.backend.ReferenceOps``), or on ``runner`` when
    given (one whose pages are the sequence's own, e.g. ``kern.engine.ranks``' ranked runner).
    ``draft``: a draft checkpoint (checked by the caller, kern.engine.drafters.model) drafts
    instead of n-gram lookup, greedy, on the same backend. ``mtp``: the checkpoint's own
    multi-token-prediction layer drafts (loaded with ``mtp=True``; checked by the caller,
    kern.engine.drafters.mtp), greedy.

    Raises ``ValueError`` for an empty prompt, ``steps < 0`` or ``rows < 1``.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids is empty")
    if steps < 0 or rows < 1:
        raise ValueError("steps must be >= 0 and rows >= 1")
    if threads is not None:
        torch.set_num_threads(threads)
    total = len(prompt_ids) + steps + rows
    if runner is None:
        runner = Runner.with_pages(
            checkpoint,
            num_pages=cdiv(total, page_tokens),
            page_tokens=page_tokens,
            num_slots=1,
            ops=make_ops(device, reference=reference),
        )
    elif runner.num_pages * runner.page_tokens < total:
        raise ValueError(
            f"the runner's pages hold {runner.num_pages * runner.page_tokens} "
            f"tokens; this run needs {total}"
        )
    picker = _Picker(sampling or SamplingParams(), set(probe_steps or ()), probe_k)
    if steps == 0:
        return GenerateResult([], picker.probes)
    drafter: Drafter | None = None
    memory: DraftMemory | None = None
    if rows > 1:
        # Before the prefill: a drafter may keep the target's hidden rows (the MTP layer).
        drafter, memory = solo_drafter(rows, runner, checkpoint, total, draft=draft, mtp=mtp)
    run = _Sequence(runner, prompt_ids, steps, rows, drafter, memory, picker)
    run.prefill()
    while run.req.num_output < steps:
        run.step()
    out = run.req.tokens[len(prompt_ids) :]
    return GenerateResult(out[:steps], picker.probes, run.num_drafted, run.num_accepted)


class _Picker:
    """Turns a forward's logits rows into tokens (the sampler's draw at each token's index)
    and keeps the probed steps' top logits."""

    def __init__(self, params: SamplingParams, probe_at: set[int], probe_k: int) -> None:
        self.params = params
        self.probe_at = probe_at
        self.probe_k = probe_k
        self.probes: dict[int, tuple[Tensor, Tensor]] = {}

    def __call__(self, logits: Tensor, first: int) -> list[int]:
        """Tokens ``first, first + 1, ...`` from ``logits``' rows."""
        n = logits.shape[0]
        toks = sample(logits, [self.params] * n, list(range(first, first + n)))
        for j in range(n):
            if first + j in self.probe_at:
                k = min(self.probe_k, logits.shape[1])
                values, ids = torch.topk(logits[j], k)
                self.probes[first + j] = (values.float().cpu(), ids.cpu())
        return toks

    def forget_from(self, step: int) -> None:
        """Rows past the first mismatch of a verify saw a wrong context: their probes must
        not count."""
        for key in [s for s in self.probes if s >= step]:
            del self.probes[key]


class _Sequence:
    """The one request ``kern run`` decodes, the scheduler's way: its tokens, its pages (all
    of the runner's, slot 0), and its drafter over memory of its own."""

    def __init__(
        self,
        runner: Runner,
        prompt_ids: list[int],
        steps: int,
        rows: int,
        drafter: Drafter | None,
        memory: DraftMemory | None,
        picker: _Picker,
    ) -> None:
        self.runner = runner
        self.rows = rows
        self.drafter = drafter
        self.memory = memory
        self.pick = picker
        self.req = Request(list(prompt_ids), max_tokens=steps)
        self.req.tokens = list(prompt_ids)
        self.req.block_table = list(range(runner.num_pages))
        self.req.slot = 0
        self.num_drafted = self.num_accepted = 0

    def prefill(self) -> None:
        req = self.req
        chunk = SeqChunk(req.prompt_ids, 0, req.block_table, slot=0, logits="last")
        logits = self.runner.forward([chunk])
        req.num_computed = len(req.prompt_ids)
        self._append(self.pick(logits, 0))
        self._stepped(chunk)

    def step(self) -> None:
        """One decode (or verify) step: drafts, the forward, the accepted tokens."""
        req, drafter = self.req, self.drafter
        drafts: list[int] = []
        if drafter is not None and drafter.plan(req, len(req.tokens) + self.rows) is not None:
            assert self.memory is not None and req.draft is not None
            drafter.run([req], self.memory)
            drafts = req.draft.drafts
        pos = req.num_computed
        mode = "all" if self.rows > 1 else "last"
        chunk = SeqChunk([req.tokens[pos], *drafts], pos, req.block_table, slot=0, logits=mode)
        logits = self.runner.forward([chunk])
        verified = self.pick(logits, req.num_output)
        accepted = accept(drafts, verified)
        self.num_drafted += len(drafts)
        self.num_accepted += accepted - 1
        self.pick.forget_from(req.num_output + accepted)
        if drafter is not None:
            settle(req, accepted, accepted, self.runner, drafter)
        else:
            req.num_computed += accepted
        if req.draft is not None:
            req.draft.drafts = []
        self._append(verified[:accepted])
        self._stepped(chunk)

    def _append(self, tokens: list[int]) -> None:
        self.req.tokens.extend(tokens)
        self.req.num_output += len(tokens)

    def _stepped(self, chunk: SeqChunk) -> None:
        if self.drafter is not None:
            assert self.memory is not None
            self.drafter.stepped([chunk], [self.req], self.memory)
