"""Qwen3-MoE: Qwen3's attention with a mixture-of-experts MLP on the sparse layers.

Matches transformers 5.23 ``Qwen3MoeForCausalLM``; the experts are
``kern.models.layers.moe.SparseMoE`` (the routing's notes are there). A layer is sparse unless
it is in ``mlp_only_layers`` or ``(layer + 1) % decoder_sparse_step != 0`` (then it has a
dense MLP of intermediate_size): ``ModelConfig.mlp_layer_types``.
"""

from __future__ import annotations

from kern.backend import Ops
from kern.models.config import ModelConfig
from kern.models.layers.attention import Attention
from kern.models.layers.caches import Tensors
from kern.models.layers.decoder import DecoderLayer, DecoderModel
from kern.models.layers.mlp import DenseMLP
from kern.models.layers.moe import SparseMoE


class Qwen3Moe(DecoderModel):
    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors) -> None:
        super().__init__(ops, c, t, norm_offset=0.0)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            attn = Attention(ops, c, t, p + "self_attn.", i, gated=False, norm_offset=0.0)
            if c.is_sparse_layer(i):
                mlp = SparseMoE(ops, c, t, p + "mlp.")
            else:
                mlp = DenseMLP(ops, t, p + "mlp.")
            self.layers.append(DecoderLayer(ops, c, t, p, attn, mlp, 0.0))
