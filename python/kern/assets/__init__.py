"""Files the package ships: the embedded default model (``tiny-qwen3``, ``kern make-tiny qwen3``
with ``kern.tiny.DEFAULT_MODEL_ARGS``; tests/test_tiny.py regenerates it and compares bytes)."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

__all__ = ["default_model_path"]


def default_model_path() -> Path:
    """The tiny qwen3 checkpoint shipped inside the package (``kern serve`` with no model)."""
    path = importlib.resources.files("kern").joinpath("assets", "tiny-qwen3")
    if not isinstance(path, Path):
        # A zipped install: kern loads weights with mmap and needs real files.
        raise RuntimeError(f"the embedded model is not on the filesystem ({path})")
    return path
