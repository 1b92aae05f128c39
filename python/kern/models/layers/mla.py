"""Multi-head latent attention (DeepSeek-V3's MLA; Kimi-Linear's without RoPE), absorbed,
over latent pages.

Design notes
------------
* Queries from ``q_proj``, or with a q-LoRA from ``q_b_proj(rms_norm(q_a_proj(x)))``; per head
  ``qk_nope_head_dim`` plain dims then ``qk_rope_head_dim`` rotated ones.
  ``kv_a_proj_with_mqa`` gives the latent (``kv_lora_rank``, RMS-normalised by
  ``kv_a_layernorm``) and one shared RoPE key. ``kv_b_proj`` expands the latent into each
  head's key (nope part) and value. The two small norms use eps 1e-6 whatever
  ``rms_norm_eps`` says (transformers builds them so). With ``rope_interleave`` RoPE turns
  pairs (2i, 2i + 1) and writes the results de-interleaved (evens' then odds'); kern
  permutes the rope rows of the projections to that order once at load and turns them as
  rotate-half pairs: the same products, the same bits. YaRN scales the frequencies and
  cos/sin (``kern.models.layers.rope``) and the softmax scale (:func:`softmax_scale`).
* The cache holds, per token and layer, the normalised latent and the rotated RoPE key
  (``kv_lora_rank + qk_rope_head_dim`` values: ``kern.models.pages.LatentPages``), never
  per-head keys and values.
* Attention runs in the absorbed form for decode and prefill alike: each head's nope query
  is multiplied into the latent space by its slice of ``kv_b_proj`` (W_UK), so scores are
  ``[q W_UK, q_pe] . [latent, k_pe]`` against the cached vectors themselves, and the
  attention's output (a mix of latents) is taken out by the head's value slice (W_UV) before
  ``o_proj``. Per token and head that costs ``(nope + v) * kv_lora_rank`` multiplies for the
  two absorptions and ``kv_lora_rank + rope`` (instead of ``nope + rope``) per key score; the
  expanded form would instead multiply every cached latent of the context by
  ``kv_b_proj`` (``ctx * (nope + v) * kv_lora_rank * H``) on every step. For decode that is
  the whole point; for a long prefill from scratch the expanded form does fewer multiplies
  (scores over ``nope + rope`` dims, values over ``v``), a trade kern has not taken: one
  path, whose bits do not depend on how a prompt is split into chunks.
* It differs from transformers' expanded form by float32 rounding only (the sums are
  regrouped).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kern.backend import Ops
from kern.batch import Step
from kern.models.config import ModelConfig, yarn_mscale
from kern.models.layers.caches import Caches, Tensors, param

__all__ = ["LatentAttention", "softmax_scale"]


def softmax_scale(c: ModelConfig) -> float:
    """Latent attention's score scale: qk_head_dim ** -0.5, times yarn's
    mscale(factor, mscale_all_dim) squared, as transformers sets it."""
    m = c.mla
    assert m is not None
    scale = (m.qk_nope_head_dim + m.qk_rope_head_dim) ** -0.5
    if c.rope_type == "yarn" and c.rope_yarn[5]:
        mscale = yarn_mscale(c.rope_yarn[0], c.rope_yarn[5])
        scale *= mscale * mscale
    return scale


# transformers' DeepseekV3RMSNorm default, used by q_a_layernorm and kv_a_layernorm.
_LORA_NORM_EPS = 1e-6


def _deinterleave(n: int) -> Tensor:
    """Row order that puts the even dims of an interleaved RoPE block first, then the odd."""
    return torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])


class LatentAttention:
    """Multi-head latent attention, absorbed (see the module notes)."""

    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors, prefix: str, index: int) -> None:
        self.ops = ops
        self.index = index
        m = c.mla
        assert m is not None
        self.num_heads = h = c.num_attention_heads
        self.nope, self.rope = m.qk_nope_head_dim, m.qk_rope_head_dim
        self.rank = m.kv_lora_rank
        self.v_dim = m.v_head_dim
        self.q_lora = m.q_lora_rank
        self.eps = c.rms_norm_eps
        self.scale = softmax_scale(c)
        # Kimi-Linear's latent attention turns nothing: its rope dims are cached as computed.
        self.rotary = m.rotary
        qk = self.nope + self.rope
        # Rows of each head's query and of the shared key that RoPE turns, in the order the
        # rotate-half rotation reads them.
        q_rows = torch.arange(h * qk).view(h, qk)
        k_rows = torch.arange(self.rank + self.rope)
        if m.rope_interleave:
            perm = _deinterleave(self.rope)
            q_rows[:, self.nope :] = q_rows[:, self.nope :][:, perm]
            k_rows[self.rank :] = k_rows[self.rank :][perm]
        q_rows = q_rows.flatten()
        kv_a = t[f"{prefix}kv_a_proj_with_mqa.weight"][k_rows]
        bias = c.attention_bias
        b_kv_a = t[f"{prefix}kv_a_proj_with_mqa.bias"][k_rows] if bias else None
        if self.q_lora:
            # q_a and kv_a both read x: one matmul, split.
            first = t[f"{prefix}q_a_proj.weight"]
            b_first = t[f"{prefix}q_a_proj.bias"] if bias else None
            self.q_norm = ops.prepare_norm(t[f"{prefix}q_a_layernorm.weight"])
            self.w_qb = ops.prepare_linear(t[f"{prefix}q_b_proj.weight"][q_rows])
        else:
            first = t[f"{prefix}q_proj.weight"][q_rows]
            b_first = torch.zeros(first.shape[0]) if bias else None
        self.first_width = first.shape[0]
        self.w_a = ops.prepare_linear(torch.cat([first, kv_a]))
        self.b_a = None
        if bias:
            assert b_first is not None and b_kv_a is not None
            self.b_a = param(ops, torch.cat([b_first.to(kv_a.dtype), b_kv_a]))
        self.kv_norm = ops.prepare_norm(t[f"{prefix}kv_a_layernorm.weight"])
        kv_b = t[f"{prefix}kv_b_proj.weight"].view(h, self.nope + self.v_dim, self.rank)
        # W_UK as per-head [rank, nope] linears (nope -> rank), W_UV as [v, rank] (rank -> v).
        self.w_uk = ops.prepare_head_linear(kv_b[:, : self.nope].transpose(1, 2))
        self.w_uv = ops.prepare_head_linear(kv_b[:, self.nope :])
        self.w_o = ops.prepare_linear(t[f"{prefix}o_proj.weight"])
        self.b_o = param(ops, t[f"{prefix}o_proj.bias"]) if bias else None

    def __call__(self, x: Tensor, step: Step, caches: Caches) -> Tensor:
        ops = self.ops
        n = x.shape[0]
        h, nope, rope, rank = self.num_heads, self.nope, self.rope, self.rank
        a = ops.linear(x, self.w_a, self.b_a)
        q, ckv = a[:, : self.first_width], a[:, self.first_width :]
        if self.q_lora:
            q = ops.linear(ops.rms_norm(q, self.q_norm, _LORA_NORM_EPS), self.w_qb)
        q = q.reshape(n, h, nope + rope)
        latent = ops.rms_norm(ckv[:, :rank], self.kv_norm, _LORA_NORM_EPS)
        # The heads' rope queries and the shared rope key turn as one [T, H + 1, rope].
        pe = torch.cat([q[:, :, nope:], ckv[:, None, rank:]], dim=1)
        if self.rotary:
            pe = ops.rotary(pe, step.rope, rope)
        cache = caches.kv[self.index]
        ops.write_latent(step, torch.cat([latent, pe[:, h]], dim=1), cache)
        q_latent = ops.head_linear(q[:, :, :nope].contiguous(), self.w_uk)  # [T, H, rank]
        query = torch.cat([q_latent, pe[:, :h]], dim=2)
        o = ops.latent_attention(step, query, cache, self.scale, rank)  # [T, H, rank]
        o = ops.head_linear(o, self.w_uv)  # [T, H, v]
        return ops.linear(o.reshape(n, h * self.v_dim), self.w_o, self.b_o)
