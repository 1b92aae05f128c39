"""A tiny random-weight checkpoint folder: config.json, weights, generation config and the
tokenizer's files (``kern.tiny.tokenizer``), written bit-identically from the arguments.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import math
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kern.checkpoint import expected_shapes, mtp_shapes, parse_dtype
from kern.deepseek_v4_tensors import released_v4_name
from kern.model_config import FAMILIES, ModelConfig, parse_config
from kern.tensor_names import stored_name
from kern.tiny.config import DEFAULTS, FP8_BLOCK
from kern.tiny.config import config_json as tiny_config_json
from kern.tiny.quantize import quantize_v4
from kern.tiny.tokenizer import build_tokenizer, tokenizer_config, write_tiktoken_tokenizer

# The embedded default model (python/kern/assets/tiny-qwen3) is make_tiny("qwen3", DIR,
# **DEFAULT_MODEL_ARGS); tests/test_tiny.py regenerates it and compares bytes.
DEFAULT_MODEL_ARGS: dict[str, Any] = {"seed": 0}


def default_model_path() -> Path:
    """The tiny qwen3 checkpoint shipped inside the package (``kern serve`` with no model)."""
    path = importlib.resources.files("kern").joinpath("assets", "tiny-qwen3")
    if not isinstance(path, Path):
        # A zipped install: kern loads weights with mmap and needs real files.
        raise RuntimeError(f"the embedded model is not on the filesystem ({path})")
    return path


def make_tiny(
    family: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    intermediate: int | None = None,
    vocab: int | None = None,
    experts: int | None = None,
    experts_per_tok: int | None = None,
    moe_intermediate: int | None = None,
    norm_topk_prob: bool | None = None,
    decoder_sparse_step: int | None = None,
    mlp_only_layers: Sequence[int] | None = None,
    linear_key_heads: int | None = None,
    linear_value_heads: int | None = None,
    linear_key_head_dim: int | None = None,
    linear_value_head_dim: int | None = None,
    conv_kernel: int | None = None,
    full_attention_interval: int | None = None,
    kv_lora_rank: int | None = None,
    q_lora_rank: int | None = None,
    qk_nope_head_dim: int | None = None,
    qk_rope_head_dim: int | None = None,
    v_head_dim: int | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    shared_experts: int | None = None,
    first_k_dense: int | None = None,
    mtp_layers: int | None = None,
    yarn_factor: float | None = None,
    fp8: bool = False,
    tie_embeddings: bool = False,
    dtype: str = "float32",
    shards: int = 1,
    tokenizer: str = "json",
    overwrite: bool = False,
) -> Path:
    """Write a random-weight checkpoint of ``family`` to ``out_dir``; returns ``out_dir``.

    Sizes left as None take the family's tiny defaults (``kern.tiny.config.DEFAULTS``);
    options that do not apply to the family (``experts`` for ``qwen3``) must be None.
    ``dtype`` is the stored dtype (``float32``/``bfloat16``/``float16``); ``shards > 1`` writes
    ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``.
    ``tokenizer="tiktoken"`` (kimi_linear) writes Kimi's ``tiktoken.model`` and
    ``tokenizer_config.json`` instead of ``tokenizer.json`` (its vocabulary sets the model's).

    deepseek_v3: ``q_lora_rank=0`` gives a plain q_proj; ``mtp_layers`` writes that many
    multi-token-prediction layers in DeepSeek's names (``model.layers.<layers + k>.*``);
    ``yarn_factor`` > 0 sets YaRN RoPE scaling (mscale 1, as released); ``fp8=True`` stores
    the projections as block-scaled FP8 with ``weight_scale_inv`` (:data:`FP8_BLOCK`), as
    DeepSeek's release does (embeddings, heads, routers and norms stay float).

    deepseek_v4 (``kern.tiny.config.V4_FIXED`` has the sizes without an option): written as
    transformers' save_pretrained writes it; ``yarn_factor`` scales the compressed layers'
    RoPE; ``fp8=True`` writes the release's format instead: its names and config spelling,
    FP8 projections with e8m0 ``.scale`` blocks and FP4 routed experts
    (``kern.tiny.quantize``).

    Raises ``ValueError`` for an unknown family or an option that does not apply,
    :class:`~kern.model_config.ConfigFieldError` for inconsistent sizes, and ``FileExistsError``
    when ``out_dir`` is not empty and ``overwrite`` is false. Same arguments, same bytes.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} (one of {', '.join(FAMILIES)})")
    given = dict(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
        vocab=vocab,
        experts=experts,
        experts_per_tok=experts_per_tok,
        moe_intermediate=moe_intermediate,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=decoder_sparse_step,
        mlp_only_layers=mlp_only_layers,
        linear_key_heads=linear_key_heads,
        linear_value_heads=linear_value_heads,
        linear_key_head_dim=linear_key_head_dim,
        linear_value_head_dim=linear_value_head_dim,
        conv_kernel=conv_kernel,
        full_attention_interval=full_attention_interval,
        kv_lora_rank=kv_lora_rank,
        q_lora_rank=q_lora_rank,
        qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=v_head_dim,
        n_group=n_group,
        topk_group=topk_group,
        shared_experts=shared_experts,
        first_k_dense=first_k_dense,
        mtp_layers=mtp_layers,
        yarn_factor=yarn_factor,
    )
    args = dict(DEFAULTS[family])
    for key, value in given.items():
        if value is None:
            continue
        if key not in args:
            raise ValueError(f"option {key!r} does not apply to family {family!r}")
        args[key] = value
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    if fp8 and family not in ("deepseek_v3", "deepseek_v4"):
        raise ValueError(f"option 'fp8' does not apply to family {family!r}")
    args["fp8"] = fp8
    storage_dtype = parse_dtype(dtype)

    if tokenizer not in ("json", "tiktoken"):
        raise ValueError(f"tokenizer must be 'json' or 'tiktoken', got {tokenizer!r}")
    if tokenizer == "tiktoken" and (family != "kimi_linear" or vocab is not None):
        what = "option 'vocab'" if family == "kimi_linear" else f"family {family!r}"
        raise ValueError(
            f"tokenizer='tiktoken' (Kimi's, its own vocabulary) does not go with {what}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        if tokenizer == "tiktoken":
            kimi = write_tiktoken_tokenizer(Path(tmp))
            args["vocab"] = kimi.vocab_size
            ids = {"bos": kimi.bos_token_id, "eos": kimi.eos_token_id}
            ids["pad"] = kimi.special_ids["[PAD]"]
            eos_ids = [kimi.eos_token_id, kimi.special_ids["[EOS]"]]
        else:
            fast, special_ids = build_tokenizer(args["vocab"])
            (Path(tmp) / "tokenizer.json").write_text(
                fast.to_str(pretty=True) + "\n", encoding="utf-8"
            )
            _write_json(Path(tmp) / "tokenizer_config.json", tokenizer_config(special_ids))
            ids = {"bos": special_ids["<|endoftext|>"], "eos": special_ids["<|im_end|>"]}
            ids["pad"] = ids["bos"]
            eos_ids = [ids["eos"], ids["bos"]]
        config_json = tiny_config_json(family, args, ids, tie_embeddings, dtype)
        config = parse_config(config_json, source=f"make_tiny({family!r})")

        out = Path(out_dir)
        if out.exists() and any(out.iterdir()) and not overwrite:
            raise FileExistsError(f"{out}: not empty (pass overwrite=True / --force to replace)")
        out.mkdir(parents=True, exist_ok=True)
        for file in sorted(Path(tmp).iterdir()):
            shutil.copyfile(file, out / file.name)
    tensors = _weights(config, seed, storage_dtype)
    if fp8 and family == "deepseek_v4":
        tensors = {released_v4_name(k): t for k, t in quantize_v4(tensors, FP8_BLOCK).items()}
    elif fp8:
        tensors = quantize_fp8(tensors, FP8_BLOCK)
    tensors = {stored_name(config, k): t for k, t in tensors.items()}
    _write_weights(out, tensors, shards)
    _write_json(out / "config.json", config_json)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": ids["bos"], "eos_token_id": eos_ids, "pad_token_id": ids["pad"]},
    )
    return out


