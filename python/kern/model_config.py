"""Model configuration: one frozen value parsed from a checkpoint's ``config.json``.

Design notes
------------
* ``transformers`` is kern's oracle, so a field that a ``config.json`` leaves out takes the
  default that transformers 5.23 gives it for that family (``head_dim`` is 128 for ``qwen3``,
  256 for ``qwen3_5`` and ``hidden_size // num_attention_heads`` for ``qwen3_moe``;
  ``partial_rotary_factor`` is 0.25 for ``qwen3_5``). The core sizes (vocab, hidden, layers,
  heads, intermediate) have no default here: a checkpoint without them is broken, and guessing
  a 151936-token vocabulary would only move the error somewhere less clear.
* ``model_type`` is the *family* kern runs, not the string in the file: a Qwen3.5 checkpoint
  is published as the multimodal ``qwen3_5`` (text fields nested under ``text_config``) or as
  the text-only ``qwen3_5_text``; both parse to ``model_type == "qwen3_5"``. ``raw`` keeps the
  whole file as read.
* transformers 5 moved ``rope_theta`` (and ``partial_rotary_factor``) into ``rope_parameters``;
  older files keep them at the top level. Both are read. Rope types other than ``default``
  (yarn, linear, dynamic) are refused here: the runner implements plain RoPE, and a model run
  with the wrong rotation gives fluent-looking wrong answers rather than an error.
* Everything that is wrong with a file is a ``CheckpointError`` (a ``ValueError``) whose message
  names the file and the field, so that ``kern run`` and ``kern serve`` can print it as is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kern.checkpoint_errors import (
    CheckpointError,
    ConfigFieldError,
    MissingFileError,
    UnsupportedModelError,
)
from kern.config_fields import Fields

__all__ = [
    "FAMILIES",
    "CheckpointError",
    "ConfigFieldError",
    "MissingFileError",
    "ModelConfig",
    "UnsupportedModelError",
    "load_config",
    "parse_config",
]

FAMILIES = ("qwen3", "qwen3_5", "qwen3_moe", "deepseek_v3", "kimi_linear", "deepseek_v4")

# model_type strings found in config.json files, mapped to the family kern runs them as.
# Kimi K2 publishes its text model as ``kimi_k2`` (DeepSeek-V3's fields at the top level);
# Kimi K2.5 as the multimodal ``kimi_k25``, whose ``text_config`` is a ``deepseek_v3`` one.
_MODEL_TYPES = {
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "kimi_k25": "deepseek_v3",
    "kimi_linear": "kimi_linear",
    "deepseek_v4": "deepseek_v4",
}

LAYER_TYPES = ("full_attention", "linear_attention")
V4_ATTENTION_TYPES = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one checkpoint, as the runner needs it.

    Immutable; build it with :func:`load_config` or :func:`parse_config`. Fields that do not
    apply to a family hold neutral values (``num_experts == 0`` for dense models, empty linear
    attention sizes for ``qwen3``), so the runner can read them without checking the family.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # Fraction of each head's dims that RoPE rotates (the first ``rotary_dim`` of them).
    partial_rotary_factor: float = 1.0
    # Per layer: "full_attention" or "linear_attention" (the latter only for qwen3_5).
    layer_types: tuple[str, ...] = ()
    # Mixture of experts (qwen3_moe). A layer is sparse when it is not in mlp_only_layers and
    # (layer + 1) % decoder_sparse_step == 0, exactly as transformers decides it.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Gated DeltaNet linear attention (qwen3_5).
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # qwen3_5 full attention: q_proj emits a sigmoid gate beside the queries (2x its width).
    attn_output_gate: bool = False
    # Multi-head latent attention (deepseek_v3): a token caches kv_lora_rank latent values
    # and qk_rope_head_dim rotated key values; q_lora_rank 0 means q_proj has no low rank.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    # DeepSeek routing: sigmoid scores plus a correction bias pick experts within the best
    # topk_group of n_group groups; weights from the unbiased scores x routed_scaling_factor.
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    num_mtp_layers: int = 0
    # RoPE scaling: "default" or "yarn" (deepseek_v3; kern.deepseek_config.yarn's tuple).
    rope_type: str = "default"
    rope_yarn: tuple[float, ...] = ()
    # FP8 block-scaled weights (DeepSeek's quantization_config): the block, or () for none.
    fp8_block: tuple[int, ...] = ()
    # Per layer "dense" or "sparse" (kimi_linear's mlp_layer_types); () where the family
    # decides by first_k_dense_replace or decoder_sparse_step.
    mlp_layer_types: tuple[str, ...] = ()
    # Latent attention without any rotary embedding (kimi_linear): the rope dims are cached
    # unrotated.
    mla_use_nope: bool = False
    # DeepSeek-V4 (deepseek_v4): layer_types holds each layer's attention (V4_ATTENTION_TYPES)
    # and mlp_layer_types its routing ("hash_moe" or "moe"); rope_theta is the sliding layers'
    # plain RoPE, compress_rope_theta (scaled by rope_type / rope_yarn) the compressed layers'.
    compress_rates: tuple[int, int] = (0, 0)  # source tokens per CSA entry, per HCA entry
    sliding_window: int = 0
    compress_rope_theta: float = 0.0
    hc_mult: int = 0  # hyper-connection streams
    hc_sinkhorn_iters: int = 0
    hc_eps: float = 0.0
    scoring_func: str = "sigmoid"  # router: sigmoid (deepseek_v3) or sqrtsoftplus
    swiglu_limit: float = 0.0  # clamp of the SwiGLU inputs; 0: none
    o_groups: int = 0
    o_lora_rank: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    # FP4 (e2m1) routed experts with an e8m0 scale per 32 inputs (DeepSeek-V4's release).
    fp4_experts: bool = False
    # The whole config.json as read (for a multimodal qwen3_5 file, text fields are in
    # raw["text_config"]). Excluded from equality and hashing: two files that describe the
    # same model compare equal.
    raw: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each attention head RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def latent_attention(self) -> bool:
        """Whether attention caches one latent per token (MLA) instead of K/V per head."""
        return self.kv_lora_rank > 0

    def is_sparse_layer(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` has a mixture-of-experts MLP (else a dense one)."""
        if self.model_type == "deepseek_v4":
            return True  # every layer routes (hash_moe or moe)
        if self.mlp_layer_types:
            return self.num_experts > 0 and self.mlp_layer_types[layer_id] == "sparse"
        if self.model_type == "deepseek_v3":
            return self.num_experts > 0 and layer_id >= self.first_k_dense_replace
        return (
            self.num_experts > 0
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    def is_linear_layer(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` is gated DeltaNet linear attention (else full attention)."""
        return self.layer_types[layer_id] == "linear_attention"


def load_config(path: str | Path) -> ModelConfig:
    """Read ``config.json`` from a checkpoint folder (or the file itself).

    Raises :class:`MissingFileError`, :class:`UnsupportedModelError`, :class:`ConfigFieldError`.
    """
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise MissingFileError(f"{file}: no such file (a checkpoint folder needs config.json)")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON: {e}") from e
    return parse_config(raw, source=str(file))


def parse_config(raw: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
    """Build a :class:`ModelConfig` from a parsed ``config.json``; ``source`` names it in errors."""
    if not isinstance(raw, dict):
        raise ConfigFieldError(f"{source}: expected a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    family = _MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise UnsupportedModelError(
            f"{source}: model_type {model_type!r} is not supported "
            f"(kern runs {', '.join(repr(t) for t in sorted(_MODEL_TYPES))})"
        )
    text = raw
    where = source
    if model_type in ("qwen3_5", "kimi_k25") and "text_config" in raw:
        # The multimodal Qwen3.5 config: the language model's fields live in text_config.
        text = raw["text_config"]
        where = f"{source} (text_config)"
        if not isinstance(text, dict):
            raise ConfigFieldError(f"{source}: field 'text_config' must be an object")
    f = Fields(text, where)

    num_layers = f.pos_int("num_hidden_layers")
    hidden = f.pos_int("hidden_size")
    heads = f.pos_int("num_attention_heads")
    kv_default = {"qwen3": heads, "kimi_linear": heads, "deepseek_v4": 1}.get(family, 4)
    kv_heads = f.pos_int("num_key_value_heads", default=kv_default)
    if heads % kv_heads:
        raise ConfigFieldError(
            f"{where}: num_attention_heads ({heads}) must be a multiple of "
            f"num_key_value_heads ({kv_heads})"
        )
    head_dim_default = {
        "qwen3": 128,
        "qwen3_5": 256,
        "qwen3_moe": hidden // heads,
        "deepseek_v3": f.raw.get("qk_rope_head_dim", 64),
        "kimi_linear": f.raw.get("qk_rope_head_dim", 64),
        "deepseek_v4": 512,
    }[family]
    hidden_act = f.text("hidden_act", default="silu")
    if hidden_act != "silu":
        raise UnsupportedModelError(f"{where}: hidden_act {hidden_act!r} is not supported (silu)")

    if family in ("kimi_linear", "deepseek_v4"):
        # kimi_linear: no rotary embedding anywhere; deepseek_v4: two RoPE sets, read by
        # kern.deepseek_v4_config (kern.kimi_config refuses a file that asks for RoPE).
        rope_theta, partial_rotary, rope_type, rope_yarn = 10000.0, 1.0, "default", ()
    else:
        rope_theta, partial_rotary, rope_type, rope_yarn = _rope(f, family, where)

    tie = text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    if not isinstance(tie, bool):
        raise ConfigFieldError(f"{where}: field 'tie_word_embeddings' must be a boolean")

    common: dict[str, Any] = dict(
        model_type=family,
        vocab_size=f.pos_int("vocab_size"),
        hidden_size=hidden,
        # deepseek_v4 files have only moe_intermediate_size (kern.deepseek_v4_config).
        intermediate_size=0 if family == "deepseek_v4" else f.pos_int("intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=f.pos_int("head_dim", default=head_dim_default),
        rms_norm_eps=f.number("rms_norm_eps", default=1e-5 if family == "kimi_linear" else 1e-6),
        rope_theta=rope_theta,
        partial_rotary_factor=partial_rotary,
        rope_type=rope_type,
        rope_yarn=rope_yarn,
        tie_word_embeddings=tie,
        # kimi_linear calls it model_max_length (transformers' attribute map).
        max_position_embeddings=f.pos_int(
            "model_max_length" if "model_max_length" in text else "max_position_embeddings",
            default=1048576 if family == "kimi_linear" else 32768,
        ),
        attention_bias=f.flag("attention_bias", default=False),
        hidden_act=hidden_act,
        bos_token_id=_token_id(text, raw, "bos_token_id", where),
        eos_token_ids=_eos_ids(text, raw, where),
        pad_token_id=_token_id(text, raw, "pad_token_id", where),
        raw=raw,
    )

    if family == "qwen3_5":
        common.update(_qwen3_5_fields(f, num_layers, where))
    elif family == "deepseek_v3":
        common["layer_types"] = ("full_attention",) * num_layers
        from kern.deepseek_config import deepseek_v3_fields

        common.update(deepseek_v3_fields(f, num_layers, heads, where))
        # transformers sets head_dim to the rotary dims (the part RoPE turns).
        common["head_dim"] = common["qk_rope_head_dim"]
        common["num_key_value_heads"] = heads
    elif family == "deepseek_v4":
        from kern.deepseek_v4_config import deepseek_v4_fields

        common.update(deepseek_v4_fields(f, num_layers, heads, where))
    elif family == "kimi_linear":
        from kern.kimi_config import kimi_linear_fields

        common.update(kimi_linear_fields(f, num_layers, where))
        common["head_dim"] = common["qk_rope_head_dim"]
        common["num_key_value_heads"] = heads
    else:
        if f.flag("use_sliding_window", default=False):
            raise UnsupportedModelError(
                f"{where}: use_sliding_window=true is not supported (kern runs full attention)"
            )
        common["layer_types"] = ("full_attention",) * num_layers
    if family == "qwen3_moe":
        common.update(_moe_fields(f, num_layers, where))
    return ModelConfig(**common)


def _rope(f: Fields, family: str, where: str) -> tuple[float, float, str, tuple[float, ...]]:
    params = f.raw.get("rope_parameters")
    if params is None:
        # Pre-5.0 files: rope_theta at the top level, scaling in rope_scaling.
        params = f.raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigFieldError(f"{where}: field 'rope_parameters' must be an object")
    rope_type = params.get("rope_type", params.get("type", "default"))
    yarn: tuple[float, ...] = ()
    if rope_type == "yarn" and family == "deepseek_v3":
        from kern.deepseek_config import yarn as parse_yarn

        yarn = parse_yarn(f, params, where)
    elif rope_type != "default":
        supported = "'default' and, for deepseek_v3, 'yarn'"
        raise UnsupportedModelError(
            f"{where}: rope_type {rope_type!r} is not supported (kern implements {supported})"
        )
    theta = params.get("rope_theta", f.raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 0:
        raise ConfigFieldError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    partial = 1.0
    if family == "qwen3_5":
        # qwen3 and qwen3_moe rotate the whole head whatever the file says (transformers'
        # default RoPE for them ignores the factor); qwen3_5 defaults to a quarter of it.
        partial = params.get("partial_rotary_factor", f.raw.get("partial_rotary_factor", 0.25))
        if isinstance(partial, bool) or not isinstance(partial, int | float):
            raise ConfigFieldError(f"{where}: partial_rotary_factor must be a number")
        if not 0 < partial <= 1:
            raise ConfigFieldError(f"{where}: partial_rotary_factor {partial} is not in (0, 1]")
    return float(theta), float(partial), rope_type, yarn


def _qwen3_5_fields(f: Fields, num_layers: int, where: str) -> dict[str, Any]:
    layer_types = f.raw.get("layer_types")
    if layer_types is None:
        # transformers derives the pattern from full_attention_interval (default 4): every
        # interval-th layer is full attention, the others linear.
        interval = f.pos_int("full_attention_interval", default=4)
        layer_types = [
            "linear_attention" if (i + 1) % interval else "full_attention"
            for i in range(num_layers)
        ]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ConfigFieldError(
            f"{where}: layer_types must be a list of num_hidden_layers ({num_layers}) entries"
        )
    for i, t in enumerate(layer_types):
        if t not in LAYER_TYPES:
            raise ConfigFieldError(
                f"{where}: layer_types[{i}] is {t!r}; expected one of {', '.join(LAYER_TYPES)}"
            )
    out: dict[str, Any] = dict(
        layer_types=tuple(layer_types),
        linear_num_key_heads=f.pos_int("linear_num_key_heads", default=16),
        linear_num_value_heads=f.pos_int("linear_num_value_heads", default=32),
        linear_key_head_dim=f.pos_int("linear_key_head_dim", default=128),
        linear_value_head_dim=f.pos_int("linear_value_head_dim", default=128),
        linear_conv_kernel_dim=f.pos_int("linear_conv_kernel_dim", default=4),
        # transformers' Qwen3.5 attention always gates; the field exists in published files.
        attn_output_gate=f.flag("attn_output_gate", default=True),
    )
    if not out["attn_output_gate"]:
        raise UnsupportedModelError(f"{where}: attn_output_gate=false is not supported")
    if out["linear_num_value_heads"] % out["linear_num_key_heads"]:
        raise ConfigFieldError(
            f"{where}: linear_num_value_heads ({out['linear_num_value_heads']}) must be a "
            f"multiple of linear_num_key_heads ({out['linear_num_key_heads']})"
        )
    return out


def _moe_fields(f: Fields, num_layers: int, where: str) -> dict[str, Any]:
    # transformers 5 writes num_experts as num_local_experts (an attribute_map alias).
    key = "num_experts" if "num_experts" in f.raw else "num_local_experts"
    num_experts = f.pos_int(key)
    top_k = f.pos_int("num_experts_per_tok")
    if top_k > num_experts:
        raise ConfigFieldError(
            f"{where}: num_experts_per_tok ({top_k}) exceeds {key} ({num_experts})"
        )
    mlp_only = f.raw.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in mlp_only
    ):
        raise ConfigFieldError(
            f"{where}: mlp_only_layers must be a list of layer indices below {num_layers}"
        )
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=f.pos_int("moe_intermediate_size"),
        norm_topk_prob=f.flag("norm_topk_prob", default=False),
        decoder_sparse_step=f.pos_int("decoder_sparse_step", default=1),
        mlp_only_layers=tuple(sorted(set(mlp_only))),
    )


def _token_id(text: dict, raw: dict, key: str, where: str) -> int | None:
    value = text.get(key, raw.get(key))
    if isinstance(value, list):
        # Some files give a list; the first entry is the one a single-id field means.
        value = value[0] if value else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigFieldError(f"{where}: field {key!r} must be a token id, got {value!r}")
    return value


def _eos_ids(text: dict, raw: dict, where: str) -> tuple[int, ...]:
    value = text.get("eos_token_id", raw.get("eos_token_id"))
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigFieldError(f"{where}: field 'eos_token_id' must hold token ids, got {v!r}")
    return tuple(dict.fromkeys(values))
