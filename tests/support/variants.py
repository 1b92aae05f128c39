"""Tiny checkpoints in layouts ``kern make-tiny`` has no switch for: its folder with
config.json fields overridden and the weights regenerated for them."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kern.checkpoint.config import parse_config
from kern.models import registry
from kern.tiny import make_tiny
from kern.tiny.model import _weights


def build(tmp: Path, family: str, options: dict, overrides: dict) -> Path:
    out = make_tiny(family, tmp, seed=7, **options)
    if overrides:
        # make_tiny has no switch for these: rewrite config.json and regenerate the weights
        # for the new layer pattern with make_tiny's own initialisation.
        from safetensors.torch import save_file

        raw = json.loads((out / "config.json").read_text())
        raw.update(overrides)
        (out / "config.json").write_text(json.dumps(raw))
        config = parse_config(raw)
        tensors = _weights(config, 7, torch.float32)
        writer = registry.family(family).tiny_writer()
        if hasattr(writer, "fuse"):  # stored fused as the family's files are
            tensors = writer.fuse(config, tensors)
        save_file(tensors, str(out / "model.safetensors"))
    return out
