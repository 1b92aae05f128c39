"""The gated DeltaNet (Qwen3.5's and Qwen3-Next's linear attention): :class:`GatedDeltaNet`,
:func:`grouped_in_proj` (Qwen3-Next's grouped in-projection rows in Qwen3.5's order) and
:func:`hybrid_mixers` (a hybrid's layers: the DeltaNet or gated full attention).

Matches transformers 5.23 ``Qwen3_5GatedDeltaNet`` / ``Qwen3NextGatedDeltaNet``:

* Qwen3.5's layout: ``in_proj_qkv`` (q, k, v concatenated: key_dim, key_dim, value_dim),
  ``in_proj_z`` (value_dim), ``in_proj_b`` and ``in_proj_a`` (one per value head); a depthwise
  causal conv1d (kernel K, no bias) and silu over the qkv channels, with the last K-1 inputs
  kept as the conv state; beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); the
  gated delta rule with l2-normalised q, k, scale key_head_dim ** -0.5, value head h reading
  key head h // (num_v_heads // num_k_heads); state [num_v_heads, Dk, Dv] in float32.
* Qwen3-Next stores q, k, v, z in one ``in_proj_qkvz`` and b, a in one ``in_proj_ba``, each
  grouped by key head: per key head, its q and k rows, then the v and z rows of the value
  heads it serves (``fix_query_key_value_ordering``). Reordering the rows at load gives
  Qwen3.5's layout, so one forward serves both; a matmul's output columns are independent
  of the weight's row order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kern.backend import Ops
from kern.batch import Step
from kern.models.config import ModelConfig
from kern.models.layers.attention import Attention
from kern.models.layers.caches import Caches, Tensors, param

__all__ = ["GatedDeltaNet", "grouped_in_proj", "hybrid_mixers"]


def grouped_in_proj(c: ModelConfig, qkvz: Tensor, ba: Tensor) -> Tensor:
    """Qwen3-Next's ``in_proj_qkvz`` and ``in_proj_ba`` rows as q, k, v, z, b, a."""
    d = c.delta
    assert d is not None
    groups, ratio = d.num_key_heads, d.num_value_heads // d.num_key_heads
    dk, vz = d.key_head_dim, ratio * d.value_head_dim
    g = qkvz.reshape(groups, 2 * dk + 2 * vz, -1)
    q, k, v, z = g.split((dk, dk, vz, vz), dim=1)
    b, a = ba.reshape(groups, 2 * ratio, -1).split((ratio, ratio), dim=1)
    parts = (q, k, v, z, b, a)
    return torch.cat([p.reshape(-1, p.shape[-1]) for p in parts]).contiguous()


class GatedDeltaNet:
    """Layer ``index`` among the linear ones; ``w_in``: the in-projection's rows as q, k, v,
    z, b, a (None: Qwen3.5's four tensors under ``prefix``, concatenated)."""

    def __init__(
        self,
        ops: Ops,
        c: ModelConfig,
        t: Tensors,
        prefix: str,
        index: int,
        w_in: Tensor | None = None,
    ) -> None:
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
        if w_in is None:
            names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
            w_in = torch.cat([t[f"{prefix}{n}.weight"] for n in names])
        self.w_in = ops.prepare_linear(w_in)
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


def hybrid_mixers(ops: Ops, c: ModelConfig, t: Tensors, *, grouped: bool = False) -> list[Any]:
    """Each layer's mixer: the gated DeltaNet (``grouped``: Qwen3-Next's in-projection) or
    gated full attention with zero-centred q/k norms, per ``c.layer_types``."""
    mixers: list[Any] = []
    num_attn = num_linear = 0
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        if c.is_linear_layer(i):
            a = p + "linear_attn."
            w_in = None
            if grouped:
                w_in = grouped_in_proj(c, t[a + "in_proj_qkvz.weight"], t[a + "in_proj_ba.weight"])
            mixers.append(GatedDeltaNet(ops, c, t, a, num_linear, w_in))
            num_linear += 1
        else:
            prefix = p + "self_attn."
            mixers.append(Attention(ops, c, t, prefix, num_attn, gated=True, norm_offset=1.0))
            num_attn += 1
    return mixers
