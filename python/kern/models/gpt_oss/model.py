"""gpt-oss: GQA attention with biases, per-head sinks and a sliding window on alternate layers
(no q/k norm), YaRN RoPE, and on every layer a biased top-k router over experts with biases and
a clamped SwiGLU.

Matches transformers 5.23 ``GptOssForCausalLM``:
* attention: a row's softmax runs over its visible keys and its head's sink logit, and the
  sink's weight is dropped (it adds no value); a sliding layer's row at position p sees keys
  p - window + 1 .. p (``kern.kernels.paged_attention``'s ``sinks`` and ``window``), kept in
  window pages (``kern.models.gpt_oss.pages``) and read through ``Step.window``;
* the router is a linear with bias; its top-k logits go through a softmax (weights sum to 1);
* an expert's gate_up rows interleave gate (even) and up (odd); it computes
  ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=l)``, then
  ``down``, each linear with its bias. A token's expert outputs are added in top-k slot order
  (transformers adds them in expert-id order: float rounding only).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kern.backend import Ops
from kern.batch import Step
from kern.models.config import ModelConfig
from kern.models.gpt_oss.config import GptOssFields, window
from kern.models.layers.caches import Caches, Tensors, param
from kern.models.layers.decoder import DecoderLayer, DecoderModel
from kern.models.layers.moe import SparseMoE

__all__ = ["GptOss", "GptOssMoE", "SinkAttention"]


class SinkAttention:
    """GQA attention with biases, RoPE (no q/k norm), per-head sinks and an optional window."""

    def __init__(
        self, ops: Ops, c: ModelConfig, t: Tensors, prefix: str, kv_index: int, window: int
    ) -> None:
        self.ops = ops
        self.kv_index = kv_index
        self.window = window
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.rotary_dim = c.rotary_dim
        self.scale = c.head_dim**-0.5
        names = ("q_proj", "k_proj", "v_proj")
        self.w_qkv = ops.prepare_linear(torch.cat([t[f"{prefix}{n}.weight"] for n in names]))
        self.w_o = ops.prepare_linear(t[f"{prefix}o_proj.weight"])
        self.b_qkv = self.b_o = None
        if c.attention_bias:
            self.b_qkv = param(ops, torch.cat([t[f"{prefix}{n}.bias"] for n in names]))
            self.b_o = param(ops, t[f"{prefix}o_proj.bias"])
        # float32 whatever the model's dtype: the kernels add it to float32 logits.
        self.sinks = t[f"{prefix}sinks"].to(device=ops.device, dtype=torch.float32)

    def __call__(self, x: Tensor, step: Step, caches: Caches) -> Tensor:
        ops = self.ops
        n = x.shape[0]
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        heads = ops.linear(x, self.w_qkv, self.b_qkv).view(n, h + 2 * hk, d)
        qk = ops.rotary(heads[:, : h + hk], step.rope, self.rotary_dim)
        q, k, v = qk[:, :h], qk[:, h:], heads[:, h + hk :]
        kv_cache = caches.kv[self.kv_index]
        # A sliding layer's K/V live in window pages: its own view of the step (their slots).
        at = step
        if self.window:
            assert step.window is not None, "a sliding layer's page kind keeps window pages"
            at = step.window
        ops.write_kv(at, k, v, kv_cache)
        o = ops.attention(at, q, kv_cache, self.scale, sinks=self.sinks, window=self.window)
        return ops.linear(o.reshape(n, h * d), self.w_o, self.b_o)


class GptOssMoE(SparseMoE):
    """The biased router and the experts with biases and the clamped SwiGLU (see the notes);
    SparseMoE's expert loop, so expert parallelism splits it as it splits Qwen's."""

    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors, prefix: str) -> None:
        spec, fields = c.experts, c.family_fields
        assert spec is not None and isinstance(fields, GptOssFields)
        self.ops = ops
        self.top_k = spec.num_experts_per_tok
        self.num_experts = spec.num_experts
        self.norm_topk_prob = True
        self.alpha = fields.swiglu_alpha
        self.limit = fields.swiglu_limit
        self.w_router = ops.prepare_linear(t[f"{prefix}router.weight"])
        self.b_router = param(ops, t[f"{prefix}router.bias"])
        self.act = self.clamped_swiglu
        self.w_gate_up, self.w_down, self.b_gate_up, self.b_down = {}, {}, {}, {}
        for e in range(self.num_experts):
            p = f"{prefix}experts.{e}."
            if p + "gate_up_proj.weight" not in t:
                continue  # another expert-parallel rank's
            self.w_gate_up[e] = ops.prepare_linear(t[p + "gate_up_proj.weight"])
            self.b_gate_up[e] = param(ops, t[p + "gate_up_proj.bias"])
            self.w_down[e] = ops.prepare_linear(t[p + "down_proj.weight"])
            self.b_down[e] = param(ops, t[p + "down_proj.bias"])

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logits = self.ops.linear(x, self.w_router, self.b_router)
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=torch.float32).to(x.dtype), experts

    def clamped_swiglu(self, gate_up: Tensor) -> Tensor:
        """[N, 2 I] interleaved gate | up -> [N, I]."""
        gate = gate_up[:, 0::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * self.ops.sigmoid(gate * self.alpha))


class GptOss(DecoderModel):
    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors) -> None:
        super().__init__(ops, c, t, norm_offset=0.0)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            attn = SinkAttention(ops, c, t, p + "self_attn.", i, window(c, i))
            mlp = GptOssMoE(ops, c, t, p + "mlp.")
            self.layers.append(DecoderLayer(ops, c, t, p, attn, mlp, 0.0))