def _weights(config: ModelConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    zero_centered = config.model_type == "qwen3_5"
    tensors = {}
    shapes = expected_shapes(config)
    if config.num_mtp_layers:
        shapes.update(mtp_shapes(config)[0])
    for name, shape in shapes.items():
        digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        leaf = name.rsplit(".", 2)
        if name.endswith("norm.weight"):
            # linear_attn.norm is a plain gated RMSNorm (scales by w) even in Qwen3.5.
            plain = not zero_centered or name.endswith("linear_attn.norm.weight")
            t = (1.0 if plain else 0.0) + 0.1 * noise
        elif leaf[-1] == "A_log":
            u = torch.rand(shape, generator=gen, dtype=torch.float32)
            t = torch.log(0.05 + 0.95 * u)
        elif leaf[-1] == "dt_bias":
            t = 1.0 + 0.1 * noise
        elif name.endswith("conv1d.weight"):
            t = noise / math.sqrt(shape[-1])
        elif name.endswith(".gate.tid2eid"):
            # Hash routing: each token's top-k distinct experts (an integer table).
            order = torch.rand(config.vocab_size, config.num_experts, generator=gen).argsort(1)
            tensors[name] = order[:, : shape[1]].contiguous()
            continue
        elif name.endswith((".bias", "e_score_correction_bias")):
            t = 0.02 * noise
        elif name == "model.embed_tokens.weight":
            # Tied, the embedding is also the output head, and the residual stream carries the
            # last token's own row into its logits: at std 1 greedy text repeats one token from
            # the first step. The self term shrinks with the square of the scale, the others
            # linearly; at 1/(4 sqrt(hidden)) greedy text varies (logit std ~0.25).
            t = noise / (4 * math.sqrt(shape[1])) if config.tie_word_embeddings else noise
        else:  # projections, the router, lm_head: [out, in]
            t = noise / math.sqrt(shape[-1])
        tensors[name] = t.to(dtype).contiguous()
    for name in list(tensors):
        # An MTP layer's own embedding and head are copies of the model's (as released).
        if name.endswith(".embed_tokens.weight") and name != "model.embed_tokens.weight":
            tensors[name] = tensors["model.embed_tokens.weight"].clone()
        elif name.endswith(".shared_head.head.weight"):
            head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
            tensors[name] = tensors[head].clone()
    return tensors


def quantize_fp8(
    tensors: dict[str, torch.Tensor], block: tuple[int, int]
) -> dict[str, torch.Tensor]:
    """DeepSeek's FP8 release format: every projection weight (2-d, not an embedding, head or
    router) as float8_e4m3fn plus ``<name>_scale_inv``, one float32 scale (block amax / 448)
    per ``block``; other tensors unchanged."""
    out = {}
    for name, t in tensors.items():
        if t.dim() != 2 or name.endswith(("embed_tokens.weight", "head.weight", "gate.weight")):
            out[name] = t
            continue
        rows, cols = t.shape
        b0, b1 = block
        nr, nc = -(-rows // b0), -(-cols // b1)
        padded = torch.zeros(nr * b0, nc * b1)
        padded[:rows, :cols] = t.float()
        blocks = padded.view(nr, b0, nc, b1)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        q = (blocks / scale[:, None, :, None]).view(nr * b0, nc * b1)[:rows, :cols]
        out[name] = q.to(torch.float8_e4m3fn).contiguous()
        out[name + "_scale_inv"] = scale.contiguous()
    return out


def _write_weights(out: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    metadata = {"format": "pt"}
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata=metadata)
        return
    names = list(tensors)
    per = math.ceil(len(names) / shards)
    weight_map = {}
    total = 0
    for k in range(shards):
        part = {n: tensors[n] for n in names[k * per : (k + 1) * per]}
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(out / file), metadata=metadata)
        for n, t in part.items():
            weight_map[n] = file
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / "model.safetensors.index.json", index)


def _write_json(file: Path, value: Any) -> None:
    file.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
