"""The offline run behind ``kern run``: prefill a prompt, then decode, through the same
Runner and paged path the server uses, so a served answer can be compared to it byte for byte.

Design notes
------------
* One sequence in a Runner of its own: the prompt is prefilled in one chunk, then each step
  is one decode chunk (``rows == 1``) or one verify chunk of ``1 + drafts`` rows
  (``rows > 1``), drafts from n-gram lookup in the context (:class:`NgramDrafter`), from a
  draft checkpoint (``draft``, :func:`kern.engine.spec.draft_greedy`, the server's batched
  drafting, here on pages and slots of its own: the server takes them from its pool, which
  changes no token), or from the checkpoint's own MTP layer (``mtp``,
  ``kern.engine.mtp.MtpSequence``: the server's catch-up after each forward, here too).
* Verification keeps identity with ``rows == 1``: row j of a verify chunk yields the token
  plain decoding would pick at that position (same context, the sampler's draw index is the
  token's index), and drafts are accepted while they equal those tokens
  (:func:`kern.engine.spec.accept`, the server's rule). The first mismatch
  is replaced by the verified token, so each step adds 1 to ``rows`` tokens. Rejected drafts'
  K/V are overwritten when the sequence reaches their positions again; a recurrent state is
  rewound with ``Runner.keep_rows``. Identity is bitwise wherever the backend's forward is
  invariant to rows and chunking (the CPU backend, see docs/invariance.md).
* ``threads`` pins torch's intra-op thread count: float32 results can differ between 1 and 2
  threads (docs/invariance.md), so ``kern run`` and the server run the same count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from kern.arith import cdiv
from kern.backend import make_ops
from kern.checkpoint import Checkpoint
from kern.chunk import SeqChunk
from kern.engine.ngram import NgramDrafter
from kern.engine.params import SamplingParams
from kern.engine.runner import Runner
from kern.engine.sampler import Sampler, sample
from kern.engine.spec import DraftState, accept, draft_greedy

__all__ = ["GenerateResult", "NgramDrafter", "generate"]


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
    ``draft``: a draft checkpoint (checked by the caller, kern.engine.draft) drafts instead of
    n-gram lookup, greedy, on the same backend. ``mtp``: the checkpoint's own
    multi-token-prediction layer drafts (deepseek_v3, loaded with ``mtp=True``; checked by the
    caller, kern.engine.mtp), greedy.

    Raises ``ValueError`` for an empty prompt, ``steps < 0`` or ``rows < 1``.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids is empty")
    if steps < 0 or rows < 1:
        raise ValueError("steps must be >= 0 and rows >= 1")
    if threads is not None:
        torch.set_num_threads(threads)
    params = sampling or SamplingParams()
    probe_at = set(probe_steps or ())
    probes: dict[int, tuple[Tensor, Tensor]] = {}
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
    table = list(range(runner.num_pages))
    out: list[int] = []
    if steps == 0:
        return GenerateResult(out, probes)
    num_drafted = num_accepted = 0

    def pick(logits: Tensor, first: int) -> list[int]:
        n = logits.shape[0]
        toks = sample(logits, [params] * n, list(range(first, first + n)))
        for j in range(n):
            if first + j in probe_at:
                k = min(probe_k, logits.shape[1])
                values, ids = torch.topk(logits[j], k)
                probes[first + j] = (values.float().cpu(), ids.cpu())
        return toks

    mtp_seq = None
    if mtp and rows > 1:
        from kern.engine.mtp import MtpSequence

        mtp_seq = MtpSequence(runner, checkpoint, total)
    logits = runner.forward([SeqChunk(prompt_ids, 0, table, slot=0, logits="last")])
    out.extend(pick(logits, 0))
    if mtp_seq is not None and len(out) < steps - 1:  # the next step drafts
        mtp_seq.stepped(prompt_ids + out, 0, len(prompt_ids))
    drafter = NgramDrafter(prompt_ids)
    drafter.extend(out)
    # A draft checkpoint's runner over pages (and, stateful, slots 0 working, 1 saved) of its
    # own, and the sequence's draft state in it.
    model: tuple[Sampler, DraftState] | None = None
    if draft is not None and rows > 1:
        draft_runner = Runner.with_pages(
            draft,
            num_pages=cdiv(total, page_tokens),
            page_tokens=page_tokens,
            num_slots=2,
            ops=runner.ops,
        )
        state = DraftState(table=list(range(draft_runner.num_pages)))
        if draft_runner.stateful:
            state.slot, state.saved = 0, 1
        model = (Sampler(draft_runner), state)
    pos = len(prompt_ids)  # tokens in the KV; out[-1] is not yet
    while len(out) < steps:
        num = min(rows - 1, steps - len(out) - 1)
        if mtp_seq is not None:
            drafts = mtp_seq.drafts(num)
        elif model is None:
            drafts = drafter.draft(num)
        elif num > 0:
            context = prompt_ids + out
            state = model[1]
            draft_greedy(model[0], [(context, state, len(context) - state.computed, num)])
            drafts = state.drafts
        else:
            drafts = []
        chunk = [out[-1], *drafts]
        mode = "all" if rows > 1 else "last"
        logits = runner.forward([SeqChunk(chunk, pos, table, slot=0, logits=mode)])
        # Rows past the first mismatch saw a wrong context; their probes must not count.
        verified = pick(logits, len(out))
        accepted = accept(drafts, verified)
        num_drafted += len(drafts)
        num_accepted += accepted - 1
        for key in [s for s in probes if s >= len(out) + accepted]:
            del probes[key]
        if rows > 1 and runner.stateful:
            runner.keep_rows(0, accepted)
        if rows > 1 and runner.whole_page_hits:
            runner.keep_positions(table, pos, accepted)
        if model is not None and drafts:
            model[1].accepted(accepted, model[0].runner.copy_slots)
        new = verified[:accepted]
        out.extend(new)
        drafter.extend(new)
        pos += accepted
        if mtp_seq is not None and len(out) < steps - 1:
            mtp_seq.stepped(prompt_ids + out, pos - accepted, pos)
    return GenerateResult(out[:steps], probes, num_drafted, num_accepted)
