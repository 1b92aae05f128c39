"""Qwen3.5-MoE (text): Qwen3.5's hybrid layers, every MLP routed experts with a gated shared
expert.

Matches transformers 5.23 ``Qwen3_5MoeForCausalLM``: the gated DeltaNet and gated full
attention of Qwen3.5 (``kern.models.layers.gated_delta``, ``attention``), zero-centred
RMSNorms, and on every layer softmax top-k routing with renormalised weights plus the gated
shared expert (``kern.models.layers.moe.GatedSharedMoE``).
"""

from __future__ import annotations

from kern.backend import Ops
from kern.models.config import ModelConfig
from kern.models.layers.caches import Tensors
from kern.models.layers.decoder import DecoderLayer, DecoderModel
from kern.models.layers.gated_delta import hybrid_mixers
from kern.models.layers.moe import GatedSharedMoE


class Qwen3_5Moe(DecoderModel):  # noqa: N801 (the family's name)
    stateful = True

    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors) -> None:
        super().__init__(ops, c, t, norm_offset=1.0)
        for i, mixer in enumerate(hybrid_mixers(ops, c, t)):
            p = f"model.layers.{i}."
            mlp = GatedSharedMoE(ops, c, t, p + "mlp.")
            self.layers.append(DecoderLayer(ops, c, t, p, mixer, mlp, 1.0))
