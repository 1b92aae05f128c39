"""What ``kern run`` and ``kern test`` run: their model flags, the target those select (checked
by :func:`kern.engine.targets.select`, as ``kern serve`` checks its own), and loading its
checkpoints.

torch and the checkpoint reader are imported inside the loaders: the parser imports this
module, and ``kern --help`` answers before torch loads.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from kern.cli.args import positive_int
from kern.engine.targets import Selection, select
from kern.kern_toml import DEFAULT_THREADS, Target

if TYPE_CHECKING:
    from kern.checkpoint.load import Checkpoint

__all__ = ["add_target_args", "load", "load_draft", "select_target"]


def add_target_args(p: argparse.ArgumentParser) -> None:
    """--model or --config/--target, and the keys both commands override: --threads, --ranks,
    --draft."""
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, metavar="DIR", help="a checkpoint folder")
    source.add_argument("--config", type=Path, metavar="FILE", help="a kern.toml (with --target)")
    p.add_argument("--target", metavar="NAME", help="the [targets.NAME] of --config")
    p.add_argument(
        "--threads",
        type=positive_int,
        metavar="N",
        help=f"torch intra-op threads (default: the target's, else {DEFAULT_THREADS})",
    )
    p.add_argument(
        "--ranks",
        type=positive_int,
        metavar="N",
        help="processes that split the model (default: the target's, else 1; see docs/serve.md)",
    )
    p.add_argument(
        "--draft",
        metavar="DRAFT",
        help="the drafter at rows > 1: ngram, mtp (a deepseek_v3 checkpoint's own MTP layer) "
        "or a draft checkpoint folder (default: the target's, else ngram)",
    )


def select_target(args: argparse.Namespace, rows: int | None = None) -> Selection:
    """The target of --config/--target, --model, or the embedded model, decoding at ``rows``
    (--rows; None: its widest), checked as every command checks one."""
    return select(
        config=args.config,
        target=args.target,
        model=args.model,
        overrides={"threads": args.threads, "ranks": args.ranks, "draft": args.draft},
        rows=rows,
        serving=False,
    )


def load(target: Target) -> Checkpoint:
    """The target's checkpoint, with torch's thread count pinned to the target's first; with
    its multi-token-prediction layer when it drafts with it (``draft = "mtp"``)."""
    import torch

    from kern.checkpoint.load import load_checkpoint

    # Pin before loading: loading casts with torch ops too, and nothing after may differ.
    torch.set_num_threads(target.threads)
    mtp = target.draft == "mtp" and target.decode_rows > 1
    return load_checkpoint(target.checkpoint, device=target.device, dtype=target.dtype, mtp=mtp)


def load_draft(target: Target) -> Checkpoint | None:
    """The target's draft checkpoint (checked by kern.engine.targets), or None."""
    from kern.checkpoint.load import load_checkpoint

    if target.draft_checkpoint is None:
        return None
    return load_checkpoint(target.draft_checkpoint, device=target.device, dtype=target.dtype)
