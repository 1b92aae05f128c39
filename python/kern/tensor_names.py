"""Which tensors a checkpoint of each family holds: their names (transformers'
``*ForCausalLM`` names, which are also the released checkpoints' for every family kern runs)
and shapes, and which stored names kern reads, and as what.

Design notes
------------
* A multimodal Qwen3.5 checkpoint stores its language model under ``model.language_model.``
  and Kimi K2.5 under ``language_model.``; those prefixes are removed, and vision towers and
  Qwen3.5's ``mtp.`` head are skipped without being read.
* DeepSeek-V3's multi-token-prediction layers are ``model.layers.<num_hidden_layers + k>``
  (a decoder block plus ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head``): read only for
  a target that drafts with them (``mtp``), skipped unread otherwise.
* Kimi-Linear's files (and transformers' ``save_pretrained`` of it) put every MLP under
  ``block_sparse_moe.`` and name the experts' projections ``w1``/``w3``/``w2``; kern reads
  them as ``mlp.`` and ``gate_proj``/``up_proj``/``down_proj``, the names it uses for every
  family. Its delta attention keeps the released names (``q_conv1d``, ``f_a_proj``, ...).
* Mixture-of-experts weights are the per-expert tensors of the published files
  (``mlp.experts.3.gate_proj.weight``), not transformers' fused in-memory layout; its
  ``save_pretrained`` writes them so too.
* DeepSeek-V4 has names of its own (``kern.deepseek_v4_tensors``): transformers'
  ``save_pretrained`` names, with the released files' spelling mapped to them.
"""

from __future__ import annotations

from kern.deepseek_v4_tensors import canonical_v4_name, v4_shapes
from kern.model_config import ModelConfig

__all__ = ["canonical_name", "expected_shapes", "head_name", "mtp_shapes", "stored_name"]

_KIMI_EXPERT_NAMES = (
    (".w1.weight", ".gate_proj.weight"),
    (".w3.weight", ".up_proj.weight"),
    (".w2.weight", ".down_proj.weight"),
)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``config`` must hold, with its shape.

    ``lm_head.weight`` (deepseek_v4: ``head.weight``) is left out when the embeddings are
    tied (it is optional then).
    """
    c = config
    if c.model_type == "deepseek_v4":
        return v4_shapes(c)
    h, v = c.hidden_size, c.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (v, h),
        "model.norm.weight": (h,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for i in range(c.num_hidden_layers):
        shapes.update(_decoder_layer(c, i))
    return shapes


def head_name(config: ModelConfig) -> str:
    """The output head's tensor name (optional when the embeddings are tied)."""
    return "head.weight" if config.model_type == "deepseek_v4" else "lm_head.weight"


