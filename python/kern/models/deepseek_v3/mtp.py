"""DeepSeek's multi-token-prediction (MTP) layer as a model the runner runs: the drafter
``draft = "mtp"`` (``kern.engine.drafters.mtp``) drafts with it.

Design notes
------------
* What it computes is transformers 5.23's ``MtpLayer`` (below). The model the runner runs
  (:class:`MtpModel`) is the first MTP layer over its own latent pages (one layer: the
  drafter's layout), reading the target's embedding and LM head (the layer's own copies are
  not read, as transformers ties both to the model's) and, beside each row's token, the
  hidden row the step's ``inputs`` give it.
* Indices: the entry of position ``p`` sits at MTP index ``p - 1``, so the step's positions are
  the indices and RoPE turns at index + 1 (:meth:`MtpModel.plan_rope`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kern.backend import Ops
from kern.batch import Step
from kern.models.config import ModelConfig
from kern.models.deepseek_v3.config import DeepseekV3Fields
from kern.models.deepseek_v3.tensors import mtp_sparse
from kern.models.layers.caches import Caches, Tensors
from kern.models.layers.decoder import DecoderLayer
from kern.models.layers.mla import LatentAttention
from kern.models.layers.mlp import DenseMLP
from kern.models.layers.moe import DeepseekMoE
from kern.models.layers.rope import rope_frequencies

__all__ = ["MtpLayer", "MtpModel"]


class MtpLayer:
    """One multi-token-prediction layer (DeepSeek's ``model.layers.<num_hidden_layers + k>``),
    as transformers 5.23's ``MtpLayer`` runs it: ``h = eh_proj([enorm(embed(token_p)),
    hnorm(hidden_{p-1})])`` through a full decoder block (latent attention over its own
    latent pages, ``caches.kv[0]``, and the MoE), then ``shared_head.norm``. ``hidden_{p-1}``
    is the target's last hidden state after its final norm (transformers' ``hidden_states[-1]``)
    at the previous position, or, drafting further, this layer's own previous output. The
    logits are the target's LM head on the result; the layer's own copies of the embedding
    and the head (``embed_tokens``, ``shared_head.head``) are not read, as transformers ties
    both to the model's."""

    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors, k: int) -> None:
        self.ops = ops
        self.eps = c.rms_norm_eps
        p = f"model.layers.{c.num_hidden_layers + k}."
        self.enorm = ops.prepare_norm(t[p + "enorm.weight"])
        self.hnorm = ops.prepare_norm(t[p + "hnorm.weight"])
        self.w_eh = ops.prepare_linear(t[p + "eh_proj.weight"])
        self.post_norm = ops.prepare_norm(t[p + "shared_head.norm.weight"])
        attn = LatentAttention(ops, c, t, p + "self_attn.", 0)
        own: DeepseekV3Fields = c.family_fields
        if mtp_sparse(c, own, k):
            mlp: DeepseekMoE | DenseMLP = DeepseekMoE(ops, c, t, p + "mlp.", own.routing)
        else:
            mlp = DenseMLP(ops, t, p + "mlp.")
        self.block = DecoderLayer(ops, c, t, p, attn, mlp, 0.0)

    def __call__(self, embeds: Tensor, hidden: Tensor, step: Step, caches: Caches) -> Tensor:
        """embeds [T, hidden] of the tokens at the step's positions, hidden [T, hidden] of the
        positions before them -> [T, hidden], normed (ready for the LM head)."""
        ops = self.ops
        x = torch.cat(
            [
                ops.rms_norm(embeds, self.enorm, self.eps),
                ops.rms_norm(hidden, self.hnorm, self.eps),
            ],
            dim=1,
        )
        x = self.block(ops.linear(x, self.w_eh), step, caches)
        return ops.rms_norm(x, self.post_norm, self.eps)


class MtpModel:
    """The first MTP layer as a model (see the module notes): ``forward`` reads the step's
    tokens and ``step.inputs`` (the hidden row each reads, [T, hidden]) and returns the layer's
    output, already normed; ``logits`` is the target's head on it."""

    stateful = False
    num_attention_layers = 1
    num_linear_layers = 0

    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors, target: object) -> None:
        self.ops = ops
        self.config = c
        self.layer = MtpLayer(ops, c, t, 0)
        self.embed: Tensor = target.embed  # type: ignore[attr-defined]
        self.w_head = target.w_head  # type: ignore[attr-defined]
        self.rope = rope_frequencies(c)

    def plan_rope(self, step: Step) -> object:
        """RoPE at index + 1: the entry of index i is position i + 1's."""
        c = self.config
        return self.ops.plan_rope(step.positions + 1, c.rope_theta, c.rotary_dim, *self.rope)

    def forward(self, step: Step, caches: Caches) -> Tensor:
        assert step.inputs is not None, "the MTP layer reads a hidden row beside each token"
        return self.layer(self.embed[step.token_ids], step.inputs, step, caches)

    def final_hidden(self, hidden: Tensor) -> Tensor:
        return hidden  # shared_head.norm is the layer's last op

    def logits(self, hidden: Tensor) -> Tensor:
        return self.ops.linear(hidden, self.w_head).float()
