"""Routed experts as the Qwen MoE families' config.json spells them (``qwen3_moe``,
``qwen3_next``, ``qwen3_5_moe``): the expert sizes and which layers are sparse. Torch-free.

Design notes
------------
* A layer is sparse when it is not in ``mlp_only_layers`` and ``(layer + 1) %
  decoder_sparse_step == 0``, exactly as transformers decides it; the others have a dense MLP
  of ``intermediate_size`` (:class:`SparseSteps` keeps the file's two fields).
* transformers 5 writes ``num_experts`` as ``num_local_experts`` for some families (an
  ``attribute_map`` alias); both are read.
"""

from __future__ import annotations

from dataclasses import dataclass

from kern.checkpoint.errors import ConfigFieldError
from kern.checkpoint.fields import Fields
from kern.models.config import Experts

__all__ = ["SparseSteps", "read_experts", "read_sparse_steps"]


@dataclass(frozen=True)
class SparseSteps:
    """Which layers are sparse, as the file says it (``mlp_layer_types`` holds the result)."""

    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]

    def mlp_layer_types(self, n: int) -> tuple[str, ...]:
        return tuple(
            "sparse"
            if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
            else "dense"
            for i in range(n)
        )


def read_experts(f: Fields, *, norm_topk_prob: bool, shared: bool = False) -> Experts:
    """The routed experts' sizes; ``norm_topk_prob``: the family's default for that field;
    ``shared``: the family has Qwen's gated shared expert (``shared_expert_intermediate_size``,
    default 512 as transformers gives it)."""
    key = "num_experts" if "num_experts" in f.raw else "num_local_experts"
    num_experts = f.pos_int(key)
    top_k = f.pos_int("num_experts_per_tok")
    if top_k > num_experts:
        raise ConfigFieldError(
            f"{f.where}: num_experts_per_tok ({top_k}) exceeds {key} ({num_experts})"
        )
    return Experts(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=f.pos_int("moe_intermediate_size"),
        norm_topk_prob=f.flag("norm_topk_prob", default=norm_topk_prob),
        shared_expert_intermediate_size=(
            f.pos_int("shared_expert_intermediate_size", default=512) if shared else 0
        ),
    )


def read_sparse_steps(f: Fields, n: int) -> SparseSteps:
    """``decoder_sparse_step`` and ``mlp_only_layers`` of an ``n``-layer model."""
    mlp_only = f.raw.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in mlp_only
    ):
        raise ConfigFieldError(
            f"{f.where}: mlp_only_layers must be a list of layer indices below {n}"
        )
    return SparseSteps(
        decoder_sparse_step=f.pos_int("decoder_sparse_step", default=1),
        mlp_only_layers=tuple(sorted(set(mlp_only))),
    )
