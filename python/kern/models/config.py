"""A model's architecture as the runner needs it: one frozen :class:`ModelConfig`, its common
fields, the parts several families share, and each family's own fields hung on it.

Design notes
------------
* Every common field means one thing for every family: ``layer_types[i]`` is layer ``i``'s
  mixer (``full_attention``: it reads the cache's pages; ``linear_attention``: a recurrent
  state), ``mlp_layer_types[i]`` its MLP (``dense`` or ``sparse``: routed experts). What a
  family means beyond that (DeepSeek-V4's attention schedule, Qwen3-MoE's sparse step) is in
  ``family_fields``, the family's own frozen dataclass (``kern.models.<family>.config``).
* Parts that several families' layers share are their own dataclasses, None where a family
  has no such layer: ``experts`` (routed experts: qwen3_moe, deepseek_v3, kimi_linear,
  deepseek_v4), ``mla`` (multi-head latent attention: deepseek_v3, kimi_linear), ``delta``
  (delta-rule linear attention's sizes: qwen3_5, kimi_linear). The engine reads the parts
  (a slot's layout from ``delta``, a shard's sizes from ``experts``), never a family's own
  fields.
* ``transformers`` is kern's oracle, so a field a ``config.json`` leaves out takes the default
  transformers 5.23 gives it for that family; the core sizes (vocab, hidden, layers, heads)
  have no default: a checkpoint without them is broken. Everything wrong with a file is a
  ``CheckpointError`` naming the file and the field (``kern.checkpoint.errors``).
* Torch-free: ``kern serve`` checks a checkpoint's config before anything heavy loads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kern.checkpoint.errors import ConfigFieldError, UnsupportedModelError
from kern.checkpoint.fields import Fields

__all__ = [
    "LAYER_TYPES",
    "PER_HEAD",
    "Delta",
    "Experts",
    "CommonDefaults",
    "GroupRouting",
    "Mla",
    "ModelConfig",
    "common_fields",
    "count",
    "eos_ids",
    "fp8_block",
    "no_rope",
    "read_rope",
    "refuse_sliding_window",
    "token_id",
    "yarn",
    "yarn_mscale",
]

LAYER_TYPES = ("full_attention", "linear_attention")


@dataclass(frozen=True)
class Experts:
    """Routed experts: each token's MLP is the weighted sum of ``num_experts_per_tok`` of
    ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``; the top-k weights are
    renormalised to sum to 1 iff ``norm_topk_prob``."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    # Qwen's gated shared expert (qwen3_next, qwen3_5_moe): a SwiGLU of this width every
    # token runs, scaled by sigmoid(shared_expert_gate(x)); 0: none.
    shared_expert_intermediate_size: int = 0


@dataclass(frozen=True)
class GroupRouting:
    """DeepSeek's routing (deepseek_v3, kimi_linear): sigmoid scores plus a correction bias
    pick experts within the best ``topk_group`` of ``n_group`` groups; weights from the
    unbiased scores times ``routed_scaling_factor``; ``n_shared_experts`` always run."""

    n_group: int
    topk_group: int
    routed_scaling_factor: float
    n_shared_experts: int


@dataclass(frozen=True)
class Mla:
    """Multi-head latent attention: a token caches ``kv_lora_rank`` latent values and
    ``qk_rope_head_dim`` key values; ``q_lora_rank`` 0 means q_proj has no low rank.
    ``rotary`` False: no rotary embedding at all (the rope dims are cached unrotated);
    ``rope_interleave``: RoPE turns pairs (2i, 2i + 1)."""

    kv_lora_rank: int
    q_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = False
    rotary: bool = True


@dataclass(frozen=True)
class Delta:
    """The sizes of a delta-rule linear attention (qwen3_5's gated DeltaNet, kimi_linear's
    KDA): a state [num_value_heads, key_head_dim, value_head_dim] per layer and a depthwise
    causal conv of ``conv_kernel_dim`` over the q, k and v channels."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_dim: int

    @property
    def conv_dim(self) -> int:
        """Channels of the conv (q, k and v together)."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * (
            self.value_head_dim
        )


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one checkpoint, as the runner needs it (see the module notes).

    Immutable; ``kern.checkpoint.config.load_config`` builds it through the family's reader.
    """

    model_type: str  # the family kern runs (kern.models.registry), not the file's string
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
    # RoPE scaling: "default" or "yarn" (:func:`yarn`'s tuple in ``rope_yarn``).
    rope_type: str = "default"
    rope_yarn: tuple[float, ...] = ()
    # Per layer: the mixer ("full_attention" or "linear_attention") and the MLP ("dense" or
    # "sparse"); see the module notes.
    layer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    # FP8 block-scaled weights (DeepSeek's quantization_config): the block, or () for none.
    fp8_block: tuple[int, ...] = ()
    # Multi-token-prediction layers kern reads from the checkpoint (as a drafter), 0: none.
    num_mtp_layers: int = 0
    experts: Experts | None = None
    mla: Mla | None = None
    delta: Delta | None = None
    # The family's own fields (its frozen dataclass, kern.models.<family>.config), or None.
    family_fields: Any = None
    # The whole config.json as read (for a multimodal qwen3_5 file, text fields are in
    # raw["text_config"]). Excluded from equality and hashing: two files that describe the
    # same model compare equal.
    raw: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each attention head RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_sparse_layer(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` has routed experts (else a dense MLP)."""
        return self.mlp_layer_types[layer_id] == "sparse"

    def is_linear_layer(self, layer_id: int) -> bool:
        """Whether layer ``layer_id`` is linear attention (a recurrent state, no pages)."""
        return self.layer_types[layer_id] == "linear_attention"


