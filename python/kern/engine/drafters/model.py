"""Draft checkpoints: a small model of the same tokenizer that proposes the tokens a
speculative decode step verifies (``draft = "path"`` in kern.toml).

Design notes
------------
* Checked before anything loads (:func:`check_draft`): the same tokenizer (vocabulary,
  merges, special tokens, end-of-sequence and begin ids; a different one names both
  ``tokenizer.json`` files), the same ``vocab_size``, and what kern cannot honour is refused by
  name: a draft whose per-token KV does not fit the target's page (see below).
* Memory: the draft has no budget of its own. In the server its KV pages are pool pages,
  taken per request with the same make-room and allocation calls as the target's
  (kern.engine.memory), freed at request end, abort and preemption, never given to the
  prefix tree. One pool page holds one draft page: the draft's ``page_tokens`` is the
  target's times ``m``, the largest power of two (the CPU attention tiles power-of-two
  pages) whose draft page fits the pool page (:func:`draft_layout`), so a 2-layer draft of a
  24-layer target's width puts 8x the tokens in a page and pays 1/12 of the target's KV per
  token, rounded up to a page. A stateful draft (``qwen3_5``) takes its slots from the pool
  too: the engine sizes the pool's slots for the larger of the two states, so a stateless
  target with a stateful draft gets a slot class it would not otherwise have.
* A stateful draft's rollback: its one-row draft steps move the state past what the target
  may accept, and ``keep_rows`` only rewinds within one forward. So the state after the
  catch-up (the last accepted position) is copied to a second slot before drafting; when a
  verify rejects a draft the draft itself computed, that copy is restored and the accepted
  tokens are fed again in the next catch-up (recompute, at most ``rows - 1`` tokens). Cost:
  two pool slots per drafting request, held until it ends, and a slot copy a round; the
  per-row states ``keep_rows`` keeps would need every draft step in one forward, which a
  draft that feeds on its own output cannot do.
* How a draft model drafts (greedy, batched, a catch-up chunk of every accepted token, then
  one-row steps): :func:`draft_greedy`, run by :class:`ModelDrafts` for the server and for
  ``kern run`` alike (its one sequence over pages and slots of its own). A draft's pages hold
  its own KV rows, so a family whose page kind holds something else (DeepSeek-V4's
  compressed pages) can neither be one nor be drafted for by one (its registry row).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kern.arith import cdiv
from kern.checkpoint.config import load_config
from kern.checkpoint.load import Checkpoint, eos_token_ids, load_checkpoint
from kern.chunk import SeqChunk
from kern.engine.drafters import DraftMemory, SoloMemory, num_drafts
from kern.engine.layout import Layout
from kern.engine.request import DraftState, Request
from kern.engine.runner import Runner
from kern.engine.sampler import Sampler
from kern.errors import UsageError
from kern.kern_toml import Target
from kern.models import registry
from kern.models.config import ModelConfig
from kern.tokenizer import Tokenizer

__all__ = [
    "CheckpointDrafting",
    "ModelDrafts",
    "ModelState",
    "check_draft",
    "check_draft_target",
    "draft_greedy",
    "draft_layout",
]


def check_draft(target_dir: Path, draft_dir: Path, where: str) -> ModelConfig:
    """Refuse a draft checkpoint kern cannot run beside the target (see the design notes);
    returns its config. ``where`` names the key or flag that set it. Raises
    :class:`UsageError`."""
    draft_dir = Path(draft_dir)
    if not draft_dir.is_dir():
        raise UsageError(f"{where}: draft = {str(draft_dir)!r}: no such checkpoint folder")
    try:
        config = load_config(draft_dir)
    except (OSError, ValueError) as e:
        raise UsageError(f"{where}: draft checkpoint {draft_dir}: {e}") from None
    target = load_config(target_dir)
    if config.vocab_size != target.vocab_size:
        raise UsageError(
            f"{where}: the draft {draft_dir} has vocab_size {config.vocab_size}, the target "
            f"{target_dir} {target.vocab_size}: a draft must share the target's vocabulary"
        )
    mine, theirs = _tokenizer(target_dir), _tokenizer(draft_dir)
    if mine != theirs:
        what = next(k for k in mine if mine[k] != theirs.get(k))
        raise UsageError(
            f"{where}: the draft's tokenizer differs from the target's ({what}): "
            f"{target_dir / 'tokenizer.json'} vs {draft_dir / 'tokenizer.json'}"
        )
    return config


def check_draft_target(target: Target, config: ModelConfig) -> None:
    """A target's draft checkpoint: one rank only, and what :func:`check_draft` and
    :func:`draft_layout` check (the tokenizer, the family, its KV inside the target's page of
    ``config``). Run by ``kern.engine.targets.check_target`` before anything loads, and by the
    engine for the callers that build it without that check. Raises :class:`UsageError`."""
    where = target.where("draft")
    if target.ranks != 1:
        raise UsageError(
            f"{where}: a draft checkpoint with ranks = {target.ranks} is not supported (the "
            "draft would need splitting too); use draft = 'ngram' or ranks = 1"
        )
    assert target.draft_checkpoint is not None
    if not registry.of(config).draft_checkpoints:
        # Its pages (its page kind's) are not laid out in other families' KV rows; its
        # speculative rows draft by n-gram lookup.
        raise UsageError(
            f"{where}: a draft checkpoint for a {config.model_type} target is not supported "
            "(draft with draft = 'ngram', the default at rows above 1)"
        )
    draft = check_draft(target.checkpoint, target.draft_checkpoint, where)
    dtype = getattr(torch, target.dtype)
    page_bytes = Layout.of(config, dtype, target.page_tokens).page_bytes
    draft_layout(draft, dtype, page_bytes, target.page_tokens, where)


def _tokenizer(folder: Path) -> dict[str, object]:
    """What must be equal for two checkpoints to share token ids."""
    config = load_config(folder)
    tok = Tokenizer.from_dir(folder, extra_eos_token_ids=eos_token_ids(folder, config))
    raw = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    return {
        "vocabulary": tok.backend.get_vocab(with_added_tokens=True),
        "merges": raw.get("model", {}).get("merges"),
        "special tokens": tok.special_tokens,
        "end-of-sequence ids": tok.eos_token_ids,
        "begin id": tok.bos_token_id,
    }


def draft_layout(
    config: ModelConfig,
    dtype: torch.dtype,
    pool_page_bytes: int,
    page_tokens: int,
    where: str,
    *,
    any_stride: bool = False,
) -> Layout:
    """The draft's layout inside pool pages of ``pool_page_bytes`` (the target's pages of
    ``page_tokens`` tokens): ``page_tokens * m`` tokens a page, ``m`` the largest power of two
    that fits (see the design notes). Raises :class:`UsageError` when not even ``m = 1``
    fits, or when the CPU attention could not address a draft page inside a pool page.
    ``any_stride``: latent pages on a backend that reads them at any stride (CUDA's): only
    the bytes must fit."""
    if not registry.of(config).draft_checkpoints:
        # Its pages' state would need the verify's rewind (Runner.rewind) per draft.
        raise UsageError(
            f"{where}: a {config.model_type} draft checkpoint is not supported (draft with "
            "draft = 'ngram')"
        )
    itemsize = torch.empty((), dtype=dtype).element_size()
    m, best = 1, None
    while True:
        layout = Layout.of(config, dtype, page_tokens * m)
        if layout.page_bytes > pool_page_bytes:
            break
        # The attention addresses a draft page in units its page kind says
        # (PageKind.draft_unit): the pool page must be a whole number of them.
        stride = pool_page_bytes // itemsize
        unit = layout.pages.draft_unit(any_stride)
        if pool_page_bytes % itemsize == 0 and stride % unit == 0:
            best = layout
        m *= 2
    if best is None:
        per_token = Layout.of(config, dtype, 1).page_bytes
        raise UsageError(
            f"{where}: the draft's KV ({per_token} bytes a token) does not fit the target's "
            f"{pool_page_bytes}-byte pages of {page_tokens} tokens: a draft must not need more "
            "KV per token than the target"
        )
    return best


@dataclass(eq=False, slots=True)
class ModelState(DraftState):
    """A request's drafts and the draft model's KV for it (``DraftState``'s pages and slots),
    and what the draft does this step: (``computed`` when planned, catch-up, drafts)."""

    planned: tuple[int, int, int] | None = None

    def accepted(self, accepted: int, runner: Runner) -> None:
        """The last verify of ``drafts`` yielded ``accepted`` tokens: keep the accepted drafts
        the draft model computed (all but its last); a stateful draft past a rejected one
        goes back to its saved state and sees the accepted tokens again in its next
        catch-up."""
        num = len(self.drafts)
        if not num:
            return  # a verify of no drafts (kern run at rows above 1): nothing drafted
        kept = min(accepted - 1, num - 1)
        if self.slot is not None and kept < num - 1:
            assert self.saved is not None
            runner.copy_slots([self.saved], [self.slot])
            kept = 0
        self.computed += kept


# One sequence for the draft model: its tokens, its draft state, tokens of catch-up, drafts.
DraftRun = tuple[Sequence[int], ModelState, int, int]


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
    drafting: list[tuple[ModelState, int]] = []
    for _, d, catch, num in go:
        d.computed += catch
        if num:
            d.drafts = [picked[len(drafting)]]
            drafting.append((d, num))
    if draft.stateful:
        # The state at the last accepted token, restored if a verify rejects a draft the
        # draft computed past it (ModelState.accepted).
        saved = [(d.slot, d.saved) for d, num in drafting if num > 1]
        draft.copy_slots([s for s, _ in saved], [t for _, t in saved])
    for j in range(1, max((num for _, num in drafting), default=0)):
        more = [d for d, num in drafting if num > j]
        batch = [SeqChunk([d.drafts[-1]], d.computed + j - 1, d.table, d.slot) for d in more]
        for d, tok in zip(more, sampler.greedy(batch), strict=True):
            d.drafts.append(tok)


class ModelDrafts:
    """Drafts from a draft checkpoint (``sampler``'s runner, over the pool's pages or
    ``kern run``'s own), run for every drafting request at once after the step is planned
    (a ``kern.engine.drafters.Drafter``)."""

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
        num = num_drafts(self.rows, req)
        if num <= 0 or room <= 0:
            return None
        d = req.draft
        if d is None:
            d = req.draft = ModelState()
        assert isinstance(d, ModelState)
        catch = len(req.tokens) - d.computed
        if catch + num > room:
            num = room - catch if catch < room else 0
            catch = min(catch, room)
        d.planned = (d.computed, catch, num)
        return catch + num, num

    def run(self, reqs: Sequence[Request], memory: DraftMemory) -> None:
        """Take the draft's pages from ``memory`` (making room, never preempting: a request
        whose pages cannot be had, or whose draft KV was dropped since it was planned,
        decodes one row this step), then draft (:func:`draft_greedy`)."""
        draft = self.sampler.runner
        dpt = draft.page_tokens
        go: list[DraftRun] = []
        for req in reqs:
            d = req.draft
            assert isinstance(d, ModelState) and d.planned is not None
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
        if isinstance(req.draft, ModelState):  # None: it never drafted
            req.draft.accepted(accepted, self.sampler.runner)

    def stepped(
        self, batch: Sequence[SeqChunk], reqs: Sequence[Request], memory: DraftMemory
    ) -> None:
        pass  # catches up from the tokens when it next drafts

    @classmethod
    def solo(
        cls, rows: int, runner: Runner, draft: Checkpoint, num_tokens: int
    ) -> tuple[ModelDrafts, SoloMemory]:
        """``kern run``'s: the draft over pages (and, stateful, slots 0 working, 1 saved) of
        its own, at the target's page size."""
        pt = runner.page_tokens
        own = Runner.with_pages(
            draft, num_pages=cdiv(num_tokens, pt), page_tokens=pt, num_slots=2, ops=runner.ops
        )
        memory = SoloMemory(own.num_pages, 2 if own.stateful else 0)
        return cls(rows, Sampler(own)), memory


class CheckpointDrafting:
    """A draft checkpoint as the engine sees it (a ``kern.engine.drafters.Drafting``): checked
    before anything loads, its layout in the target's pool pages, its runner over the
    target's arena."""

    reads_mtp = False

    def __init__(self, checkpoint: Path | None = None) -> None:
        self.checkpoint = checkpoint
        self.layout: Layout | None = None
        self.runner: Runner | None = None

    def check(self, target: Target, config: ModelConfig | None = None) -> None:
        check_draft_target(target, config or load_config(target.checkpoint))

    def prepare(self, config: ModelConfig, layout: Layout, ops: Any, target: Target) -> int:
        assert self.checkpoint is not None
        self.layout = draft_layout(
            load_config(self.checkpoint),
            ops.dtype,
            layout.page_bytes,
            target.page_tokens,
            target.where("draft"),
        )
        # A stateful draft's slots come from the same pool: slots fit either model's state.
        return self.layout.state_bytes

    def load(self, runner: Runner, checkpoint: Checkpoint) -> None:
        assert self.checkpoint is not None and self.layout is not None
        draft = load_checkpoint(self.checkpoint, device=runner.device, dtype=runner.dtype)
        self.runner = runner.over_arena(draft, self.layout)

    def drafter(self, rows: int, runner: Runner) -> ModelDrafts:
        assert self.runner is not None
        return ModelDrafts(rows, Sampler(self.runner))
