"""Causal GQA attention over paged K/V (the Qwen families'), with per-head q/k RMSNorm and
RoPE."""

from __future__ import annotations

import torch
from torch import Tensor

from kern.backend import Ops
from kern.batch import Step
from kern.models.config import ModelConfig
from kern.models.layers.caches import Caches, Tensors, param

__all__ = ["Attention"]


class Attention:
    """Causal GQA attention with per-head q/k RMSNorm and RoPE (Qwen3); with ``gated``, the
    Qwen3.5 variant: q_proj also emits a per-head gate, the output is scaled by sigmoid(gate),
    and only the first ``rotary_dim`` dims of each head rotate."""

    def __init__(
        self,
        ops: Ops,
        c: ModelConfig,
        t: Tensors,
        prefix: str,
        kv_index: int,
        *,
        gated: bool,
        norm_offset: float,
    ) -> None:
        self.ops = ops
        self.kv_index = kv_index
        self.gated = gated
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.rotary_dim = c.rotary_dim
        self.eps = c.rms_norm_eps
        self.scale = c.head_dim**-0.5
        names = ("q_proj", "k_proj", "v_proj")
        self.w_qkv = ops.prepare_linear(torch.cat([t[f"{prefix}{n}.weight"] for n in names]))
        self.b_qkv = None
        self.b_o = None
        if c.attention_bias:
            self.b_qkv = param(ops, torch.cat([t[f"{prefix}{n}.bias"] for n in names]))
            self.b_o = param(ops, t[f"{prefix}o_proj.bias"])
        self.w_o = ops.prepare_linear(t[f"{prefix}o_proj.weight"])
        # q and k heads are normalised and rotated as one [T, Hq + Hk, D] tensor: one set of
        # ops instead of two, and the same bits (both are per-head, per-element).
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        qk_norm = torch.cat(
            [
                t[f"{prefix}q_norm.weight"].expand(h, d),
                t[f"{prefix}k_norm.weight"].expand(hk, d),
            ]
        )
        self.qk_norm = ops.prepare_norm(qk_norm, norm_offset)

    def __call__(self, x: Tensor, step: Step, caches: Caches) -> Tensor:
        ops = self.ops
        n = x.shape[0]
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = ops.linear(x, self.w_qkv, self.b_qkv)
        gate = None
        if self.gated:
            # Per head: head_dim queries, then head_dim gate logits (transformers' chunk).
            q_gate = qkv[:, : 2 * h * d].reshape(n, h, 2 * d)
            gate = q_gate[:, :, d:].reshape(n, h * d)
            kv = qkv[:, 2 * h * d :].reshape(n, 2 * hk, d)
            qk = torch.cat([q_gate[:, :, :d], kv[:, :hk]], dim=1)
            v = kv[:, hk:]
        else:
            heads = qkv.view(n, h + 2 * hk, d)
            qk, v = heads[:, : h + hk], heads[:, h + hk :]
        kv_cache = caches.kv[self.kv_index]
        # the keys and values go into the cache in the same kernel
        qk = ops.qk_norm_rope_kv(
            step, qk, v, self.qk_norm, self.eps, step.rope, self.rotary_dim, kv_cache
        )
        o = ops.attention(step, qk[:, :h], kv_cache, self.scale).reshape(n, h * d)
        if gate is not None:
            o = o * ops.sigmoid(gate)
        return ops.linear(o, self.w_o, self.b_o)