def mtp_shapes(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """The tensors of a deepseek_v3 checkpoint's multi-token-prediction layers
    (``model.layers.<num_hidden_layers + k>.*``, DeepSeek's names) with their shapes, and
    the names among them a checkpoint may leave out (the layer's own copies of the
    embedding and the head, which are the model's)."""
    c = config
    h, v = c.hidden_size, c.vocab_size
    shapes: dict[str, tuple[int, ...]] = {}
    optional: set[str] = set()
    for k in range(c.num_mtp_layers):
        i = c.num_hidden_layers + k
        p = f"model.layers.{i}."
        shapes.update(_decoder_layer(c, i))
        shapes.update(
            {
                p + "enorm.weight": (h,),
                p + "hnorm.weight": (h,),
                p + "eh_proj.weight": (h, 2 * h),
                p + "shared_head.norm.weight": (h,),
                p + "shared_head.head.weight": (v, h),
                p + "embed_tokens.weight": (v, h),
            }
        )
        optional.update({p + "shared_head.head.weight", p + "embed_tokens.weight"})
    return shapes, optional


def _decoder_layer(c: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    h = c.hidden_size
    p = f"model.layers.{i}."
    shapes = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    # (deepseek_v3's MTP layers come after layer_types' last entry: latent, checked first.)
    if c.model_type == "kimi_linear" and c.is_linear_layer(i):
        shapes.update(_delta_attention(c, p + "self_attn."))
    elif c.latent_attention:
        shapes.update(_latent_attention(c, p + "self_attn."))
    elif c.is_linear_layer(i):
        shapes.update(_linear_attention(c, p + "linear_attn."))
    else:
        shapes.update(_attention(c, p + "self_attn."))
    if c.is_sparse_layer(i):
        shapes[p + "mlp.gate.weight"] = (c.num_experts, h)
        for e in range(c.num_experts):
            shapes.update(_mlp(h, c.moe_intermediate_size, f"{p}mlp.experts.{e}."))
        if c.model_type in ("deepseek_v3", "kimi_linear"):
            shapes[p + "mlp.gate.e_score_correction_bias"] = (c.num_experts,)
            if c.n_shared_experts:
                inner = c.moe_intermediate_size * c.n_shared_experts
                shapes.update(_mlp(h, inner, p + "mlp.shared_experts."))
    else:
        shapes.update(_mlp(h, c.intermediate_size, p + "mlp."))
    return shapes


def _latent_attention(c: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    h, heads = c.hidden_size, c.num_attention_heads
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    kv_a = c.kv_lora_rank + c.qk_rope_head_dim
    out = {
        p + "kv_a_proj_with_mqa.weight": (kv_a, h),
        p + "kv_a_layernorm.weight": (c.kv_lora_rank,),
        p + "kv_b_proj.weight": (heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
        p + "o_proj.weight": (h, heads * c.v_head_dim),
    }
    if c.q_lora_rank:
        out[p + "q_a_proj.weight"] = (c.q_lora_rank, h)
        out[p + "q_a_layernorm.weight"] = (c.q_lora_rank,)
        out[p + "q_b_proj.weight"] = (heads * qk, c.q_lora_rank)
    else:
        out[p + "q_proj.weight"] = (heads * qk, h)
    if c.attention_bias:
        if c.q_lora_rank:
            out[p + "q_a_proj.bias"] = (c.q_lora_rank,)
        out[p + "kv_a_proj_with_mqa.bias"] = (kv_a,)
        out[p + "o_proj.bias"] = (h,)
    return out


def _attention(c: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    q_width = c.num_attention_heads * c.head_dim
    kv_width = c.num_key_value_heads * c.head_dim
    # Qwen3.5's q_proj emits, per head, head_dim queries followed by head_dim gate logits.
    q_out = 2 * q_width if c.attn_output_gate else q_width
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


def _linear_attention(c: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    key_dim = c.linear_num_key_heads * c.linear_key_head_dim
    value_dim = c.linear_num_value_heads * c.linear_value_head_dim
    conv_dim = 2 * key_dim + value_dim
    nv = c.linear_num_value_heads
    return {
        p + "in_proj_qkv.weight": (conv_dim, c.hidden_size),
        p + "in_proj_z.weight": (value_dim, c.hidden_size),
        p + "in_proj_b.weight": (nv, c.hidden_size),
        p + "in_proj_a.weight": (nv, c.hidden_size),
        p + "conv1d.weight": (conv_dim, 1, c.linear_conv_kernel_dim),
        p + "dt_bias": (nv,),
        p + "A_log": (nv,),
        p + "norm.weight": (c.linear_value_head_dim,),
        p + "out_proj.weight": (c.hidden_size, value_dim),
    }


def _delta_attention(c: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """Kimi Delta Attention, in the released files' names (transformers' save_pretrained
    writes them so too)."""
    h, heads, d = c.hidden_size, c.linear_num_value_heads, c.linear_value_head_dim
    width = heads * d
    k = c.linear_conv_kernel_dim
    return {
        p + "q_proj.weight": (width, h),
        p + "k_proj.weight": (width, h),
        p + "v_proj.weight": (width, h),
        p + "q_conv1d.weight": (width, 1, k),
        p + "k_conv1d.weight": (width, 1, k),
        p + "v_conv1d.weight": (width, 1, k),
        p + "f_a_proj.weight": (d, h),
        p + "f_b_proj.weight": (width, d),
        p + "dt_bias": (width,),
        p + "A_log": (1, 1, heads, 1),
        p + "b_proj.weight": (heads, h),
        p + "g_a_proj.weight": (d, h),
        p + "g_b_proj.weight": (width, d),
        p + "o_norm.weight": (d,),
        p + "o_proj.weight": (h, width),
    }


def _mlp(hidden: int, inner: int, p: str) -> dict[str, tuple[int, ...]]:
    return {
        p + "gate_proj.weight": (inner, hidden),
        p + "up_proj.weight": (inner, hidden),
        p + "down_proj.weight": (hidden, inner),
    }


def canonical_name(config: ModelConfig, name: str, mtp: bool = False) -> str | None:
    """The name kern uses for a stored tensor, or None for a tensor kern does not read.
    ``mtp``: read a deepseek_v3 checkpoint's multi-token-prediction layers too."""
    if name.endswith(".rotary_emb.inv_freq"):  # a buffer some old exports saved
        return None
    if config.model_type == "deepseek_v4":
        return canonical_v4_name(name)
    if config.model_type == "qwen3_5":
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model.") :]
        if name.startswith(("model.visual.", "mtp.")):
            return None
    if config.model_type == "kimi_linear":
        # Kimi's files put the MLPs (dense or not) under block_sparse_moe. and name the
        # experts' projections w1 (gate), w3 (up), w2 (down).
        name = name.replace(".block_sparse_moe.", ".mlp.")
        for old, new in _KIMI_EXPERT_NAMES:
            if name.endswith(old) and ".experts." in name:
                name = name[: -len(old)] + new
    if config.model_type == "deepseek_v3":
        # Kimi K2.5 stores its text model under language_model. beside a vision tower.
        if name.startswith("language_model."):
            name = name[len("language_model.") :]
        elif name.startswith(("vision_tower.", "mm_projector.", "multi_modal_projector.")):
            return None
        if name.startswith("model.layers."):
            layer = name.split(".", 3)[2]
            if layer.isdigit() and int(layer) >= config.num_hidden_layers:
                # DeepSeek's MTP layers follow the decoder's; read only when drafting.
                keep = mtp and int(layer) < config.num_hidden_layers + config.num_mtp_layers
                return name if keep else None
    return name


def stored_name(config: ModelConfig, name: str) -> str:
    """The name a released checkpoint of ``config``'s family stores kern's tensor ``name``
    under (the inverse of :func:`canonical_name` for the names it renames)."""
    if config.model_type != "kimi_linear" or ".mlp." not in name:
        return name
    layer = int(name.split(".")[2])
    if not config.is_sparse_layer(layer):
        return name
    name = name.replace(".mlp.", ".block_sparse_moe.")
    if ".experts." in name:
        for old, new in _KIMI_EXPERT_NAMES:
            if name.endswith(new):
                name = name[: -len(new)] + old
    return name
