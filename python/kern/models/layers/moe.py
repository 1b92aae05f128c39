"""Routed experts: :class:`SparseMoE` (softmax top-k routing, Qwen3-MoE's, whose expert loop
the other routers reuse) and :class:`DeepseekMoE` (DeepSeek's group-limited sigmoid routing
with shared experts: deepseek_v3, kimi_linear).

Design notes
------------
* SparseMoE matches transformers 5.23 ``Qwen3MoeSparseMoeBlock``: the router is a bias-free
  linear, its softmax is taken in float32, the top ``num_experts_per_tok`` probabilities are
  renormalised to sum to 1 iff ``norm_topk_prob``, and each token's output is the weighted
  sum of its experts' SwiGLU outputs.
* Tokens are grouped by expert (a stable sort of the flattened top-k choices) and each expert
  runs one matmul pair over its tokens. How many tokens an expert gets depends on the whole
  batch, so the invariance of each token's result rests on the backend's matmul (on the CPU:
  row bits independent of the row count, see ``kern.backend.cpu``). A token's expert outputs
  are then added in its top-k order, a fixed order of elementwise ops. (transformers adds
  them in expert-id order; the two differ by float32 rounding only.)
* GatedSharedMoE matches transformers 5.23 ``Qwen2MoeSparseMoeBlock`` (Qwen3-Next's and
  Qwen3.5-MoE's): SparseMoE's routing and experts, plus one shared SwiGLU expert every token
  runs, scaled by sigmoid of a one-output linear (``shared_expert_gate``). It is ``shared``,
  as DeepSeek's shared experts are, so expert parallelism replicates it the same way.
* DeepseekMoE: scores sigmoid(router logits) in float32; for choosing only, plus
  ``e_score_correction_bias``; groups ranked by the sum of their best two and all but the
  best ``topk_group`` groups masked; the top ``num_experts_per_tok`` experts weighted by their
  unbiased scores, renormalised iff ``norm_topk_prob`` (+1e-20), times
  ``routed_scaling_factor``; plus the shared experts' SwiGLU of width
  ``moe_intermediate_size * n_shared_experts``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kern.backend import Ops
from kern.models.config import GroupRouting, ModelConfig
from kern.models.layers.caches import Tensors
from kern.models.layers.mlp import DenseMLP

__all__ = ["DeepseekMoE", "GatedSharedMoE", "SparseMoE"]


class SparseMoE:
    """The router and the experts whose weights ``t`` holds: every expert, unless the tensors
    are one expert-parallel rank's shard (``kern.engine.ranks.shard``), which holds 1/N of them."""

    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors, prefix: str) -> None:
        self.ops = ops
        spec = c.experts
        assert spec is not None
        self.top_k = spec.num_experts_per_tok
        self.num_experts = spec.num_experts
        self.norm_topk_prob = spec.norm_topk_prob
        self.w_router = ops.prepare_linear(t[f"{prefix}gate.weight"])
        # An expert's activation on its gate | up columns; None: SwiGLU, which the gate_up
        # linear computes in the same launch (ops.linear_silu_and_mul).
        self.act: Any = None
        self.w_gate_up: dict[int, Any] = {}
        self.w_down: dict[int, Any] = {}
        # Per-expert biases (gpt-oss's); Qwen's and DeepSeek's experts have none.
        self.b_gate_up: dict[int, Tensor] = {}
        self.b_down: dict[int, Tensor] = {}
        for e in range(self.num_experts):
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
                rows = xs[start : start + count]
                if self.act is None:  # SwiGLU, fused into the gate_up linear
                    h = ops.linear_silu_and_mul(rows, self.w_gate_up[e])
                else:
                    h = self.act(ops.linear(rows, self.w_gate_up[e], self.b_gate_up.get(e)))
                ys[start : start + count] = ops.linear(h, self.w_down[e], self.b_down.get(e))
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


class GatedShared:
    """sigmoid(gate(x)) * mlp(x): Qwen's shared expert with its scalar gate per token."""

    def __init__(self, ops: Ops, t: Tensors, prefix: str) -> None:
        self.ops = ops
        self.mlp = DenseMLP(ops, t, prefix + "shared_expert.")
        self.w_gate = ops.prepare_linear(t[prefix + "shared_expert_gate.weight"])

    def __call__(self, x: Tensor) -> Tensor:
        ops = self.ops
        return ops.sigmoid(ops.linear(x, self.w_gate)) * self.mlp(x)


class GatedSharedMoE(SparseMoE):
    """Softmax top-k routing over the routed experts, plus the gated shared expert."""

    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors, prefix: str) -> None:
        super().__init__(ops, c, t, prefix)
        self.shared = GatedShared(ops, t, prefix)

    def __call__(self, x: Tensor) -> Tensor:
        return super().__call__(x) + self.shared(x)


class DeepseekMoE(SparseMoE):
    """Group-limited sigmoid routing over the routed experts, plus the shared experts."""

    def __init__(
        self, ops: Ops, c: ModelConfig, t: Tensors, prefix: str, routing: GroupRouting
    ) -> None:
        super().__init__(ops, c, t, prefix)
        self.n_group = routing.n_group
        self.topk_group = routing.topk_group
        self.scaling = routing.routed_scaling_factor
        self.bias = t[f"{prefix}gate.e_score_correction_bias"].float().to(ops.device)
        # transformers routes in float32 whatever the model's dtype.
        self.w_router32 = t[f"{prefix}gate.weight"].float().to(ops.device)
        self.shared = DenseMLP(ops, t, prefix + "shared_experts.")

    def __call__(self, x: Tensor) -> Tensor:
        return super().__call__(x) + self.shared(x)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        ops = self.ops
        if ops.is_cpu:
            logits = ops.linear(x, self.w_router)  # float32 already, and batch invariant
        else:
            logits = torch.nn.functional.linear(x.float(), self.w_router32)
        scores = ops.sigmoid(logits)
        choice = scores + self.bias
        n = x.shape[0]
        groups = choice.view(n, self.n_group, -1)
        group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)
        best = torch.topk(group_scores, k=self.topk_group, dim=-1)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = groups.masked_fill(~keep[:, :, None], float("-inf")).view(n, -1)
        experts = torch.topk(choice, k=self.top_k, dim=-1)[1]
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.scaling).to(x.dtype), experts
