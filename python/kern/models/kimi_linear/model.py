"""Kimi-Linear: Kimi Delta Attention (KDA) in most layers, NoPE latent attention in the rest,
and DeepSeek-style routed experts.

Matches transformers 5.23 ``KimiLinearForCausalLM``:

* KDA (``self_attn.`` of a ``linear_attention`` layer): ``q_proj``, ``k_proj``, ``v_proj``
  (``H * D`` each), each through its own depthwise causal conv (``q_conv1d`` ...; kernel K, no
  bias) and silu, kept as one conv over the concatenated ``q | k | v`` channels with the last
  K - 1 inputs as the conv state. The decay is per key channel: ``g = -exp(A_log[h]) *
  softplus(f_b_proj(f_a_proj(x)) + dt_bias)`` ([T, H, D], float32); ``beta =
  sigmoid(b_proj(x))`` per head; the gated delta rule with l2-normalised q and k, scale
  ``D ** -0.5``, state [H, D, D] float32. The output is RMS-normalised per head by ``o_norm``
  (weight as stored, eps ``rms_norm_eps``), times ``sigmoid(g_b_proj(g_a_proj(x)))``, then
  ``o_proj``.
* Latent attention (``full_attention`` layers): DeepSeek-V3's MLA
  (:class:`kern.models.layers.mla.LatentAttention`) with no rotary embedding anywhere; the
  rope dims of the shared key are cached unrotated, the scale is ``qk_head_dim ** -0.5``.
* MLP per ``mlp_layer_types``: dense SwiGLU, or DeepSeek's group-limited sigmoid routing
  with the correction bias and the shared experts (:class:`DeepseekMoE`).
* Every RMSNorm scales by its weight as stored (no offset).

Design notes
------------
* The projections that read the layer's input are one matmul (q, k, v, the two low-rank
  gate inputs and beta's), split by columns, as for the other families.
* The delta rule runs token by token on the CPU (``kern.backend.cpu_recurrence``), so a
  state's bits depend only on its tokens, however a prompt was chunked; transformers'
  prefill is chunked and agrees to float32 rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kern.backend import Ops
from kern.batch import Step
from kern.models.config import ModelConfig
from kern.models.kimi_linear.config import KimiLinearFields
from kern.models.layers.caches import Caches, Tensors, param
from kern.models.layers.decoder import DecoderLayer, DecoderModel
from kern.models.layers.mla import LatentAttention
from kern.models.layers.mlp import DenseMLP
from kern.models.layers.moe import DeepseekMoE


class DeltaAttention:
    """Kimi Delta Attention (see the module notes)."""

    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors, prefix: str, index: int) -> None:
        self.ops = ops
        self.index = index
        assert c.delta is not None
        self.num_heads = h = c.delta.num_value_heads
        self.head_dim = d = c.delta.value_head_dim
        self.eps = c.rms_norm_eps
        width = h * d
        names = ("q_proj", "k_proj", "v_proj", "f_a_proj", "g_a_proj", "b_proj")
        self.w_in = ops.prepare_linear(torch.cat([t[f"{prefix}{n}.weight"] for n in names]))
        self.split = (3 * width, d, d, h)
        self.w_f = ops.prepare_linear(t[f"{prefix}f_b_proj.weight"])
        self.w_g = ops.prepare_linear(t[f"{prefix}g_b_proj.weight"])
        convs = [t[f"{prefix}{n}_conv1d.weight"].squeeze(1) for n in "qkv"]
        self.conv_weight = param(ops, torch.cat(convs))  # [3 * width, K]
        # g = -exp(A_log) * softplus(f + dt_bias), in float32 as transformers takes it.
        self.dt_bias = t[f"{prefix}dt_bias"].float().to(ops.device)
        a_log = t[f"{prefix}A_log"].float().reshape(h, 1)
        self.neg_a = -a_log.exp().to(ops.device)
        self.norm = param(ops, t[f"{prefix}o_norm.weight"])
        self.w_out = ops.prepare_linear(t[f"{prefix}o_proj.weight"])

    def __call__(self, x: Tensor, step: Step, caches: Caches) -> Tensor:
        ops = self.ops
        n = x.shape[0]
        h, d, i = self.num_heads, self.head_dim, self.index
        mixed, f, gate, b = ops.linear(x, self.w_in).split(self.split, dim=1)
        conv_snap = caches.conv_snap[i] if caches.conv_snap else None
        mixed = ops.causal_conv1d(step, mixed, self.conv_weight, caches.conv[i], conv_snap)
        q, k, v = (part.reshape(n, h, d) for part in mixed.split(h * d, dim=1))
        f = ops.linear(f, self.w_f).float() + self.dt_bias
        g = self.neg_a * ops.softplus(f.reshape(n, h, d))
        beta = ops.sigmoid(b)
        delta_snap = caches.delta_snap[i] if caches.delta_snap else None
        core = ops.gated_delta_rule(step, q, k, v, g, beta, caches.delta[i], d**-0.5, delta_snap)
        gate = ops.linear(gate, self.w_g)
        core = ops.gated_rms_norm(
            core.reshape(-1, d), gate.reshape(-1, d), self.norm, self.eps, gate="sigmoid"
        )
        return ops.linear(core.reshape(n, h * d), self.w_out)


class KimiLinear(DecoderModel):
    stateful = True

    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors) -> None:
        super().__init__(ops, c, t, norm_offset=0.0)
        own: KimiLinearFields = c.family_fields
        num_attn = num_linear = 0
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            if c.is_linear_layer(i):
                mixer = DeltaAttention(ops, c, t, p + "self_attn.", num_linear)
                num_linear += 1
            else:
                mixer = LatentAttention(ops, c, t, p + "self_attn.", num_attn)
                num_attn += 1
            if c.is_sparse_layer(i):
                mlp = DeepseekMoE(ops, c, t, p + "mlp.", own.routing)
            else:
                mlp = DenseMLP(ops, t, p + "mlp.")
            self.layers.append(DecoderLayer(ops, c, t, p, mixer, mlp, 0.0))
