"""What is wrong with a checkpoint folder, as exception classes (all ``ValueError``s whose
message names the file and the field). ``kern.model_config`` and ``kern.checkpoint`` export
them; they live here so that every module that reads a checkpoint can raise them."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ConfigFieldError",
    "MissingFileError",
    "UnsupportedModelError",
    "UnsupportedTokenizerError",
]


class CheckpointError(ValueError):
    """A checkpoint folder or one of its files is not what kern expects.

    The message names the file and what was expected; callers print it unchanged.
    """


class MissingFileError(CheckpointError):
    """A file the checkpoint needs is not there."""


class UnsupportedModelError(CheckpointError):
    """``config.json`` names a model family (or a variant of one) that kern does not run."""


class ConfigFieldError(CheckpointError):
    """A field of ``config.json`` is missing, of the wrong type, or inconsistent."""


class UnsupportedTokenizerError(CheckpointError):
    """The tokenizer's files are there, but only code kern does not run (a checkpoint's own
    ``tokenization_*.py``, loaded with ``trust_remote_code``) could read them."""
