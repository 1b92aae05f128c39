"""Qwen3.5 (text): gated DeltaNet linear attention interleaved with gated full attention.

Matches transformers 5.23 ``Qwen3_5ForCausalLM``:

* Layer ``i`` mixes tokens with linear attention or full attention per ``layer_types[i]``;
  every layer then has a dense SwiGLU MLP.
* Every ``Qwen3_5RMSNorm`` (input, post-attention, final, q/k norms) is zero-centred: it
  scales by ``1 + weight``. The DeltaNet output norm (``Qwen3_5RMSNormGated``) scales by
  ``weight`` as stored, times silu(z).
* Full attention: q_proj emits per head ``head_dim`` queries then ``head_dim`` gate logits;
  output ``o * sigmoid(gate)``; RoPE on the first ``head_dim * partial_rotary_factor`` dims.
* Gated DeltaNet: ``in_proj_qkv`` (q, k, v concatenated: key_dim, key_dim, value_dim),
  ``in_proj_z`` (value_dim), ``in_proj_b`` and ``in_proj_a`` (one per value head); a depthwise
  causal conv1d (kernel K, no bias) and silu over the qkv channels, with the last K-1 inputs
  kept as the conv state; beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); the
  gated delta rule with l2-normalised q, k, scale key_head_dim ** -0.5, value head h reading
  key head h // (num_v_heads // num_k_heads); state [num_v_heads, Dk, Dv] in float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kern.backend import Ops
from kern.batch import Step
from kern.models.config import ModelConfig
from kern.models.layers.attention import Attention
from kern.models.layers.caches import Caches, Tensors, param
from kern.models.layers.decoder import DecoderLayer, DecoderModel
from kern.models.layers.mlp import DenseMLP


class GatedDeltaNet:
    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors, prefix: str, index: int) -> None:
        self.ops = ops
        self.index = index
        d = c.delta
        assert d is not None
        self.num_k_heads = d.num_key_heads
        self.num_v_heads = d.num_value_heads
        self.k_dim = d.key_head_dim
        self.v_dim = d.value_head_dim
        self.eps = c.rms_norm_eps
        key_dim = self.num_k_heads * self.k_dim
        value_dim = self.num_v_heads * self.v_dim
        self.conv_split = (key_dim, key_dim, value_dim)
        self.split = (2 * key_dim + value_dim, value_dim, self.num_v_heads, self.num_v_heads)
        names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        self.w_in = ops.prepare_linear(torch.cat([t[f"{prefix}{n}.weight"] for n in names]))
        self.conv_weight = param(ops, t[f"{prefix}conv1d.weight"].squeeze(1))  # [C, K]
        self.dt_bias = param(ops, t[f"{prefix}dt_bias"])
        # g = -exp(A_log) * softplus(a + dt_bias), in float32 as transformers takes it.
        self.neg_a = -t[f"{prefix}A_log"].float().exp().to(ops.device)
        self.norm = param(ops, t[f"{prefix}norm.weight"])
        self.w_out = ops.prepare_linear(t[f"{prefix}out_proj.weight"])

    def __call__(self, x: Tensor, step: Step, caches: Caches) -> Tensor:
        ops = self.ops
        n = x.shape[0]
        i = self.index
        mixed, z, b, a = ops.linear(x, self.w_in).split(self.split, dim=1)
        conv_snap = caches.conv_snap[i] if caches.conv_snap else None
        mixed = ops.causal_conv1d(step, mixed, self.conv_weight, caches.conv[i], conv_snap)
        q, k, v = mixed.split(self.conv_split, dim=1)
        q = q.reshape(n, self.num_k_heads, self.k_dim)
        k = k.reshape(n, self.num_k_heads, self.k_dim)
        v = v.reshape(n, self.num_v_heads, self.v_dim)
        beta = ops.sigmoid(b)
        g = self.neg_a * ops.softplus(a.float() + self.dt_bias)
        delta_snap = caches.delta_snap[i] if caches.delta_snap else None
        core = ops.gated_delta_rule(
            step, q, k, v, g, beta, caches.delta[i], self.k_dim**-0.5, delta_snap
        )
        core = ops.gated_rms_norm(
            core.reshape(-1, self.v_dim), z.reshape(-1, self.v_dim), self.norm, self.eps
        )
        return ops.linear(core.reshape(n, -1), self.w_out)


class Qwen3_5(DecoderModel):  # noqa: N801 (the family's name)
    stateful = True

    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors) -> None:
        super().__init__(ops, c, t, norm_offset=1.0)
        num_attn = num_linear = 0
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            if c.is_linear_layer(i):
                mixer = GatedDeltaNet(ops, c, t, p + "linear_attn.", num_linear)
                num_linear += 1
            else:
                mixer = Attention(
                    ops, c, t, p + "self_attn.", num_attn, gated=True, norm_offset=1.0
                )
                num_attn += 1
            self.layers.append(DecoderLayer(ops, c, t, p, mixer, DenseMLP(ops, t, p + "mlp."), 1.0))
