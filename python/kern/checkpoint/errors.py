"""What is wrong with a checkpoint folder, as exception classes: every one a ``ValueError``
whose message names the file and what was expected, so ``kern run`` and ``kern serve`` print it
as is. One module, so every reader of a checkpoint (config, tokenizer, tensors) raises them."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ConfigFieldError",
    "MissingFileError",
    "MissingShardError",
    "MissingTensorError",
    "PickleCheckpointError",
    "TensorError",
    "TensorShapeError",
    "UnexpectedTensorError",
    "UnsupportedModelError",
    "UnsupportedTokenizerError",
]


class CheckpointError(ValueError):
    """A checkpoint folder or one of its files is not what kern expects.

    The message names the file and what was expected; callers print it unchanged.
    """


class MissingFileError(CheckpointError):
    """A file the checkpoint needs is not there."""


class MissingShardError(MissingFileError):
    """``model.safetensors.index.json`` names a shard file that is not in the folder."""


class PickleCheckpointError(CheckpointError):
    """The folder holds only pickled weights, which kern never loads."""


class UnsupportedModelError(CheckpointError):
    """``config.json`` names a model family (or a variant of one) that kern does not run."""


class ConfigFieldError(CheckpointError):
    """A field of ``config.json`` is missing, of the wrong type, or inconsistent."""


class UnsupportedTokenizerError(CheckpointError):
    """The tokenizer's files are there, but only code kern does not run (a checkpoint's own
    ``tokenization_*.py``, loaded with ``trust_remote_code``) could read them."""


class TensorError(CheckpointError):
    """A tensor is missing, unexpected, of the wrong shape or of a dtype kern cannot use."""


class TensorShapeError(TensorError):
    pass


class MissingTensorError(TensorError):
    pass


class UnexpectedTensorError(TensorError):
    pass
