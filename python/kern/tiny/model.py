"""A tiny random-weight checkpoint folder: config.json, weights, generation config and the
tokenizer's files (``kern.tiny.tokenizer``), written bit-identically from the arguments. What
a family adds (its sizes, its config.json fields, a quantised format) is its tiny writer,
``kern.models.<family>.tiny``, named by its registry row.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kern.checkpoint.config import parse_config
from kern.checkpoint.load import parse_dtype
from kern.checkpoint.names import expected_shapes, mtp_shapes, stored_name
from kern.models import registry
from kern.models.config import ModelConfig
from kern.tiny.config import FP8_BLOCK
from kern.tiny.config import config_json as tiny_config_json
from kern.tiny.tokenizer import (
    HARMONY_TOKENS,
    build_tokenizer,
    harmony_tokenizer_config,
    tokenizer_config,
    write_tiktoken_tokenizer,
)

__all__ = ["DEFAULT_MODEL_ARGS", "make_tiny"]

# The embedded default model (python/kern/assets/tiny-qwen3) is make_tiny("qwen3", DIR,
# **DEFAULT_MODEL_ARGS); tests/test_tiny.py regenerates it and compares bytes.
DEFAULT_MODEL_ARGS: dict[str, Any] = {"seed": 0}


def make_tiny(
    family: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    fp8: bool = False,
    tie_embeddings: bool = False,
    dtype: str = "float32",
    shards: int = 1,
    tokenizer: str | None = None,
    overwrite: bool = False,
    max_position_embeddings: int | None = None,
    **sizes: Any,
) -> Path:
    """Write a random-weight checkpoint of ``family`` to ``out_dir``; returns ``out_dir``.

    ``sizes`` (``layers``, ``hidden``, ``experts``, ...; None: unset) take the family's tiny
    defaults (its writer's ``DEFAULTS``); one the family does not have is refused.
    ``dtype`` is the stored dtype (``float32``/``bfloat16``/``float16``); ``shards > 1`` writes
    ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``.
    ``tokenizer`` None is the writer's first ``TOKENIZERS`` ("json" unless it lists others);
    ``"harmony"`` (gpt_oss) puts gpt-oss's markers at the last ids, with no chat template.
    ``tokenizer="tiktoken"`` (a family whose writer lists it: kimi_linear) writes Kimi's
    ``tiktoken.model`` and ``tokenizer_config.json`` instead of ``tokenizer.json`` (its
    vocabulary sets the model's). ``fp8=True`` (a family whose writer has ``quantize``) writes
    the release's quantised format: for deepseek_v3 block-scaled FP8 projections with
    ``weight_scale_inv`` (:data:`kern.tiny.config.FP8_BLOCK`); for deepseek_v4 the release's
    names, config spelling, FP8 projections with e8m0 ``.scale`` blocks and FP4 routed
    experts. deepseek_v3's ``mtp_layers`` writes that many multi-token-prediction layers;
    ``yarn_factor`` > 0 sets YaRN RoPE scaling (deepseek_v4: its compressed layers').
    ``max_position_embeddings`` sets the context config.json declares (the families' tiny
    default otherwise; one whose config has no such key refuses it).

    Raises ``ValueError`` for an unknown family or an option that does not apply,
    :class:`~kern.checkpoint.errors.ConfigFieldError` for inconsistent sizes, and
    ``FileExistsError`` when ``out_dir`` is not empty and ``overwrite`` is false. Same
    arguments, same bytes.
    """
    if family not in registry.NAMES:
        raise ValueError(f"unknown family {family!r} (one of {', '.join(registry.NAMES)})")
    writer = registry.family(family).tiny_writer()
    args = _sizes(family, writer.DEFAULTS, sizes)
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    if fp8 and not hasattr(writer, "quantize"):
        raise ValueError(f"option 'fp8' does not apply to family {family!r}")
    args.update(fp8=fp8, fp8_block=FP8_BLOCK)
    storage_dtype = parse_dtype(dtype)
    kinds = getattr(writer, "TOKENIZERS", ("json",))
    tokenizer = kinds[0] if tokenizer is None else tokenizer
    if tokenizer not in ("json", "tiktoken", "harmony"):
        raise ValueError(f"tokenizer must be 'json', 'tiktoken' or 'harmony', got {tokenizer!r}")
    if tokenizer == "harmony" and tokenizer not in kinds:
        raise ValueError(f"tokenizer='harmony' (gpt-oss's markers) does not go with {family!r}")
    tiktoken_ok = "tiktoken" in kinds
    if tokenizer == "tiktoken" and (not tiktoken_ok or sizes.get("vocab") is not None):
        what = "option 'vocab'" if tiktoken_ok else f"family {family!r}"
        raise ValueError(
            f"tokenizer='tiktoken' (Kimi's, its own vocabulary) does not go with {what}"
        )
    with tempfile.TemporaryDirectory() as tmp:
        ids, eos_ids = _write_tokenizer(Path(tmp), tokenizer, args)
        config_json = tiny_config_json(family, args, ids, tie_embeddings, dtype)
        if max_position_embeddings is not None:
            if "max_position_embeddings" not in config_json:
                raise ValueError(
                    f"option 'max_position_embeddings' does not apply to family {family!r}"
                )
            if max_position_embeddings < 1:
                raise ValueError(
                    f"max_position_embeddings must be at least 1, got {max_position_embeddings}"
                )
            config_json["max_position_embeddings"] = max_position_embeddings
        config = parse_config(config_json, source=f"make_tiny({family!r})")
        out = Path(out_dir)
        if out.exists() and any(out.iterdir()) and not overwrite:
            raise FileExistsError(f"{out}: not empty (pass overwrite=True / --force to replace)")
        out.mkdir(parents=True, exist_ok=True)
        for file in sorted(Path(tmp).iterdir()):
            shutil.copyfile(file, out / file.name)
    tensors = _weights(config, seed, storage_dtype)
    if fp8:
        tensors = writer.quantize(tensors, FP8_BLOCK)
    if hasattr(writer, "fuse"):  # a family whose files store its experts fused (gpt_oss)
        tensors = writer.fuse(config, tensors)
    tensors = {stored_name(config, k): t for k, t in tensors.items()}
    _write_weights(out, tensors, shards)
    _write_json(out / "config.json", config_json)
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": ids["bos"], "eos_token_id": eos_ids, "pad_token_id": ids["pad"]},
    )
    return out


def _sizes(family: str, defaults: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """The family's default sizes with ``given`` (None: unset) over them."""
    args = dict(defaults)
    for key, value in given.items():
        if value is None:
            continue
        if key not in args:
            raise ValueError(f"option {key!r} does not apply to family {family!r}")
        args[key] = value
    return args


def _write_tokenizer(
    tmp: Path, tokenizer: str, args: dict[str, Any]
) -> tuple[dict[str, int], list[int]]:
    """The tokenizer's files in ``tmp``; the "bos", "eos" and "pad" ids and the end ids
    generation_config lists (a tiktoken tokenizer sets ``args["vocab"]``)."""
    if tokenizer == "tiktoken":
        kimi = write_tiktoken_tokenizer(tmp)
        args["vocab"] = kimi.vocab_size
        ids = {"bos": kimi.bos_token_id, "eos": kimi.eos_token_id}
        ids["pad"] = kimi.special_ids["[PAD]"]
        return ids, [kimi.eos_token_id, kimi.special_ids["[EOS]"]]
    if tokenizer == "harmony":
        fast, special_ids = build_tokenizer(args["vocab"], HARMONY_TOKENS)
        (tmp / "tokenizer.json").write_text(fast.to_str(pretty=True) + "\n", encoding="utf-8")
        _write_json(tmp / "tokenizer_config.json", harmony_tokenizer_config(special_ids))
        ids = {"bos": special_ids["<|startoftext|>"], "eos": special_ids["<|return|>"]}
        ids["pad"] = special_ids["<|endoftext|>"]
        return ids, [ids["eos"], ids["pad"], special_ids["<|call|>"]]
    fast, special_ids = build_tokenizer(args["vocab"])
    (tmp / "tokenizer.json").write_text(fast.to_str(pretty=True) + "\n", encoding="utf-8")
    _write_json(tmp / "tokenizer_config.json", tokenizer_config(special_ids))
    ids = {"bos": special_ids["<|endoftext|>"], "eos": special_ids["<|im_end|>"]}
    ids["pad"] = ids["bos"]
    return ids, [ids["eos"], ids["bos"]]


def _weights(config: ModelConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    writer = registry.of(config).tiny_writer()
    # A norm weight's neutral value: 1, or the family's (0 for zero-centred norms).
    center = getattr(writer, "norm_center", lambda name: 1.0)
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
            t = center(name) + 0.1 * noise
        elif leaf[-1] == "A_log":
            u = torch.rand(shape, generator=gen, dtype=torch.float32)
            t = torch.log(0.05 + 0.95 * u)
        elif leaf[-1] == "dt_bias":
            t = 1.0 + 0.1 * noise
        elif name.endswith("conv1d.weight"):
            t = noise / math.sqrt(shape[-1])
        elif name.endswith(".gate.tid2eid"):
            # Hash routing: each token's top-k distinct experts (an integer table).
            assert config.experts is not None
            num_experts = config.experts.num_experts
            order = torch.rand(config.vocab_size, num_experts, generator=gen).argsort(1)
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
