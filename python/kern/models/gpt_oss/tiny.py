"""The tiny gpt_oss checkpoint's sizes, config.json and stored layout (``kern make-tiny
gpt_oss``): the experts fused as transformers' ``save_pretrained`` writes them, or with
``--fp8`` as the release stores them (MXFP4 blocks and scales, ``quantization_config``
``mxfp4``). A window of 8 keys, so short prompts already slide past it."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor

from kern.checkpoint.entries import FP4_VALUES
from kern.models.config import ModelConfig

__all__ = ["DEFAULTS", "TOKENIZERS", "config_json", "fuse", "quantize"]

# Harmony's markers as the last ids by default (kern serves gpt_oss in harmony); "json" writes
# the Qwen-style tokenizer the other families get.
TOKENIZERS = ("harmony", "json")

DEFAULTS: dict[str, Any] = dict(
    layers=4,
    hidden=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    intermediate=32,
    vocab=512,
    experts=8,
    experts_per_tok=2,
    sliding_window=8,
    yarn_factor=32.0,
)

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_up|down)_proj\.(\w+)$")


def config_json(a: dict[str, Any], cfg: dict[str, Any]) -> None:
    """The family's fields on ``cfg`` (the common ones, kern.tiny.config), sizes ``a``."""
    n = a["layers"]
    rope: dict[str, Any] = {"rope_theta": 150000.0, "rope_type": "default"}
    if a["yarn_factor"]:
        rope = {
            "rope_theta": 150000.0,
            "rope_type": "yarn",
            "factor": float(a["yarn_factor"]),
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        }
    if a["yarn_factor"]:  # the context YaRN stretches the original 4,096 positions to
        cfg["max_position_embeddings"] = int(4096 * a["yarn_factor"])
    cfg.update(
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        attention_bias=True,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
        num_local_experts=a["experts"],
        num_experts_per_tok=a["experts_per_tok"],
        output_router_logits=False,
        rms_norm_eps=1e-5,
        rope_parameters=rope,
        router_aux_loss_coef=0.001,
        sliding_window=a["sliding_window"],
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
    )
    if a["fp8"]:
        cfg["quantization_config"] = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        }


def quantize(tensors: dict[str, Tensor], block: tuple[int, int]) -> dict[str, Tensor]:
    """Each expert weight as MXFP4 (``block`` is the FP8 families'; MXFP4's is 32 inputs):
    ``.blocks`` [out, in / 32, 16] bytes of two e2m1 values (low nibble first) and
    ``.scales`` [out, in / 32] e8m0 bytes, the smallest power of two that fits each group."""
    values = torch.tensor(FP4_VALUES)
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        if not (_EXPERT.match(name) and name.endswith(".weight")):
            out[name] = t
            continue
        rows, cols = t.shape
        groups = t.float().reshape(rows, cols // 32, 32)
        top = groups.abs().amax(-1).clamp(min=1e-30)
        exponent = torch.ceil(torch.log2(top / 6.0)).clamp(-127, 127)
        scaled = groups / torch.exp2(exponent)[..., None]
        codes = (scaled[..., None] - values).abs().argmin(-1).to(torch.uint8)
        stem = name.removesuffix(".weight")
        out[stem + ".blocks"] = codes[..., 0::2] | (codes[..., 1::2] << 4)
        out[stem + ".scales"] = (exponent + 127).to(torch.uint8)
    return out


def fuse(config: ModelConfig, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per-expert tensors stacked into the stored fused ones (see the module notes): a bf16
    weight [out, in] stored [in, out] (``gate_up_proj``), biases as ``gate_up_proj_bias``,
    MXFP4 parts as ``gate_up_proj_blocks`` / ``_scales``."""
    out: dict[str, Tensor] = {}
    stacks: dict[str, dict[int, Tensor]] = {}
    for name, t in tensors.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
            continue
        base, expert, proj, leaf = m.groups()
        stored = f"{base}.{proj}_proj" + {"weight": "", "bias": "_bias"}.get(leaf, "_" + leaf)
        stacks.setdefault(stored, {})[int(expert)] = t.t() if leaf == "weight" else t
    for stored, parts in stacks.items():
        out[stored] = torch.stack([parts[x] for x in sorted(parts)]).contiguous()
    return out
