"""DeepSeek-V3 (and Kimi K2's text model): multi-head latent attention over latent pages, and a
mixture of experts routed by group-limited sigmoid scores, with shared experts.

Matches transformers 5.23 ``DeepseekV3ForCausalLM``:

* Attention (MLA): queries from ``q_proj``, or with a q-LoRA from
  ``q_b_proj(rms_norm(q_a_proj(x)))``; per head ``qk_nope_head_dim`` plain dims then
  ``qk_rope_head_dim`` rotated ones. ``kv_a_proj_with_mqa`` gives the latent
  (``kv_lora_rank``, RMS-normalised by ``kv_a_layernorm``) and one shared RoPE key.
  ``kv_b_proj`` expands the latent into each head's key (nope part) and value. The two small
  norms use eps 1e-6 whatever ``rms_norm_eps`` says (transformers builds them so). With
  ``rope_interleave`` RoPE turns pairs (2i, 2i + 1) and writes the results de-interleaved
  (evens' then odds'); kern permutes the rope rows of the projections to that order once at
  load and turns them as rotate-half pairs: the same products, the same bits. YaRN scales
  the frequencies and cos/sin (``kern.rope``) and the softmax scale
  (``kern.deepseek_config.softmax_scale``).
* MoE from layer ``first_k_dense_replace`` on: scores sigmoid(router logits) in float32; for
  choosing only, plus ``e_score_correction_bias``; groups ranked by the sum of their best two
  and all but the best ``topk_group`` groups masked; the top ``num_experts_per_tok`` experts
  weighted by their unbiased scores, renormalised iff ``norm_topk_prob`` (+1e-20), times
  ``routed_scaling_factor``; plus the shared experts' SwiGLU of width
  ``moe_intermediate_size * n_shared_experts``.

Design notes
------------
* The cache holds, per token and layer, the normalised latent and the rotated RoPE key
  (``kv_lora_rank + qk_rope_head_dim`` values: the ``latent`` page class of
  ``kern.engine.layout``), never per-head keys and values.
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
  regrouped), and the routed experts' outputs are added in top-k order where transformers
  adds them in expert order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kern.backend import Ops
from kern.batch import Step
from kern.deepseek_config import softmax_scale
from kern.model_config import ModelConfig
from kern.models.layers import Caches, DecoderLayer, DecoderModel, DenseMLP, Tensors, _param
from kern.models.qwen3_moe import SparseMoE

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
        self.num_heads = h = c.num_attention_heads
        self.nope, self.rope = c.qk_nope_head_dim, c.qk_rope_head_dim
        self.rank = c.kv_lora_rank
        self.v_dim = c.v_head_dim
        self.q_lora = c.q_lora_rank
        self.eps = c.rms_norm_eps
        self.scale = softmax_scale(c)
        # Kimi-Linear's latent attention turns nothing: its rope dims are cached as computed.
        self.rotary = not c.mla_use_nope
        qk = self.nope + self.rope
        # Rows of each head's query and of the shared key that RoPE turns, in the order the
        # rotate-half rotation reads them.
        q_rows = torch.arange(h * qk).view(h, qk)
        k_rows = torch.arange(self.rank + self.rope)
        if c.rope_interleave:
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
            self.b_a = _param(ops, torch.cat([b_first.to(kv_a.dtype), b_kv_a]))
        self.kv_norm = ops.prepare_norm(t[f"{prefix}kv_a_layernorm.weight"])
        kv_b = t[f"{prefix}kv_b_proj.weight"].view(h, self.nope + self.v_dim, self.rank)
        # W_UK as per-head [rank, nope] linears (nope -> rank), W_UV as [v, rank] (rank -> v).
        self.w_uk = ops.prepare_head_linear(kv_b[:, : self.nope].transpose(1, 2))
        self.w_uv = ops.prepare_head_linear(kv_b[:, self.nope :])
        self.w_o = ops.prepare_linear(t[f"{prefix}o_proj.weight"])
        self.b_o = _param(ops, t[f"{prefix}o_proj.bias"]) if bias else None

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


class DeepseekMoE(SparseMoE):
    """Group-limited sigmoid routing over the routed experts, plus the shared experts."""

    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors, prefix: str) -> None:
        super().__init__(ops, c, t, prefix)
        self.n_group = c.n_group
        self.topk_group = c.topk_group
        self.scaling = c.routed_scaling_factor
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


class DeepseekV3(DecoderModel):
    def __init__(self, ops: Ops, c: ModelConfig, t: Tensors) -> None:
        super().__init__(ops, c, t, norm_offset=0.0)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            attn = LatentAttention(ops, c, t, p + "self_attn.", i)
            if c.is_sparse_layer(i):
                mlp = DeepseekMoE(ops, c, t, p + "mlp.")
            else:
                mlp = DenseMLP(ops, t, p + "mlp.")
            self.layers.append(DecoderLayer(ops, c, t, p, attn, mlp, 0.0))


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
        sparse = c.num_experts > 0 and c.num_hidden_layers + k >= c.first_k_dense_replace
        mlp = DeepseekMoE(ops, c, t, p + "mlp.") if sparse else DenseMLP(ops, t, p + "mlp.")
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
