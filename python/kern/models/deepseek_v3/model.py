"""DeepSeek-V3 (and Kimi K2's text model): multi-head latent attention over latent pages, and a
mixture of experts routed by group-limited sigmoid scores, with shared experts.

Matches transformers 5.23 ``DeepseekV3ForCausalLM``: latent attention
(``kern.models.layers.mla.LatentAttention``, absorbed; its notes) and, from layer
``first_k_dense_replace`` on, DeepSeek's routed experts (``kern.models.layers.moe.DeepseekMoE``);
dense SwiGLU MLPs before. Every RMSNorm scales by its weight as stored. The routed experts'
outputs are added in top-k order where transformers adds them in expert order (float32
rounding only). The multi-token-prediction layer is ``kern.models.deepseek_v3.mtp``.
"""

from __future__ import annotations

from kern.backend import Ops
from kern.models.config import ModelConfig
from kern.models.deepseek_v3.config import DeepseekV3Fields
from kern.models.layers.caches import Tensors
from kern.models.layers.decoder import DecoderLayer, DecoderModel
from kern.models.layers.mla import LatentAttention
from kern.models.layers.mlp import DenseMLP
from kern.models.layers.moe import DeepseekMoE

__all__ = ["DeepseekV3"]


class DeepseekV3(DecoderModel):
    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors) -> None:
        super().__init__(ops, c, t, norm_offset=0.0)
        own: DeepseekV3Fields = c.family_fields
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            attn = LatentAttention(ops, c, t, p + "self_attn.", i)
            if c.is_sparse_layer(i):
                mlp = DeepseekMoE(ops, c, t, p + "mlp.", own.routing)
            else:
                mlp = DenseMLP(ops, t, p + "mlp.")
            self.layers.append(DecoderLayer(ops, c, t, p, attn, mlp, 0.0))
