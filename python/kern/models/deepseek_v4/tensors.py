"""DeepSeek-V4's tensors: their names and shapes, and the released checkpoints' names.

Design notes
------------
* kern's names are the ones transformers' ``save_pretrained`` writes for
  ``DeepseekV4ForCausalLM``: DeepSeek's own module names under ``model.``
  (``model.layers.0.attn.wq_a.weight``, ``model.hc_head.hc_fn``), with the output head as
  ``head.weight``.
* The released files (deepseek-ai/DeepSeek-V4-*) use the same names without ``model.``, and
  spell a few leaves differently: ``embed.weight``, ``hc_head_fn|base|scale``; their FP8
  weights carry block scales as ``<module>.scale`` (kern: ``<module>.weight_scale_inv``, as
  transformers' FP8 loader renames them), and their ``mtp.*`` layers are skipped unread.
  :func:`canonical_v4_name` maps them; :func:`released_v4_name` is its inverse.
* The hash-routed layers' ``ffn.gate.tid2eid`` (token id -> its experts) is an integer
  tensor; everything else is floating point (or FP8 / FP4 with scales).
"""

from __future__ import annotations

from kern.models.config import ModelConfig
from kern.models.deepseek_v4.config import CSA, HCA, DeepseekV4Fields

__all__ = [
    "HEAD",
    "INTEGER_LEAVES",
    "canonical_name",
    "fp4_weight",
    "is_routed_expert",
    "released_name",
    "tensor_shapes",
]

# The output head keeps DeepSeek's name.
HEAD = "head.weight"

# Tensors that hold integers (kept integer at load).
INTEGER_LEAVES = (".gate.tid2eid",)

_TOP_LEVEL = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
    "head.weight": "head.weight",
}
_RELEASED = {v: k for k, v in _TOP_LEVEL.items()}


def tensor_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a deepseek_v4 checkpoint with its shape (``head.weight`` left out
    when the embeddings are tied)."""
    v4: DeepseekV4Fields = c.family_fields
    h, v, hc = c.hidden_size, c.vocab_size, v4.hc_mult
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
        "model.hc_head.hc_fn": (hc, hc * h),
        "model.hc_head.hc_base": (hc,),
        "model.hc_head.hc_scale": (1,),
    }
    if not c.tie_word_embeddings:
        shapes["head.weight"] = (v, h)
    for i in range(c.num_hidden_layers):
        shapes.update(_layer(c, v4, i))
    return shapes


def _layer(c: ModelConfig, v4: DeepseekV4Fields, i: int) -> dict[str, tuple[int, ...]]:
    h, heads, d = c.hidden_size, c.num_attention_heads, c.head_dim
    assert c.experts is not None
    p = f"model.layers.{i}."
    mix = (2 + v4.hc_mult) * v4.hc_mult  # pre (n), post (n) and comb (n x n) weights
    out: dict[str, tuple[int, ...]] = {
        p + "attn_norm.weight": (h,),
        p + "ffn_norm.weight": (h,),
    }
    for hc in ("hc_attn_", "hc_ffn_"):
        out[p + hc + "fn"] = (mix, v4.hc_mult * h)
        out[p + hc + "base"] = (mix,)
        out[p + hc + "scale"] = (3,)
    a = p + "attn."
    out.update(
        {
            a + "wq_a.weight": (v4.q_lora_rank, h),
            a + "q_norm.weight": (v4.q_lora_rank,),
            a + "wq_b.weight": (heads * d, v4.q_lora_rank),
            a + "wkv.weight": (d, h),
            a + "norm.weight": (d,),
            a + "wo_a.weight": (v4.o_groups * v4.o_lora_rank, heads * d // v4.o_groups),
            a + "wo_b.weight": (h, v4.o_groups * v4.o_lora_rank),
            a + "attn_sink": (heads,),
        }
    )
    kind = v4.attention_types[i]
    if kind == CSA:
        # CSA's compressors emit two overlapping series (2 x the head dims).
        rate = v4.compress_rates[0]
        out.update(_compressor(a + "compressor.", h, d, rate, 2))
        out.update(_compressor(a + "indexer.compressor.", h, v4.index_head_dim, rate, 2))
        out[a + "indexer.wq_b.weight"] = (v4.index_n_heads * v4.index_head_dim, v4.q_lora_rank)
        out[a + "indexer.weights_proj.weight"] = (v4.index_n_heads, h)
    elif kind == HCA:
        out.update(_compressor(a + "compressor.", h, d, v4.compress_rates[1], 1))
    f = p + "ffn."
    experts = c.experts
    out[f + "gate.weight"] = (experts.num_experts, h)
    if v4.moe_types[i] == "hash_moe":
        out[f + "gate.tid2eid"] = (c.vocab_size, experts.num_experts_per_tok)
    else:
        out[f + "gate.bias"] = (experts.num_experts,)
    inner = experts.moe_intermediate_size
    for e in range(experts.num_experts):
        out.update(_mlp(f"{f}experts.{e}.", h, inner))
    out.update(_mlp(f + "shared_experts.", h, inner))
    return out


def _compressor(p: str, h: int, d: int, rate: int, series: int) -> dict[str, tuple[int, ...]]:
    return {
        p + "wkv.weight": (series * d, h),
        p + "wgate.weight": (series * d, h),
        p + "ape": (rate, series * d),
        p + "norm.weight": (d,),
    }


def _mlp(p: str, h: int, inner: int) -> dict[str, tuple[int, ...]]:
    return {p + "w1.weight": (inner, h), p + "w3.weight": (inner, h), p + "w2.weight": (h, inner)}


def is_routed_expert(name: str) -> bool:
    """Whether ``name`` is a routed expert's projection (FP4 in the release)."""
    return ".ffn.experts." in name and name.endswith((".w1.weight", ".w2.weight", ".w3.weight"))


def fp4_weight(c: ModelConfig, name: str) -> bool:
    """Whether the stored tensor ``name`` is an FP4 weight (the release's routed experts)."""
    return c.family_fields.fp4_experts and is_routed_expert(name)


def canonical_name(c: ModelConfig, name: str, mtp: bool) -> str | None:
    """kern's name for a stored deepseek_v4 tensor (either spelling), or None for one kern
    does not read (the MTP layers)."""
    if name.startswith(("mtp.", "model.mtp.")):
        return None
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    if name.startswith("layers."):
        name = "model." + name
    if name.endswith(".scale"):
        # DeepSeek's FP8 / FP4 block scales (transformers: weight_scale_inv).
        name = name[: -len(".scale")] + ".weight_scale_inv"
    return name


def released_name(name: str) -> str:
    """The released checkpoints' name for kern's tensor ``name`` (scales included)."""
    if name in _RELEASED:
        return _RELEASED[name]
    if name.endswith(".weight_scale_inv"):
        name = name[: -len(".weight_scale_inv")] + ".scale"
    return name.removeprefix("model.")
