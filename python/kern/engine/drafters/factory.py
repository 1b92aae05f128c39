"""The one place a drafter is chosen: for an engine (the server, ``kern bench``, the tests)
from its target's ``draft`` key, and for ``kern run``'s one sequence from what it was given.
Both get the same drafter classes and the same ``settle``."""

from __future__ import annotations

from kern.checkpoint.load import Checkpoint
from kern.engine.drafters import Drafter, Drafting, SoloMemory
from kern.engine.drafters.model import CheckpointDrafting, ModelDrafts
from kern.engine.drafters.mtp import MtpDrafting, MtpDrafts
from kern.engine.drafters.ngram import NgramDrafting, NgramDrafts
from kern.engine.runner import Runner
from kern.kern_toml import Target

__all__ = ["drafting", "solo_drafter"]


def drafting(target: Target) -> Drafting:
    """What drafts for ``target`` at rows above 1: its checkpoint's own MTP layer
    (``draft = "mtp"``), a draft checkpoint (``draft = "path"``), else n-gram lookup."""
    if target.draft == "mtp":
        return MtpDrafting()
    if target.draft_checkpoint is not None:
        return CheckpointDrafting(target.draft_checkpoint)
    return NgramDrafting()


def solo_drafter(
    rows: int,
    runner: Runner,
    checkpoint: Checkpoint,
    num_tokens: int,
    *,
    draft: Checkpoint | None = None,
    mtp: bool = False,
) -> tuple[Drafter, SoloMemory]:
    """``kern run``'s drafter for one sequence of at most ``num_tokens`` tokens on ``runner``
    (``checkpoint``'s), and the memory of its own it drafts in: the checkpoint's MTP layer
    (``mtp``), a draft checkpoint (``draft``), else n-gram lookup."""
    if mtp:
        return MtpDrafts.solo(rows, runner, checkpoint, num_tokens)
    if draft is not None:
        return ModelDrafts.solo(rows, runner, draft, num_tokens)
    return NgramDrafts(rows), SoloMemory()
