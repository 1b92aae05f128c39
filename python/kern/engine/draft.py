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
  one-row steps) is kern.engine.spec's, for the server and ``kern run`` alike; this module
  loads and checks the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kern.engine.layout import Layout
from kern.errors import UsageError
from kern.kern_toml import Target
from kern.model_config import ModelConfig, load_config

__all__ = ["check_draft", "check_draft_target", "draft_layout"]


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
    if config.model_type == "deepseek_v4":
        # Its pages are compressed-entry pages (kern.engine.compressed_layout) that no other
        # family's KV rows are laid out in; its speculative rows draft by n-gram lookup.
        raise UsageError(
            f"{where}: a draft checkpoint for a deepseek_v4 target is not supported "
            "(draft with draft = 'ngram', the default at rows above 1)"
        )
    draft = check_draft(target.checkpoint, target.draft_checkpoint, where)
    dtype = getattr(torch, target.dtype)
    page_bytes = Layout.of(config, dtype, target.page_tokens).page_bytes
    draft_layout(draft, dtype, page_bytes, target.page_tokens, where)


def _tokenizer(folder: Path) -> dict[str, object]:
    """What must be equal for two checkpoints to share token ids."""
    from kern.checkpoint import _eos_token_ids
    from kern.tokenizer import Tokenizer

    config = load_config(folder)
    tok = Tokenizer.from_dir(folder, extra_eos_token_ids=_eos_token_ids(folder, config))
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
    if config.model_type == "deepseek_v4":
        # Its pooling state would need the verify's rewind (Runner.keep_positions) per draft.
        raise UsageError(
            f"{where}: a deepseek_v4 draft checkpoint is not supported (draft with draft = 'ngram')"
        )
    itemsize = torch.empty((), dtype=dtype).element_size()
    m, best = 1, None
    while True:
        layout = Layout.of(config, dtype, page_tokens * m)
        if layout.page_bytes > pool_page_bytes:
            break
        # The CPU attention indexes K rows of page_tokens values and V chunks of
        # page_tokens * head_dim values from the arena's start (latent pages: rows of
        # page_tokens * C values): the pool page must be a whole number of them.
        stride = pool_page_bytes // itemsize
        if layout.page_class == "latent":
            unit = 1 if any_stride else layout.page_tokens * layout.page_shape[-1]
        else:
            unit = layout.page_tokens * config.head_dim
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
