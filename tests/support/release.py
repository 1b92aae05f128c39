"""A release-layout test folder rewritten: its tensors as one file, changed by the test."""

from __future__ import annotations

import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["rewrite"]


def rewrite(src: Path, dst: Path, change) -> Path:
    """``src`` copied to ``dst`` with its (possibly sharded) tensors in one file, changed by
    ``change`` (a function of the name -> tensor dict)."""
    shutil.copytree(src, dst)
    tensors = {}
    for file in sorted(dst.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
        file.unlink()
    index = dst / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst
