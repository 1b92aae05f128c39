"""The ``kimi_linear`` family's config.json fields (Kimi-Linear): Kimi Delta Attention beside
NoPE latent attention, with DeepSeek-style routing, read as transformers 5.23 reads them.

Design notes
------------
* Two spellings reach kern. Moonshot's released files nest the linear attention's sizes in
  ``linear_attn_config`` (``num_heads``, ``head_dim``, ``short_conv_kernel_size``, and the
  1-indexed layer lists ``kda_layers`` / ``full_attn_layers``) and name the routing fields
  ``num_experts``, ``num_experts_per_token``, ``num_shared_experts``, ``moe_renormalize``,
  ``num_expert_group``, ``first_k_dense_replace``. transformers' ``save_pretrained`` writes
  ``linear_head_dim``, ``linear_num_heads``, ``linear_conv_kernel_dim`` and the 0-indexed
  ``layer_types`` / ``mlp_layer_types`` at the top level, and may also write the released
  routing names (its attribute map). Both are read; a top-level ``layer_types`` wins over
  the lists, as transformers decides.
* KDA has one key head per value head and ``head_dim`` keys and values per head, so the
  sizes fill the delta-rule part (``ModelConfig.delta``) with equal key and value heads; the
  state slot's layout (``kern.engine.layout``) is then the same computation as Qwen3.5's.
* Latent attention here applies no rotary embedding at all (``mla_use_nope``): the
  ``qk_rope_head_dim`` key dims are cached unrotated. A file asking for RoPE
  (``mla_use_nope: false``, a ``rope_scaling``) is refused rather than silently run NoPE.
* Extensions of later Kimi/GLM releases that transformers' ``kimi_linear`` does not run
  (``gate_lower_bound``, ``use_full_rank_gate``) are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kern.checkpoint.errors import ConfigFieldError, UnsupportedModelError
from kern.checkpoint.fields import Fields
from kern.models.config import (
    CommonDefaults,
    Delta,
    Experts,
    GroupRouting,
    Mla,
    ModelConfig,
    common_fields,
    no_rope,
)

__all__ = ["KimiLinearFields", "read_config"]

MLP_TYPES = ("dense", "sparse")


@dataclass(frozen=True)
class KimiLinearFields:
    """DeepSeek's group-limited routing of the sparse layers (``mlp_layer_types``)."""

    routing: GroupRouting


def read_config(f: Fields, raw: dict[str, Any]) -> ModelConfig:
    """A kimi_linear config (see the module notes)."""
    defaults = CommonDefaults(
        kv_heads=None,
        head_dim=f.raw.get("qk_rope_head_dim", 64),
        rms_norm_eps=1e-5,
        max_position_embeddings=1048576,
    )
    common = common_fields(f, raw, "kimi_linear", defaults, no_rope)
    num_layers, heads, where = common["num_hidden_layers"], common["num_attention_heads"], f.where
    lac = f.raw.get("linear_attn_config") or {}
    if not isinstance(lac, dict):
        raise ConfigFieldError(f"{where}: field 'linear_attn_config' must be an object")
    for key in ("gate_lower_bound", "use_full_rank_gate"):
        if lac.get(key) not in (None, False):
            raise UnsupportedModelError(
                f"{where}: linear_attn_config.{key} {lac[key]!r} is not supported "
                "(kern runs Kimi-Linear's delta attention, which has neither)"
            )
    nope = f.raw.get("mla_use_nope", True)
    if nope is not True:
        raise UnsupportedModelError(
            f"{where}: mla_use_nope {nope!r} is not supported (kimi_linear's latent attention "
            "applies no rotary embedding)"
        )
    for key in ("rope_scaling", "rope_parameters"):
        value = f.raw.get(key)
        kind = value.get("rope_type", value.get("type")) if isinstance(value, dict) else value
        if kind not in (None, "default"):
            raise UnsupportedModelError(
                f"{where}: {key} {value!r} is not supported (kimi_linear applies no rotary "
                "embedding)"
            )
    activation = f.raw.get("moe_router_activation_func", "sigmoid")
    if activation != "sigmoid":
        raise UnsupportedModelError(
            f"{where}: moe_router_activation_func {activation!r} is not supported (sigmoid)"
        )
    linear_heads = _sub_int(f, lac, "num_heads", "linear_num_heads", 32, where)
    head_dim = _sub_int(f, lac, "head_dim", "linear_head_dim", 128, where)
    conv = _sub_int(f, lac, "short_conv_kernel_size", "linear_conv_kernel_dim", 4, where)
    if conv < 2:
        raise ConfigFieldError(f"{where}: the short conv's kernel size must be >= 2, got {conv}")
    num_experts = f.pos_int(_first(f, "num_experts", "num_local_experts", "n_routed_experts"))
    top_k = f.pos_int(_first(f, "num_experts_per_token", "num_experts_per_tok"), 8)
    groups = f.pos_int(_first(f, "num_expert_group", "n_group"), 1)
    topk_group = f.pos_int("topk_group", 1)
    e_per_group = num_experts // groups
    if num_experts % groups or e_per_group < 2:
        raise ConfigFieldError(
            f"{where}: the experts ({num_experts}) must split into num_expert_group ({groups}) "
            "equal groups of at least 2 (a group scores its best two)"
        )
    if topk_group > groups or top_k > topk_group * e_per_group:
        raise ConfigFieldError(
            f"{where}: num_experts_per_token ({top_k}) / topk_group ({topk_group}) exceed the "
            f"experts of the groups ({groups} of {e_per_group})"
        )
    shared = f.raw.get(_first(f, "num_shared_experts", "n_shared_experts"), 1)
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise ConfigFieldError(f"{where}: the shared experts must be a count, got {shared!r}")
    q_lora = f.raw.get("q_lora_rank")
    layer_types = _layer_types(f, lac, num_layers, where)
    mlp_layer_types = _mlp_layer_types(f, num_layers, where)
    delta = Delta(linear_heads, linear_heads, head_dim, head_dim, conv)
    mla = Mla(
        kv_lora_rank=f.pos_int("kv_lora_rank", 512),
        q_lora_rank=0 if q_lora is None else f.pos_int("q_lora_rank"),
        qk_nope_head_dim=f.pos_int("qk_nope_head_dim", 128),
        qk_rope_head_dim=f.pos_int("qk_rope_head_dim", 64),
        v_head_dim=f.pos_int("v_head_dim", 128),
        rotary=False,
    )
    experts = Experts(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=f.pos_int("moe_intermediate_size", 1024),
        norm_topk_prob=f.flag(_first(f, "moe_renormalize", "norm_topk_prob"), True),
    )
    routing = GroupRouting(
        n_group=groups,
        topk_group=topk_group,
        routed_scaling_factor=f.number("routed_scaling_factor", 2.446),
        n_shared_experts=shared,
    )
    # transformers sets head_dim to the rotary dims; latent attention has no KV heads.
    common.update(head_dim=mla.qk_rope_head_dim, num_key_value_heads=heads)
    return ModelConfig(
        **common,
        layer_types=layer_types,
        mlp_layer_types=mlp_layer_types,
        experts=experts,
        mla=mla,
        delta=delta,
        family_fields=KimiLinearFields(routing),
    )


def _first(f: Fields, *keys: str) -> str:
    """The first of ``keys`` the file has (the first of them when it has none)."""
    return next((k for k in keys if k in f.raw), keys[0])


def _sub_int(f: Fields, lac: dict, key: str, top: str, default: int, where: str) -> int:
    if key in lac:
        value = lac[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigFieldError(
                f"{where}: linear_attn_config.{key} must be a positive integer, got {value!r}"
            )
        return value
    return f.pos_int(top, default)


def _layer_types(f: Fields, lac: dict, num_layers: int, where: str) -> tuple[str, ...]:
    types = f.raw.get("layer_types")
    if types is None and "kda_layers" in lac and "full_attn_layers" in lac:
        types = [None] * num_layers
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear")):
            layers = lac[key]
            if not isinstance(layers, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 1 <= i <= num_layers
                for i in layers
            ):
                raise ConfigFieldError(
                    f"{where}: linear_attn_config.{key} must list layers 1..{num_layers} "
                    "(1-indexed)"
                )
            for i in layers:
                types[i - 1] = "linear_attention" if kind == "linear" else kind
        missing = [i + 1 for i, t in enumerate(types) if t is None]
        if missing:
            raise ConfigFieldError(
                f"{where}: linear_attn_config lists neither kda_layers nor full_attn_layers "
                f"for layers {missing} (1-indexed)"
            )
    elif types is None:
        # transformers' default: layers 4, 8, ... (0-indexed, not 0) are full attention.
        types = [
            "full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(num_layers)
        ]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ConfigFieldError(
            f"{where}: layer_types must be a list of num_hidden_layers ({num_layers}) entries"
        )
    for i, t in enumerate(types):
        if t not in ("full_attention", "linear_attention"):
            raise ConfigFieldError(
                f"{where}: layer_types[{i}] is {t!r}; expected full_attention or linear_attention"
            )
    return tuple(types)


def _mlp_layer_types(f: Fields, num_layers: int, where: str) -> tuple[str, ...]:
    types = f.raw.get("mlp_layer_types")
    if types is None:
        dense = f.raw.get("first_k_dense_replace", 1)
        if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
            raise ConfigFieldError(
                f"{where}: field 'first_k_dense_replace' must be a count, got {dense!r}"
            )
        freq = f.raw.get("moe_layer_freq", 1)
        if freq != 1:
            raise UnsupportedModelError(f"{where}: moe_layer_freq {freq!r} is not supported (1)")
        types = ["dense" if i < dense else "sparse" for i in range(num_layers)]
    if (
        not isinstance(types, list)
        or len(types) != num_layers
        or any(t not in MLP_TYPES for t in types)
    ):
        raise ConfigFieldError(
            f"{where}: mlp_layer_types must list 'dense' or 'sparse' for each of the "
            f"{num_layers} layers"
        )
    return tuple(types)
