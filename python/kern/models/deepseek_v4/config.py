"""The ``deepseek_v4`` family's config.json fields (DeepSeek-V4): the attention schedule
(sliding, compressed sparse and heavily compressed layers), hash and top-k routing,
hyper-connections, two RoPE sets and the release's FP8 / FP4 quantisation, read as
transformers 5.23's ``DeepseekV4Config`` reads them, with what kern cannot honour refused
by name.

Design notes
------------
* Legacy spellings the released files use are folded in as transformers does:
  ``compress_ratios`` (per layer 0 / 4 / 128, possibly with trailing MTP entries) gives
  ``layer_types``; ``compress_rate_csa`` / ``compress_rate_hca`` override
  ``compress_rates``; ``num_hash_layers`` gives ``mlp_layer_types``; ``qk_rope_head_dim``
  gives ``partial_rotary_factor`` when that is absent.
* RoPE: the sliding layers turn by the plain "main" set (``rope_theta``), the compressed
  layers by the "compress" set (``compress_rope_theta``, optionally YaRN). A flat
  ``rope_parameters`` / ``rope_scaling`` is the compress set's scaling, and its YaRN gets
  ``attention_factor`` 1.0 unless the file gives one (the V4 reference applies no mscale);
  a nested ``{"main", "compress"}`` is taken as written.
* transformers always builds one shared expert of ``moe_intermediate_size`` and always
  renormalises the routing weights, so ``n_shared_experts`` other than 1 is refused and
  ``norm_topk_prob`` is True. The MTP layers are read as a count only: kern does not run
  them, and their tensors (``mtp.*``) are skipped unread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kern.checkpoint.errors import ConfigFieldError, UnsupportedModelError
from kern.checkpoint.fields import Fields
from kern.models.config import (
    CommonDefaults,
    Experts,
    ModelConfig,
    common_fields,
    count,
    fp8_block,
    no_rope,
    yarn,
)

__all__ = ["CSA", "HCA", "MLP_TYPES", "SLIDING", "DeepseekV4Fields", "read_config"]

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
_RATIO_TYPES = {0: SLIDING, 4: CSA, 128: HCA}
MLP_TYPES = ("hash_moe", "moe")
_SCORING = ("sqrtsoftplus", "sigmoid")


@dataclass(frozen=True)
class DeepseekV4Fields:
    """What DeepSeek-V4 adds to the common fields (see the module notes): each layer's
    attention (``attention_types``: SLIDING, CSA or HCA) and routing (``moe_types``:
    ``hash_moe`` or ``moe``; every layer routes), the compression and window sizes, the
    hyper-connections, the indexer, the grouped output projection, and the compressed
    layers' RoPE set (the common ``rope_theta`` is the sliding layers')."""

    attention_types: tuple[str, ...]
    moe_types: tuple[str, ...]
    compress_rates: tuple[int, int]  # source tokens per CSA entry, per HCA entry
    sliding_window: int
    hc_mult: int  # hyper-connection streams
    hc_sinkhorn_iters: int
    hc_eps: float
    scoring_func: str  # router: sqrtsoftplus or sigmoid
    swiglu_limit: float  # clamp of the SwiGLU inputs
    routed_scaling_factor: float
    q_lora_rank: int
    rope_head_dim: int  # the trailing head dims RoPE turns
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    compress_rope_theta: float
    compress_rope_type: str  # "default" or "yarn"
    compress_rope_yarn: tuple[float, ...]
    # FP4 (e2m1) routed experts with an e8m0 scale per 32 inputs (the release's).
    fp4_experts: bool


def read_config(f: Fields, raw: dict[str, Any]) -> ModelConfig:
    """A deepseek_v4 config (see the module notes)."""
    defaults = CommonDefaults(kv_heads=1, head_dim=512, intermediate_size=False)
    common = common_fields(f, raw, "deepseek_v4", defaults, no_rope)
    num_layers, heads, where = common["num_hidden_layers"], common["num_attention_heads"], f.where
    kv_heads = f.raw.get("num_key_value_heads", 1)
    if kv_heads != 1:
        raise UnsupportedModelError(
            f"{where}: num_key_value_heads {kv_heads!r} is not supported (deepseek_v4 shares "
            "one key/value head across all query heads)"
        )
    if f.flag("mlp_bias", default=False):
        raise UnsupportedModelError(f"{where}: mlp_bias true is not supported (deepseek_v4)")
    scoring = f.text("scoring_func", default="sqrtsoftplus")
    if scoring not in _SCORING:
        raise UnsupportedModelError(
            f"{where}: scoring_func {scoring!r} is not supported (kern routes deepseek_v4 "
            f"with {' or '.join(repr(s) for s in _SCORING)})"
        )
    shared = count(f, "n_shared_experts", 1)
    if shared != 1:
        raise UnsupportedModelError(
            f"{where}: n_shared_experts {shared} is not supported (deepseek_v4 has exactly one "
            "shared expert of moe_intermediate_size)"
        )
    head_dim = f.pos_int("head_dim", default=512)
    layer_types = _layer_types(f, num_layers, where)
    num_experts = f.pos_int(
        "n_routed_experts" if "n_routed_experts" in f.raw else "num_local_experts", default=256
    )
    top_k = f.pos_int("num_experts_per_tok", default=6)
    if top_k > num_experts:
        raise ConfigFieldError(
            f"{where}: num_experts_per_tok ({top_k}) exceeds n_routed_experts ({num_experts})"
        )
    # transformers' attribute map reads intermediate_size as moe_intermediate_size.
    inner_key = "intermediate_size" if "moe_intermediate_size" not in f.raw else ""
    inner = f.pos_int(inner_key or "moe_intermediate_size", default=2048)
    o_groups = f.pos_int("o_groups", default=8)
    if heads * head_dim % o_groups:
        raise ConfigFieldError(
            f"{where}: num_attention_heads * head_dim ({heads * head_dim}) must be a multiple "
            f"of o_groups ({o_groups})"
        )
    swiglu = f.number("swiglu_limit", default=10.0)
    if not swiglu > 0:
        raise UnsupportedModelError(f"{where}: swiglu_limit {swiglu} is not supported (> 0)")
    own: dict[str, Any] = dict(
        routed_scaling_factor=f.number("routed_scaling_factor", default=1.5),
        scoring_func=scoring,
        q_lora_rank=f.pos_int("q_lora_rank", default=1024),
        attention_types=layer_types,
        moe_types=_mlp_layer_types(f, num_layers, where),
        compress_rates=_compress_rates(f, layer_types, where),
        sliding_window=f.pos_int("sliding_window", default=128),
        hc_mult=f.pos_int("hc_mult", default=4),
        hc_sinkhorn_iters=f.pos_int("hc_sinkhorn_iters", default=20),
        hc_eps=f.number("hc_eps", default=1e-6),
        swiglu_limit=swiglu,
        o_groups=o_groups,
        o_lora_rank=f.pos_int("o_lora_rank", default=1024),
        index_n_heads=f.pos_int("index_n_heads", default=64),
        index_head_dim=f.pos_int("index_head_dim", default=128),
        index_topk=f.pos_int("index_topk", default=512),
    )
    common.update(
        num_key_value_heads=1,
        head_dim=head_dim,
        intermediate_size=inner,
        max_position_embeddings=f.pos_int("max_position_embeddings", default=1048576),
        # transformers ignores attention_bias for V4 (no projection has a bias).
        attention_bias=False,
    )
    count(f, "num_nextn_predict_layers", 1)  # read: it must still be a count
    # transformers' defaults for the token ids (0 and 1) where the file has none.
    if "bos_token_id" not in f.raw:
        common["bos_token_id"] = 0
    if "eos_token_id" not in f.raw:
        common["eos_token_ids"] = (1,)
    rope = _rope(f, head_dim, where)
    common.update(rope_theta=rope.pop("rope_theta"))
    common.update(partial_rotary_factor=rope.pop("partial_rotary_factor"))
    block, fp4 = _quantization(f, where)
    return ModelConfig(
        **common,
        layer_types=("full_attention",) * num_layers,
        mlp_layer_types=("sparse",) * num_layers,
        fp8_block=block,
        # kern does not run V4's MTP layers: their tensors are skipped unread.
        num_mtp_layers=0,
        experts=Experts(num_experts, top_k, inner, norm_topk_prob=True),
        family_fields=DeepseekV4Fields(**own, **rope, fp4_experts=fp4),
    )


def _layer_types(f: Fields, n: int, where: str) -> tuple[str, ...]:
    types = f.raw.get("layer_types")
    key = "layer_types"
    if types is None and f.raw.get("compress_ratios") is not None:
        key = "compress_ratios"
        ratios = f.raw["compress_ratios"]
        if not isinstance(ratios, list):
            raise ConfigFieldError(f"{where}: compress_ratios must be a list of ints")
        types = []
        for i, r in enumerate(ratios):
            if isinstance(r, bool) or r not in _RATIO_TYPES:
                raise ConfigFieldError(
                    f"{where}: compress_ratios[{i}] is {r!r}; expected 0 (sliding), "
                    "4 (compressed sparse) or 128 (heavily compressed)"
                )
            types.append(_RATIO_TYPES[r])
    if types is None:
        # transformers' default: two HCA layers, then CSA and HCA alternating.
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    if not isinstance(types, list) or len(types) < n:
        raise ConfigFieldError(
            f"{where}: {key} must be a list of at least num_hidden_layers ({n}) entries"
        )
    # Released files list the MTP layers' entries after the decoder's; they are dropped.
    types = types[:n]
    for i, t in enumerate(types):
        if t not in (SLIDING, CSA, HCA):
            raise ConfigFieldError(
                f"{where}: layer_types[{i}] is {t!r}; expected one of {SLIDING}, {CSA}, {HCA}"
            )
    return tuple(types)


def _mlp_layer_types(f: Fields, n: int, where: str) -> tuple[str, ...]:
    types = f.raw.get("mlp_layer_types")
    if types is None:
        hashed = count(f, "num_hash_layers", 3)
        types = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    if not isinstance(types, list) or len(types) < n:
        raise ConfigFieldError(
            f"{where}: mlp_layer_types must be a list of at least num_hidden_layers ({n}) entries"
        )
    for i, t in enumerate(types[:n]):
        if t not in MLP_TYPES:
            raise ConfigFieldError(
                f"{where}: mlp_layer_types[{i}] is {t!r}; expected 'hash_moe' or 'moe'"
            )
    return tuple(types[:n])


def _compress_rates(f: Fields, layer_types: tuple[str, ...], where: str) -> tuple[int, int]:
    rates = f.raw.get("compress_rates")
    if rates is None:
        rates = {CSA: 4, HCA: 128}
    if not isinstance(rates, dict):
        raise ConfigFieldError(f"{where}: compress_rates must be an object")
    rates = dict(rates)
    for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if f.raw.get(legacy) is not None:
            rates[kind] = f.pos_int(legacy)
    out = []
    for kind in (CSA, HCA):
        rate = rates.get(kind)
        if rate is None and kind not in layer_types:
            out.append(0)
            continue
        if isinstance(rate, bool) or not isinstance(rate, int) or rate <= 0:
            raise ConfigFieldError(
                f"{where}: compress_rates.{kind} must be a positive integer, got {rate!r}"
            )
        out.append(rate)
    return out[0], out[1]


def _rope(f: Fields, head_dim: int, where: str) -> dict[str, Any]:
    partial = f.raw.get("partial_rotary_factor")
    if partial is None:
        legacy = f.raw.get("qk_rope_head_dim")
        partial = f.pos_int("qk_rope_head_dim") / head_dim if legacy is not None else 64 / 512
    if isinstance(partial, bool) or not isinstance(partial, int | float) or not 0 < partial <= 1:
        raise ConfigFieldError(f"{where}: partial_rotary_factor {partial!r} is not in (0, 1]")
    rope_dim = int(head_dim * partial)
    if rope_dim % 2 or rope_dim == 0:
        raise ConfigFieldError(
            f"{where}: the rotary dims (head_dim * partial_rotary_factor = {rope_dim}) must be "
            "even and positive"
        )
    theta = f.number("rope_theta", default=10000.0)
    compress_theta = f.number("compress_rope_theta", default=160000.0)
    params = f.raw.get("rope_scaling") or f.raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigFieldError(f"{where}: field 'rope_parameters' must be an object")
    label = "rope_parameters"
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = params["main"], dict(params["compress"])
        kind = main.get("rope_type", main.get("type", "default"))
        if kind != "default":
            raise UnsupportedModelError(
                f"{where}: rope_parameters.main rope_type {kind!r} is not supported (the "
                "sliding layers' RoPE is plain: 'default')"
            )
        # A nested set without rope_theta takes the top-level rope_theta (transformers).
        top = theta
        theta = _theta(main.get("rope_theta", top), "rope_parameters.main", where)
        compress_theta = _theta(compress.get("rope_theta", top), "rope_parameters.compress", where)
        for name, p in (("main", main), ("compress", compress)):
            factor = p.get("partial_rotary_factor", partial)
            if factor != partial:
                raise UnsupportedModelError(
                    f"{where}: rope_parameters.{name}.partial_rotary_factor {factor!r} differs "
                    f"from partial_rotary_factor {partial!r}; kern rotates one set of dims"
                )
        label = "rope_parameters.compress"
    else:
        compress = {k: v for k, v in params.items() if k not in ("main", "compress")}
        if compress.get("rope_type", compress.get("type", "default")) == "yarn":
            compress.setdefault("attention_factor", 1.0)
    kind = compress.get("rope_type", compress.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise UnsupportedModelError(
            f"{where}: {label} rope_type {kind!r} is not supported (kern implements 'default' "
            "and 'yarn' for deepseek_v4's compressed layers)"
        )
    return dict(
        rope_theta=theta,
        compress_rope_theta=compress_theta,
        partial_rotary_factor=float(partial),
        rope_head_dim=rope_dim,
        compress_rope_type=kind,
        compress_rope_yarn=yarn(f, compress) if kind == "yarn" else (),
    )


def _theta(value: Any, key: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigFieldError(f"{where}: {key}.rope_theta must be a positive number")
    if not math.isfinite(value):
        raise ConfigFieldError(f"{where}: {key}.rope_theta must be finite")
    return float(value)


def _quantization(f: Fields, where: str) -> tuple[tuple[int, ...], bool]:
    """The FP8 block (or none) and whether the routed experts are FP4."""
    qc = f.raw.get("quantization_config")
    block = fp8_block(qc, where)
    if not block:
        return (), False
    scale_fmt = qc.get("scale_fmt", "float")
    if scale_fmt not in ("float", "ue8m0"):
        raise UnsupportedModelError(
            f"{where}: quantization_config.scale_fmt {scale_fmt!r} is not supported "
            "('float' or 'ue8m0')"
        )
    # transformers folds a top-level expert_dtype into the quantization_config.
    expert_dtype = qc.get("expert_dtype", f.raw.get("expert_dtype", "fp8"))
    if expert_dtype not in ("fp8", "fp4"):
        raise UnsupportedModelError(
            f"{where}: quantization_config.expert_dtype {expert_dtype!r} is not supported "
            "('fp8' or 'fp4')"
        )
    return block, expert_dtype == "fp4"
