"""Qwen3-Next: Qwen3.5's hybrid layers with routed experts.

Matches transformers 5.23 ``Qwen3NextForCausalLM``:

* Layer ``i`` mixes tokens with the gated DeltaNet or gated full attention per
  ``layer_types[i]``, as Qwen3.5 does (``kern.models.layers.gated_delta``; its in-projection
  is stored grouped by key head and reordered at load); every RMSNorm but the DeltaNet's
  output norm is zero-centred (scales by ``1 + weight``).
* The MLP is sparse per ``mlp_layer_types`` (``decoder_sparse_step``, ``mlp_only_layers``):
  softmax top-k routing with a gated shared expert (``kern.models.layers.moe.GatedSharedMoE``),
  else a dense SwiGLU of ``intermediate_size``.
"""

from __future__ import annotations

from kern.backend import Ops
from kern.models.config import ModelConfig
from kern.models.layers.caches import Tensors
from kern.models.layers.decoder import DecoderLayer, DecoderModel
from kern.models.layers.gated_delta import hybrid_mixers
from kern.models.layers.mlp import DenseMLP
from kern.models.layers.moe import GatedSharedMoE


class Qwen3Next(DecoderModel):
    stateful = True

    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors) -> None:
        super().__init__(ops, c, t, norm_offset=1.0)
        for i, mixer in enumerate(hybrid_mixers(ops, c, t, grouped=True)):
            p = f"model.layers.{i}."
            if c.is_sparse_layer(i):
                mlp = GatedSharedMoE(ops, c, t, p + "mlp.")
            else:
                mlp = DenseMLP(ops, t, p + "mlp.")
            self.layers.append(DecoderLayer(ops, c, t, p, mixer, mlp, 1.0))
