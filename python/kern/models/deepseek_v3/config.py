"""The ``deepseek_v3`` family's config.json fields (DeepSeek-V3/R1, Kimi K2): latent attention
sizes, group-limited routing, multi-token-prediction layers, YaRN and FP8 quantisation, read as
transformers 5.23 reads them, with what kern cannot honour refused by name. Kimi K2 publishes
its text model as ``kimi_k2`` (these fields at the top level), Kimi K2.5 as the multimodal
``kimi_k25``, whose ``text_config`` is a ``deepseek_v3`` one.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from kern.checkpoint.errors import ConfigFieldError, UnsupportedModelError
from kern.checkpoint.fields import Fields
from kern.models.config import (
    CommonDefaults,
    Experts,
    GroupRouting,
    Mla,
    ModelConfig,
    common_fields,
    count,
    fp8_block,
    read_rope,
)

__all__ = ["DeepseekV3Fields", "read_config"]


@dataclass(frozen=True)
class DeepseekV3Fields:
    """The routing of the sparse layers and where they start (layers before
    ``first_k_dense_replace`` have a dense MLP; the MTP layers after the decoder's follow
    the same rule)."""

    routing: GroupRouting
    first_k_dense_replace: int


def read_config(f: Fields, raw: dict[str, Any]) -> ModelConfig:
    """A deepseek_v3 config (``f``: the text model's fields, ``raw``: the whole file)."""
    rope = functools.partial(read_rope, yarn_ok=True)
    heads_default = raw_rope_dims(f)
    common = common_fields(f, raw, "deepseek_v3", CommonDefaults(4, heads_default), rope)
    n, heads, where = common["num_hidden_layers"], common["num_attention_heads"], f.where
    q_lora = f.raw.get("q_lora_rank")
    if q_lora is not None:
        q_lora = f.pos_int("q_lora_rank")
    num_experts = f.raw.get("n_routed_experts", f.raw.get("num_local_experts"))
    num_experts = (
        0
        if num_experts is None
        else f.pos_int("n_routed_experts" if "n_routed_experts" in f.raw else "num_local_experts")
    )
    mla = Mla(
        kv_lora_rank=f.pos_int("kv_lora_rank", default=512),
        q_lora_rank=q_lora or 0,
        qk_nope_head_dim=f.pos_int("qk_nope_head_dim", default=128),
        qk_rope_head_dim=f.pos_int("qk_rope_head_dim", default=64),
        v_head_dim=f.pos_int("v_head_dim", default=128),
        rope_interleave=f.flag("rope_interleave", default=True),
    )
    top_k = f.pos_int("num_experts_per_tok", default=8) if num_experts else 0
    inner = f.pos_int("moe_intermediate_size", default=2048)
    norm_topk_prob = f.flag("norm_topk_prob", default=True)
    routing = GroupRouting(
        n_group=f.pos_int("n_group", default=8) if num_experts else 1,
        topk_group=f.pos_int("topk_group", default=4) if num_experts else 1,
        routed_scaling_factor=f.number("routed_scaling_factor", default=2.5),
        n_shared_experts=count(f, "n_shared_experts", 1),
    )
    first_dense = count(f, "first_k_dense_replace", 3)
    num_mtp = count(f, "num_nextn_predict_layers", count(f, "num_mtp_layers", 1))
    block = fp8_block(f.raw.get("quantization_config"), where)
    if mla.qk_rope_head_dim % 2:
        raise ConfigFieldError(f"{where}: qk_rope_head_dim must be even")
    if num_experts:
        check_groups(routing, num_experts, top_k, where)
    for key, expected in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        value = f.raw.get(key, expected)
        if value != expected:
            raise UnsupportedModelError(
                f"{where}: {key} {value!r} is not supported (deepseek_v3 routes with {expected!r})"
            )
    freq = f.raw.get("moe_layer_freq", 1)
    if freq != 1:
        raise UnsupportedModelError(f"{where}: moe_layer_freq {freq!r} is not supported (1)")
    experts = Experts(num_experts, top_k, inner, norm_topk_prob) if num_experts else None
    # transformers sets head_dim to the rotary dims (the part RoPE turns); MLA has no KV heads.
    common.update(head_dim=mla.qk_rope_head_dim, num_key_value_heads=heads)
    return ModelConfig(
        **common,
        layer_types=("full_attention",) * n,
        mlp_layer_types=tuple(
            "sparse" if experts is not None and i >= first_dense else "dense" for i in range(n)
        ),
        fp8_block=block,
        num_mtp_layers=num_mtp,
        experts=experts,
        mla=mla,
        family_fields=DeepseekV3Fields(routing, first_dense),
    )


def raw_rope_dims(f: Fields) -> Any:
    """The ``head_dim`` transformers gives a latent-attention file without one: its rope dims
    (read as they are; ``qk_rope_head_dim`` is checked where it is read)."""
    return f.raw.get("qk_rope_head_dim", 64)


def check_groups(routing: GroupRouting, num_experts: int, top_k: int, where: str) -> None:
    """Group-limited routing must be able to pick ``top_k`` experts."""
    e, g = num_experts, routing.n_group
    if e % g or e // g < 2:
        raise ConfigFieldError(
            f"{where}: n_routed_experts ({e}) must be a multiple of n_group ({g}) with at "
            "least 2 experts a group (a group scores its best two)"
        )
    if routing.topk_group > g:
        raise ConfigFieldError(f"{where}: topk_group ({routing.topk_group}) exceeds n_group ({g})")
    if top_k > routing.topk_group * (e // g):
        raise ConfigFieldError(
            f"{where}: num_experts_per_tok ({top_k}) exceeds the experts of topk_group groups"
        )
