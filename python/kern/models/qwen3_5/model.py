"""Qwen3.5 (text): gated DeltaNet linear attention interleaved with gated full attention.

Matches transformers 5.23 ``Qwen3_5ForCausalLM``:

* Layer ``i`` mixes tokens with linear attention or full attention per ``layer_types[i]``;
  every layer then has a dense SwiGLU MLP.
* Every ``Qwen3_5RMSNorm`` (input, post-attention, final, q/k norms) is zero-centred: it
  scales by ``1 + weight``. The DeltaNet output norm (``Qwen3_5RMSNormGated``) scales by
  ``weight`` as stored, times silu(z).
* Full attention: q_proj emits per head ``head_dim`` queries then ``head_dim`` gate logits;
  output ``o * sigmoid(gate)``; RoPE on the first ``head_dim * partial_rotary_factor`` dims.
* Gated DeltaNet: ``kern.models.layers.gated_delta`` (its notes).
"""

from __future__ import annotations

from kern.backend import Ops
from kern.models.config import ModelConfig
from kern.models.layers.caches import Tensors
from kern.models.layers.decoder import DecoderLayer, DecoderModel
from kern.models.layers.gated_delta import hybrid_mixers
from kern.models.layers.mlp import DenseMLP


class Qwen3_5(DecoderModel):  # noqa: N801 (the family's name)
    stateful = True

    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors) -> None:
        super().__init__(ops, c, t, norm_offset=1.0)
        for i, mixer in enumerate(hybrid_mixers(ops, c, t)):
            p = f"model.layers.{i}."
            self.layers.append(DecoderLayer(ops, c, t, p, mixer, DenseMLP(ops, t, p + "mlp."), 1.0))
