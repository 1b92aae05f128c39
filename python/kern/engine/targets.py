"""Which target a command runs, and whether kern can run it here: one :func:`select` for
``kern run``, ``kern test``, ``kern serve`` and the server's environment (``KERN_*`` under
hypercorn).

Design notes
------------
* A target comes from a kern.toml (``--config FILE --target NAME``), from a checkpoint folder
  (``--model DIR``), or is the embedded tiny model. Flags that map one to one to kern.toml keys
  (``--threads``, ``--ranks``; ``kern serve`` also ``--dtype``, ``--device``, ``--pool-bytes``,
  ``--host-bytes``, ``--page-tokens``, ``--reasoning-parser``, ``--tool-call-parser``, whose
  key is ``tool_parser``, ``--grammar-timeout``, ``--grammar-max-bytes``) override the file's
  value. Every key remembers what set it (``Target.origin``), so an error names the file and
  key, or the flag.
* A key kern does not implement for the command is refused, never ignored: ``ranks`` above 1
  for a model ``parallel`` does not split (kern.engine.ranks.shard) or on too few CUDA devices,
  and a draft checkpoint kern cannot run beside the target (kern.engine.drafters.model:
  another tokenizer or vocabulary, KV that does not fit the target's page, ranks above 1),
  and ``draft = "mtp"`` where the checkpoint has no multi-token-prediction layer kern reads
  (kern.engine.drafters.mtp: a family without one, none in config.json, ranks above 1).
  ``draft = "ngram"`` (the default at rows > 1), ``"mtp"`` or a draft checkpoint is the
  drafter ``kern run``, ``kern test`` and
  ``kern serve`` use; ``--draft`` sets it on the command line (a folder relative to the
  working directory), and a draft with no row shape above 1 is refused, as in a kern.toml.
* ``--rows R`` (``kern run``, ``kern serve``; ``KERN_ROWS`` under hypercorn) picks one of a
  kern.toml target's declared shapes (:func:`choose_rows`; rows 1, plain decoding, is always
  allowed); a ``--model`` or embedded target declares none, so any R is taken as declared.
  Without it, both run at the widest.
* Everything that needs no weights is checked here, before anything loads or binds: the
  backend's dtype, a CUDA device, and the checkpoint's ``config.json`` (its family is known
  for the start-up line, and an unknown ``model_type`` is one line, not a traceback).
* :func:`select` is the one order every caller gets: resolve the target (flags over the file),
  choose its rows, then check it. Choosing rows reads no file, and the check then sees the
  target as it will run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kern.checkpoint.config import load_config
from kern.checkpoint.errors import MissingFileError
from kern.errors import UsageError
from kern.kern_toml import DRAFTERS, Target, default_dtype, load_toml_config
from kern.models import registry
from kern.models.config import ModelConfig

__all__ = [
    "FLAGS",
    "Selection",
    "check_target",
    "choose_rows",
    "family_chat_format",
    "resolve_target",
    "select",
]

# kern.toml key -> the flag that sets it on the command line.
FLAGS = {
    "dtype": "--dtype",
    "device": "--device",
    "pool_bytes": "--pool-bytes",
    "host_bytes": "--host-bytes",
    "page_tokens": "--page-tokens",
    "snapshot_pages": "--snapshot-pages",
    "threads": "--threads",
    "ranks": "--ranks",
    "reasoning_parser": "--reasoning-parser",
    "tool_parser": "--tool-call-parser",
    "draft": "--draft",
    "grammar_timeout": "--grammar-timeout",
    "grammar_max_bytes": "--grammar-max-bytes",
    "allow_unknown_fields": "--allow-unknown-fields",
    "hosted_tools": "--hosted-tools",
}


@dataclass(frozen=True)
class Selection:
    """A checked target: what :func:`select` returns."""

    target: Target
    # Its [targets.NAME] in the kern.toml; None for --model or the embedded model.
    name: str | None
    # The checkpoint's config.json, read by the check.
    config: ModelConfig


def select(
    *,
    config: Path | None,
    target: str | None,
    model: Path | None,
    overrides: dict[str, Any],
    rows: int | None = None,
    rows_flag: str = "--rows",
    served_name: str | None = None,
    serving: bool,
) -> Selection:
    """The target a command runs, decoding at ``rows`` (None: its widest), checked: what
    :func:`resolve_target`, :func:`choose_rows` and :func:`check_target` say, in that order.
    ``rows_flag`` names where ``rows`` came from in an error (``--rows``, ``KERN_ROWS``);
    ``serving`` is passed on to :func:`check_target`.
    Raises :class:`UsageError`, ``TomlConfigError`` and ``CheckpointError``; reads no
    weights."""
    resolved, name = resolve_target(
        config=config, target=target, model=model, overrides=overrides, served_name=served_name
    )
    resolved = choose_rows(resolved, name, rows, rows_flag)
    checked = check_target(resolved, serving=serving)
    return Selection(family_chat_format(resolved, checked), name, checked)


def family_chat_format(target: Target, config: ModelConfig) -> Target:
    """``target`` with its family's chat format (``Family.chat_format``: gpt-oss answers in
    harmony) as its tool_parser when nothing set one; one set to another is refused: it would
    misread every answer."""
    own = registry.of(config).chat_format
    if own is not None and target.reasoning_parser is not None:
        raise UsageError(
            f"{target.where('reasoning_parser')}: {config.model_type} answers in the {own} "
            "format, which carries its reasoning: leave reasoning_parser out"
        )
    if own is None or target.tool_parser == own:
        return target
    if "tool_parser" in target.origin:
        raise UsageError(
            f"{target.where('tool_parser')}: {config.model_type} answers in the {own} format; "
            f"tool_parser {target.tool_parser!r} would misread its answers (set {own!r} or "
            "leave it out)"
        )
    return dataclasses.replace(target, tool_parser=own)


def resolve_target(
    *,
    config: Path | None,
    target: str | None,
    model: Path | None,
    overrides: dict[str, Any],
    served_name: str | None = None,
) -> tuple[Target, str | None]:
    """The target to run and its kern.toml name (None for ``--model`` or the embedded model).

    ``overrides`` maps kern.toml keys to flag values (None: not given). Raises
    :class:`UsageError` for a wrong combination of flags, ``TomlConfigError`` for the file.
    """
    if config is not None and model is not None:
        raise UsageError(
            f"--config {config} and --model {model}: a kern.toml target names its own "
            "checkpoint; pass one of them"
        )
    if config is not None:
        if target is None:
            raise UsageError("--config needs --target NAME")
        try:
            toml = load_toml_config(config)
        except FileNotFoundError:
            raise UsageError(f"{config}: no such file") from None
        resolved = toml.target(target)
        name: str | None = target
    else:
        if target is not None:
            raise UsageError("--target needs --config FILE")
        if model is not None:
            checkpoint = Path(model)
            origin = {"checkpoint": f"--model {model}"}
        else:
            from kern.assets import default_model_path

            checkpoint = Path(default_model_path())
            origin = {"checkpoint": "the embedded model"}
        resolved = Target(name=checkpoint.name, checkpoint=checkpoint.resolve(), origin=origin)
        name = None
    given = {k: v for k, v in overrides.items() if v is not None}
    if "device" in given and "dtype" not in given:
        # A device flag without a dtype means that backend's dtype, as in a kern.toml.
        given["dtype"] = default_dtype(given["device"])
        origin_dtype = f"{FLAGS['device']} {given['device']}"
    else:
        origin_dtype = FLAGS["dtype"]
    if given.get("draft") not in (None, *DRAFTERS):
        given["draft"] = str(Path(given["draft"]).resolve())
    if given:
        origin = dict(resolved.origin)
        for key in given:
            origin[key] = origin_dtype if key == "dtype" else FLAGS[key]
        resolved = dataclasses.replace(resolved, **given, origin=origin)
    if served_name is not None:
        resolved = dataclasses.replace(resolved, name=served_name)
    return resolved, name


def choose_rows(target: Target, name: str | None, rows: int | None, flag: str) -> Target:
    """``target`` decoding at ``rows`` (None: its widest). A kern.toml target (``name``) must
    declare ``rows`` unless it is 1; one without a file declares what it is given. Raises
    :class:`UsageError` naming ``flag``."""
    if rows is None:
        return target
    if rows < 1:
        raise UsageError(f"{flag} {rows}: rows must be a positive integer")
    declared = target.rows
    if rows not in declared:
        if name is not None and rows != 1:
            raise UsageError(
                f"{flag} {rows}: target {name!r} declares rows {list(declared)} "
                f"({target.where('rows')})"
            )
        declared = tuple(sorted({*declared, rows}))
    origin = {**target.origin, "rows": f"{flag} {rows}"}
    return dataclasses.replace(target, rows=declared, chosen_rows=rows, origin=origin)


def check_target(target: Target, *, serving: bool) -> ModelConfig:
    """Refuse what kern cannot run here (see the design notes); return the checkpoint's
    config. Raises :class:`UsageError` naming the key's file or flag, and
    ``CheckpointError`` for a missing or unreadable checkpoint."""
    if target.ranks != 1:
        _check_ranks(target)
    # Each backend computes in one dtype (kern.backend): anything else would be converted
    # back, and the output would claim a dtype it did not use.
    backend_dtype = default_dtype(target.device)
    if target.dtype != backend_dtype:
        raise UsageError(
            f"{target.where('dtype')}: target {target.name!r} is {target.device}/"
            f"{target.dtype}: the {target.device} backend runs {backend_dtype}"
        )
    if target.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(
                f"{target.where('device')}: target {target.name!r} runs on {target.device}, "
                "but torch sees no CUDA device here"
            )
    if not target.checkpoint.is_dir():
        raise MissingFileError(f"{target.checkpoint}: no such checkpoint folder")
    config = load_config(target.checkpoint)
    # A page kind may need page_tokens to fit its model (whole compression windows a page).
    unfit = registry.of(config).page_kind().fit(config, target.page_tokens)
    if unfit is not None:
        raise UsageError(f"{target.where('page_tokens')}: {unfit}")
    if target.snapshot_pages is not None and not registry.of(config).page_kind().windowed(config):
        raise UsageError(
            f"{target.where('snapshot_pages')}: snapshot_pages = {target.snapshot_pages} "
            f"applies to models with window pages (deepseek_v4, gpt_oss with sliding layers); "
            f"this {config.model_type} checkpoint resumes at any page"
        )
    if target.draft is not None and target.widest_rows < 2:
        raise UsageError(
            f"{target.where('draft')}: draft = {target.draft!r} drafts nothing at rows "
            f"{list(target.rows)} (a step at rows R verifies R - 1 drafts): declare a row shape "
            "above 1 (--rows R, or rows = [1, 4] in a kern.toml)"
        )
    if target.draft is not None:
        from kern.engine.drafters.factory import drafting

        drafting(target).check(target, config)
    if target.ranks != 1:
        from kern.engine.ranks.shard import Shard, ShardError

        try:
            Shard(0, target.ranks, target.parallel).check(config)
        except ShardError as e:
            raise UsageError(f"{target.where('ranks')}: {e}") from None
    return config


def _check_ranks(target: Target) -> None:
    """Where several ranks run: rank r on cuda:r, or all on the CPU (see kern.engine.ranks)."""
    if target.device.startswith("cuda"):
        import torch

        if target.device != "cuda":
            raise UsageError(
                f"{target.where('device')}: with ranks = {target.ranks}, device is 'cuda' "
                "(rank r runs on cuda:r)"
            )
        if torch.cuda.device_count() < target.ranks:
            raise UsageError(
                f"{target.where('ranks')}: ranks = {target.ranks} needs as many CUDA devices; "
                f"torch sees {torch.cuda.device_count()}"
            )