# CommonDefaults.head_dim: hidden_size // num_attention_heads.
PER_HEAD = "hidden_size // num_attention_heads"


@dataclass(frozen=True)
class CommonDefaults:
    """What a family's files may leave out of the common fields, as transformers fills it."""

    kv_heads: int | None  # None: num_attention_heads
    head_dim: Any  # an int (or the file's value of another field, checked as head_dim), PER_HEAD
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    intermediate_size: bool = True  # False: the file has no dense width (read as 0)


def common_fields(
    f: Fields,
    raw: dict[str, Any],
    family: str,
    d: CommonDefaults,
    rope: Callable[[Fields], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The common fields of ``f`` (the text model's object of ``raw``), in the order their
    errors are raised; ``rope`` reads the RoPE fields (default :func:`read_rope`; a family
    that applies none or reads its own sets passes ``no_rope``). Raises ``CheckpointError``
    naming the field."""
    where = f.where
    text = f.raw
    num_layers = f.pos_int("num_hidden_layers")
    hidden = f.pos_int("hidden_size")
    heads = f.pos_int("num_attention_heads")
    kv_heads = f.pos_int("num_key_value_heads", default=d.kv_heads or heads)
    if heads % kv_heads:
        raise ConfigFieldError(
            f"{where}: num_attention_heads ({heads}) must be a multiple of "
            f"num_key_value_heads ({kv_heads})"
        )
    head_dim_default = hidden // heads if d.head_dim == PER_HEAD else d.head_dim
    hidden_act = f.text("hidden_act", default="silu")
    if hidden_act != "silu":
        raise UnsupportedModelError(f"{where}: hidden_act {hidden_act!r} is not supported (silu)")
    rope_fields = (rope or read_rope)(f)
    tie = text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    if not isinstance(tie, bool):
        raise ConfigFieldError(f"{where}: field 'tie_word_embeddings' must be a boolean")
    return dict(
        model_type=family,
        vocab_size=f.pos_int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=f.pos_int("intermediate_size") if d.intermediate_size else 0,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=f.pos_int("head_dim", default=head_dim_default),
        rms_norm_eps=f.number("rms_norm_eps", default=d.rms_norm_eps),
        **rope_fields,
        tie_word_embeddings=tie,
        # kimi_linear calls it model_max_length (transformers' attribute map).
        max_position_embeddings=f.pos_int(
            "model_max_length" if "model_max_length" in text else "max_position_embeddings",
            default=d.max_position_embeddings,
        ),
        attention_bias=f.flag("attention_bias", default=False),
        hidden_act=hidden_act,
        bos_token_id=token_id(text, raw, "bos_token_id", where),
        eos_token_ids=eos_ids(text, raw, where),
        pad_token_id=token_id(text, raw, "pad_token_id", where),
        raw=raw,
    )


def no_rope(f: Fields) -> dict[str, Any]:
    """The RoPE fields of a model that applies none or reads its own sets (kimi_linear,
    deepseek_v4): neutral values, nothing read."""
    return dict(rope_theta=10000.0, partial_rotary_factor=1.0, rope_type="default", rope_yarn=())


def read_rope(f: Fields, *, yarn_ok: bool = False, partial: float | None = None) -> dict[str, Any]:
    """``rope_theta``, ``partial_rotary_factor``, ``rope_type`` and ``rope_yarn`` from
    ``rope_parameters`` (transformers 5) or the pre-5.0 top level and ``rope_scaling``.
    ``yarn_ok``: the family runs YaRN (else only ``default`` is accepted); ``partial``: the
    family's default rotary fraction, read from the file (None: the whole head turns,
    whatever the file says, as transformers' default RoPE does for the Qwen3 families)."""
    where = f.where
    params = f.raw.get("rope_parameters")
    if params is None:
        params = f.raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ConfigFieldError(f"{where}: field 'rope_parameters' must be an object")
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling: tuple[float, ...] = ()
    if rope_type == "yarn" and yarn_ok:
        scaling = yarn(f, params)
    elif rope_type != "default":
        supported = "'default' and, for deepseek_v3 and gpt_oss, 'yarn'"
        raise UnsupportedModelError(
            f"{where}: rope_type {rope_type!r} is not supported (kern implements {supported})"
        )
    theta = params.get("rope_theta", f.raw.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 0:
        raise ConfigFieldError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    factor = 1.0
    if partial is not None:
        factor = params.get("partial_rotary_factor", f.raw.get("partial_rotary_factor", partial))
        if isinstance(factor, bool) or not isinstance(factor, int | float):
            raise ConfigFieldError(f"{where}: partial_rotary_factor must be a number")
        if not 0 < factor <= 1:
            raise ConfigFieldError(f"{where}: partial_rotary_factor {factor} is not in (0, 1]")
    return dict(
        rope_theta=float(theta),
        partial_rotary_factor=float(factor),
        rope_type=rope_type,
        rope_yarn=scaling,
    )


def refuse_sliding_window(f: Fields) -> None:
    """transformers' Qwen3 families may window some layers; kern runs full attention only."""
    if f.flag("use_sliding_window", default=False):
        raise UnsupportedModelError(
            f"{f.where}: use_sliding_window=true is not supported (kern runs full attention)"
        )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn(f: Fields, params: dict[str, Any]) -> tuple[float, ...]:
    """(factor, original_max_position_embeddings, beta_fast, beta_slow, mscale,
    mscale_all_dim, attention_factor (0: derived), truncate) as transformers reads them."""
    where = f.where

    def num(key: str, default: float | None) -> float:
        value = params.get(key, default)
        if value is None:
            value = default
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise ConfigFieldError(
                f"{where}: rope_parameters.{key} must be a number, got {value!r}"
            )
        return float(value)

    original = num(
        "original_max_position_embeddings",
        f.raw.get("original_max_position_embeddings", f.raw.get("max_position_embeddings")),
    )
    factor = params.get("factor")
    factor = num("factor", None) if factor is not None else None
    if factor is None:
        factor = f.pos_int("max_position_embeddings", default=4096) / original
    if factor <= 0 or original <= 0:
        raise ConfigFieldError(f"{where}: rope_parameters: yarn needs a positive factor")
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigFieldError(f"{where}: rope_parameters.truncate must be a boolean")
    return (
        factor,
        original,
        num("beta_fast", 32.0) or 32.0,
        num("beta_slow", 1.0) or 1.0,
        num("mscale", 0.0),
        num("mscale_all_dim", 0.0),
        num("attention_factor", 0.0),
        float(truncate),
    )


def count(f: Fields, key: str, default: int) -> int:
    """A field that may be 0 (a count), ``default`` when missing or null."""
    value = f.raw.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigFieldError(f"{f.where}: field {key!r} must be a count (>= 0), got {value!r}")
    return value


def fp8_block(qc: Any, where: str) -> tuple[int, ...]:
    """DeepSeek's released ``quantization_config`` (fp8, dynamic activations, 128 x 128
    weight blocks with ``weight_scale_inv``): the block; refused by name otherwise."""
    if qc is None:
        return ()
    if not isinstance(qc, dict):
        raise ConfigFieldError(f"{where}: field 'quantization_config' must be an object")
    method = qc.get("quant_method")
    block = qc.get("weight_block_size")
    if method != "fp8" or qc.get("fmt", "e4m3") != "e4m3":
        raise UnsupportedModelError(
            f"{where}: quantization_config quant_method {method!r} (fmt {qc.get('fmt')!r}) is not "
            "supported (kern reads DeepSeek's block-scaled 'fp8' e4m3 weights)"
        )
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ConfigFieldError(
            f"{where}: quantization_config.weight_block_size must be two positive ints, "
            f"got {block!r}"
        )
    return tuple(block)


def token_id(text: dict, raw: dict, key: str, where: str) -> int | None:
    """A single token id field (the text model's, else the top level's)."""
    value = text.get(key, raw.get(key))
    if isinstance(value, list):
        # Some files give a list; the first entry is the one a single-id field means.
        value = value[0] if value else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigFieldError(f"{where}: field {key!r} must be a token id, got {value!r}")
    return value


def eos_ids(text: dict, raw: dict, where: str) -> tuple[int, ...]:
    """``eos_token_id``: one id or a list, duplicates dropped, order kept."""
    value = text.get("eos_token_id", raw.get("eos_token_id"))
    if value is None:
        return ()
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigFieldError(f"{where}: field 'eos_token_id' must hold token ids, got {v!r}")
    return tuple(dict.fromkeys(values))
