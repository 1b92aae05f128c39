"""Tensor names and shapes the families share (transformers' ``*ForCausalLM`` names): the
decoder stack's frame, GQA attention, the SwiGLU MLP, routed experts and latent attention.
A family's own module puts them together (``kern.models.<family>``); torch-free.

The order of insertion is the order ``kern make-tiny`` writes the tensors in (and splits them
into shards by), so it is part of what a tiny checkpoint's bytes depend on.
"""

from __future__ import annotations

from collections.abc import Callable

from kern.models.config import GroupRouting, ModelConfig

__all__ = [
    "Shapes",
    "attention",
    "decoder",
    "experts",
    "gated_shared",
    "group_routed",
    "latent_attention",
    "mlp",
    "norms",
]

Shapes = dict[str, tuple[int, ...]]


def decoder(c: ModelConfig, layer: Callable[[ModelConfig, int], Shapes]) -> Shapes:
    """Embedding, final norm, ``lm_head`` (left out when tied: optional then) and each layer's
    tensors as ``layer(c, i)`` gives them."""
    h, v = c.hidden_size, c.vocab_size
    shapes: Shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for i in range(c.num_hidden_layers):
        shapes.update(layer(c, i))
    return shapes


def norms(c: ModelConfig, p: str) -> Shapes:
    """A pre-norm block's two RMSNorms."""
    h = c.hidden_size
    return {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}


def attention(c: ModelConfig, p: str, *, gated: bool = False) -> Shapes:
    """GQA attention with per-head q/k norms; ``gated``: Qwen3.5's q_proj emits, per head,
    head_dim queries followed by head_dim gate logits."""
    q_width = c.num_attention_heads * c.head_dim
    kv_width = c.num_key_value_heads * c.head_dim
    q_out = 2 * q_width if gated else q_width
    out = {
        p + "q_proj.weight": (q_out, c.hidden_size),
        p + "k_proj.weight": (kv_width, c.hidden_size),
        p + "v_proj.weight": (kv_width, c.hidden_size),
        p + "o_proj.weight": (c.hidden_size, q_width),
        p + "q_norm.weight": (c.head_dim,),
        p + "k_norm.weight": (c.head_dim,),
    }
    if c.attention_bias:
        out[p + "q_proj.bias"] = (q_out,)
        out[p + "k_proj.bias"] = (kv_width,)
        out[p + "v_proj.bias"] = (kv_width,)
        out[p + "o_proj.bias"] = (c.hidden_size,)
    return out


def latent_attention(c: ModelConfig, p: str) -> Shapes:
    """Multi-head latent attention (``c.mla``), DeepSeek's names."""
    m = c.mla
    assert m is not None
    h, heads = c.hidden_size, c.num_attention_heads
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    kv_a = m.kv_lora_rank + m.qk_rope_head_dim
    out = {
        p + "kv_a_proj_with_mqa.weight": (kv_a, h),
        p + "kv_a_layernorm.weight": (m.kv_lora_rank,),
        p + "kv_b_proj.weight": (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
        p + "o_proj.weight": (h, heads * m.v_head_dim),
    }
    if m.q_lora_rank:
        out[p + "q_a_proj.weight"] = (m.q_lora_rank, h)
        out[p + "q_a_layernorm.weight"] = (m.q_lora_rank,)
        out[p + "q_b_proj.weight"] = (heads * qk, m.q_lora_rank)
    else:
        out[p + "q_proj.weight"] = (heads * qk, h)
    if c.attention_bias:
        if m.q_lora_rank:
            out[p + "q_a_proj.bias"] = (m.q_lora_rank,)
        out[p + "kv_a_proj_with_mqa.bias"] = (kv_a,)
        out[p + "o_proj.bias"] = (h,)
    return out


def mlp(hidden: int, inner: int, p: str) -> Shapes:
    """SwiGLU: gate, up and down projections."""
    return {
        p + "gate_proj.weight": (inner, hidden),
        p + "up_proj.weight": (inner, hidden),
        p + "down_proj.weight": (hidden, inner),
    }


def experts(c: ModelConfig, p: str) -> Shapes:
    """A sparse MLP's router and its routed experts (``c.experts``), per-expert tensors as
    the published files store them (``mlp.experts.3.gate_proj.weight``)."""
    e = c.experts
    assert e is not None
    h = c.hidden_size
    shapes: Shapes = {p + "gate.weight": (e.num_experts, h)}
    for i in range(e.num_experts):
        shapes.update(mlp(h, e.moe_intermediate_size, f"{p}experts.{i}."))
    return shapes


def group_routed(c: ModelConfig, routing: GroupRouting, p: str) -> Shapes:
    """DeepSeek's sparse MLP (``kern.models.layers.moe.DeepseekMoE``): router, routed experts,
    the correction bias, shared experts."""
    assert c.experts is not None
    out = experts(c, p)
    out[p + "gate.e_score_correction_bias"] = (c.experts.num_experts,)
    if routing.n_shared_experts:
        inner = c.experts.moe_intermediate_size * routing.n_shared_experts
        out.update(mlp(c.hidden_size, inner, p + "shared_experts."))
    return out


def gated_shared(c: ModelConfig, p: str) -> Shapes:
    """Qwen's sparse MLP with a gated shared expert (``kern.models.layers.moe.GatedSharedMoE``):
    router, routed experts, the shared expert and its one-output gate."""
    assert c.experts is not None
    out = experts(c, p)
    out.update(mlp(c.hidden_size, c.experts.shared_expert_intermediate_size, p + "shared_expert."))
    out[p + "shared_expert_gate.weight"] = (1, c.hidden_size)
    return out
