"""Which tensors a checkpoint holds, under which names, and as what: each family's table
(``kern.models.registry``) behind one set of calls the loader, the ranks and the tiny writer
use.

Design notes
------------
* kern's names are transformers' ``*ForCausalLM`` names, which are also the released
  checkpoints' for every family kern runs (``model.layers.0.self_attn.q_proj.weight``); a
  family whose files spell some differently maps them (``canonical_name``) and back
  (``stored_name``). Mixture-of-experts weights are the per-expert tensors of the published
  files (``mlp.experts.3.gate_proj.weight``), not transformers' fused in-memory layout; its
  ``save_pretrained`` writes them so too.
* A buffer some old exports saved (``*.rotary_emb.inv_freq``) is never read.
"""

from __future__ import annotations

from kern.models import registry
from kern.models.config import ModelConfig

__all__ = [
    "canonical_name",
    "expected_shapes",
    "fp4_weight",
    "head_name",
    "integer_tensor",
    "mtp_shapes",
    "split_stored",
    "stored_name",
]


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``config`` must hold, with its shape (the output head is
    left out when the embeddings are tied: it is optional then)."""
    return registry.of(config).tensor_shapes(config)


def head_name(config: ModelConfig) -> str:
    """The output head's tensor name (optional when the embeddings are tied)."""
    return registry.of(config).head


def mtp_shapes(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """The tensors of a checkpoint's multi-token-prediction layers with their shapes, and
    the names among them a checkpoint may leave out; none for a family without them."""
    mtp = registry.of(config).mtp
    return mtp.shapes(config) if mtp is not None else ({}, set())


def canonical_name(config: ModelConfig, name: str, mtp: bool = False) -> str | None:
    """The name kern uses for a stored tensor, or None for a tensor kern does not read.
    ``mtp``: read the checkpoint's multi-token-prediction layers too."""
    if name.endswith(".rotary_emb.inv_freq"):  # a buffer some old exports saved
        return None
    return registry.of(config).canonical_name(config, name, mtp)


def stored_name(config: ModelConfig, name: str) -> str:
    """The name a released checkpoint of ``config``'s family stores kern's tensor ``name``
    under (the inverse of :func:`canonical_name` for the names it renames)."""
    return registry.of(config).stored_name(config, name)


def integer_tensor(config: ModelConfig, name: str) -> bool:
    """Whether kern's tensor ``name`` holds integers (kept integer at load)."""
    leaves = registry.of(config).integer_leaves
    return bool(leaves) and name.endswith(leaves)


def fp4_weight(config: ModelConfig, name: str) -> bool:
    """Whether kern's tensor ``name`` is stored as FP4 (e2m1 bytes with e8m0 scales)."""
    return registry.of(config).fp4_weight(config, name)


def split_stored(
    config: ModelConfig, name: str
) -> tuple[tuple[int, ...], list[tuple[str, tuple]]] | None:
    """For a stored tensor that holds several of kern's (``name``: its canonical name; a
    release's fused experts): the shape it must have and each piece's name with (index on
    dim 0, first row, end row[, transposed]); None for a tensor that is one of kern's. A
    piece's trailing dims are read as one; ``transposed``: it is stored [in, out]."""
    return registry.of(config).split_stored(config, name)
