"""A checkpoint's ``config.json`` read into a :class:`~kern.models.config.ModelConfig`: the file's
``model_type`` names the family (``kern.models.registry``), whose reader takes it from there.

Design notes
------------
* ``model_type`` in the config is the *family* kern runs, not the string in the file: a
  Qwen3.5 checkpoint is published as the multimodal ``qwen3_5`` (text fields nested under
  ``text_config``) or as the text-only ``qwen3_5_text``; both read as ``qwen3_5``. ``raw``
  keeps the whole file as read.
* Everything that is wrong with a file is a ``CheckpointError`` (a ``ValueError``) whose
  message names the file and the field, so that ``kern run`` and ``kern serve`` can print it
  as is. Torch-free.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kern.checkpoint.errors import (
    CheckpointError,
    ConfigFieldError,
    MissingFileError,
    UnsupportedModelError,
)
from kern.checkpoint.fields import Fields
from kern.models import registry
from kern.models.config import ModelConfig

__all__ = ["load_config", "parse_config"]


def load_config(path: str | Path) -> ModelConfig:
    """Read ``config.json`` from a checkpoint folder (or the file itself).

    Raises :class:`MissingFileError`, :class:`UnsupportedModelError`, :class:`ConfigFieldError`.
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise MissingFileError(f"{file}: no such file (a checkpoint folder needs config.json)")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON: {e}") from e
    return parse_config(raw, source=str(file))


def parse_config(raw: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
    """Build a :class:`ModelConfig` from a parsed ``config.json``; ``source`` names it in errors."""
    if not isinstance(raw, dict):
        raise ConfigFieldError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    family = registry.by_model_type(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"{source}: model_type {model_type!r} is not supported "
            f"(kern runs {', '.join(repr(t) for t in registry.model_types())})"
        )
    text, where = raw, source
    if model_type in family.text_config and "text_config" in raw:
        # A multimodal config: the language model's fields live in text_config.
        text = raw["text_config"]
        where = f"{source} (text_config)"
        if not isinstance(text, dict):
            raise ConfigFieldError(f"{source}: field 'text_config' must be an object")
    return family.read_config(Fields(text, where), raw)
