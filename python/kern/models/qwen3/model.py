"""Qwen3 (dense): GQA attention with per-head q/k RMSNorm, SwiGLU MLP, tied or untied head.

Matches transformers 5.23 ``Qwen3ForCausalLM``: RMSNorm weights are used as stored (no
offset), RoPE rotates whole heads, attention scale head_dim ** -0.5.
"""

from __future__ import annotations

from kern.backend import Ops
from kern.models.config import ModelConfig
from kern.models.layers.attention import Attention
from kern.models.layers.caches import Tensors
from kern.models.layers.decoder import DecoderLayer, DecoderModel
from kern.models.layers.mlp import DenseMLP


class Qwen3(DecoderModel):
    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors) -> None:
        super().__init__(ops, c, t, norm_offset=0.0)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            attn = Attention(ops, c, t, p + "self_attn.", i, gated=False, norm_offset=0.0)
            self.layers.append(DecoderLayer(ops, c, t, p, attn, DenseMLP(ops, t, p + "mlp."), 0.0))
