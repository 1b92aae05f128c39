"""Qwen3-MoE: Qwen3's attention with a mixture-of-experts MLP on the sparse layers.

Matches transformers 5.23 ``Qwen3MoeForCausalLM``: the router is a bias-free linear, its
softmax is taken in float32, the top ``num_experts_per_tok`` probabilities are renormalised to
sum to 1 iff ``norm_topk_prob``, and each token's output is the weighted sum of its experts'
SwiGLU outputs. A layer is sparse unless it is in ``mlp_only_layers`` or
``(layer + 1) % decoder_sparse_step != 0`` (then it has a dense MLP of intermediate_size).

Design notes: tokens are grouped by expert (a stable sort of the flattened top-k choices) and
each expert runs one matmul pair over its tokens. How many tokens an expert gets depends on
the whole batch, so the invariance of each token's result rests on the backend's matmul (on
the CPU: row bits independent of the row count, see ``kern.backend.cpu``). A token's expert
outputs are then added in its top-k order, a fixed order of elementwise ops. (transformers
adds them in expert-id order; the two differ by float32 rounding only.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kern.backend import Ops
from kern.model_config import ModelConfig
from kern.models.layers import Attention, DecoderLayer, DecoderModel, DenseMLP, Tensors


class SparseMoE:
    """The router and the experts whose weights ``t`` holds: every expert, unless the tensors
    are one expert-parallel rank's shard (``kern.engine.ranks.shard``), which holds 1/N of them."""

    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors, prefix: str) -> None:
        self.ops = ops
        self.top_k = c.num_experts_per_tok
        self.num_experts = c.num_experts
        self.norm_topk_prob = c.norm_topk_prob
        self.w_router = ops.prepare_linear(t[f"{prefix}gate.weight"])
        self.act = ops.silu_and_mul  # an expert's activation on its gate | up columns
        self.w_gate_up: dict[int, Any] = {}
        self.w_down: dict[int, Any] = {}
        for e in range(c.num_experts):
            p = f"{prefix}experts.{e}."
            if p + "gate_proj.weight" not in t:
                continue
            gate_up = torch.cat([t[p + "gate_proj.weight"], t[p + "up_proj.weight"]])
            self.w_gate_up[e] = ops.prepare_linear(gate_up)
            self.w_down[e] = ops.prepare_linear(t[p + "down_proj.weight"])

    def __call__(self, x: Tensor) -> Tensor:
        weights, experts = self.route(x)
        return self.combine(self.expert_outputs(x, experts), weights)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Each token's top-k routing weights (in x's dtype) and expert ids: [T, k] each."""
        router_logits = self.ops.linear(x, self.w_router)
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def expert_outputs(self, x: Tensor, experts: Tensor) -> Tensor:
        """[T, k, hidden]: slot j of token t is expert ``experts[t, j]``'s output for it, or
        zeros where that expert is not held here."""
        ops = self.ops
        n = x.shape[0]
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        xs = x[order // self.top_k]
        ys = torch.zeros_like(xs) if len(self.w_down) < self.num_experts else torch.empty_like(xs)
        start = 0
        for e, count in enumerate(counts):
            if count and e in self.w_down:
                h = self.act(ops.linear(xs[start : start + count], self.w_gate_up[e]))
                ys[start : start + count] = ops.linear(h, self.w_down[e])
            start += count
        y = torch.empty_like(ys)
        y[order] = ys
        return y.view(n, self.top_k, -1)

    def combine(self, y: Tensor, weights: Tensor) -> Tensor:
        """A token's expert outputs weighted and added in its top-k slot order."""
        out = y[:, 0] * weights[:, 0:1]
        for j in range(1, self.top_k):
            out = out + y[:, j] * weights[:, j : j + 1]
        return out


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
