"""``kern make-tiny``: write a small random-weight checkpoint (kern.tiny), deterministic from
``--seed``. Every size flag maps one to one to a :func:`kern.tiny.make_tiny` keyword; an unset
one takes the family's tiny default, and one that does not apply to the family is refused by
``make_tiny`` (exit 2).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kern.cli.args import count, index_list, positive_int
from kern.errors import UsageError
from kern.models.registry import NAMES as FAMILIES

__all__ = ["add_parser", "run"]

_SIZE_FLAGS = {
    # flag: (make_tiny keyword, help)
    "--layers": ("layers", "decoder layers"),
    "--hidden": ("hidden", "hidden size"),
    "--heads": ("heads", "attention heads"),
    "--kv-heads": ("kv_heads", "key/value heads"),
    "--head-dim": ("head_dim", "dims per attention head"),
    "--intermediate": ("intermediate", "dense MLP width (gpt_oss: each expert's)"),
    "--sliding-window": ("sliding_window", "gpt_oss, deepseek_v4: keys a sliding window holds"),
    "--vocab": ("vocab", "vocabulary size (tokenizer and embedding)"),
    "--experts": (
        "experts",
        "the MoE families (qwen3_moe, qwen3_next, qwen3_5_moe, gpt_oss, deepseek_v3/v4, "
        "kimi_linear): routed experts per layer",
    ),
    "--experts-per-tok": (
        "experts_per_tok",
        "the MoE families: experts each token is routed to",
    ),
    "--moe-intermediate": (
        "moe_intermediate",
        "the MoE families: expert MLP width",
    ),
    "--shared-expert-intermediate": (
        "shared_expert_intermediate",
        "qwen3_next, qwen3_5_moe: the gated shared expert's width",
    ),
    "--linear-key-heads": (
        "linear_key_heads",
        "qwen3_5, qwen3_5_moe, qwen3_next: DeltaNet key heads",
    ),
    "--linear-value-heads": (
        "linear_value_heads",
        "qwen3_5, qwen3_5_moe, qwen3_next: DeltaNet value heads; kimi_linear: KDA heads",
    ),
    "--linear-key-head-dim": (
        "linear_key_head_dim",
        "qwen3_5, qwen3_5_moe, qwen3_next: DeltaNet key head dims",
    ),
    "--linear-value-head-dim": (
        "linear_value_head_dim",
        "qwen3_5, qwen3_5_moe, qwen3_next: DeltaNet value head dims; kimi_linear: KDA head dims",
    ),
    "--conv-kernel": (
        "conv_kernel",
        "qwen3_5, qwen3_5_moe, qwen3_next, kimi_linear: causal conv kernel size",
    ),
    "--full-attention-interval": (
        "full_attention_interval",
        "qwen3_5, qwen3_5_moe, qwen3_next, kimi_linear: every Nth layer is full attention, "
        "the others linear",
    ),
    "--kv-lora-rank": ("kv_lora_rank", "deepseek_v3, kimi_linear: latent dims cached per token"),
    "--qk-nope-head-dim": (
        "qk_nope_head_dim",
        "deepseek_v3, kimi_linear: query/key dims without RoPE",
    ),
    "--qk-rope-head-dim": (
        "qk_rope_head_dim",
        "deepseek_v3/v4: query/key dims RoPE turns (kimi_linear: unrotated)",
    ),
    "--v-head-dim": ("v_head_dim", "deepseek_v3, kimi_linear: value dims per head"),
    "--n-group": ("n_group", "deepseek_v3, kimi_linear: expert groups"),
    "--topk-group": ("topk_group", "deepseek_v3, kimi_linear: groups a token's experts come from"),
}

# Sizes that may be 0.
_COUNT_FLAGS = {
    "--q-lora-rank": (
        "q_lora_rank",
        "deepseek_v3/v4, kimi_linear: query low rank (0: a plain q_proj; not for v4)",
    ),
    "--shared-experts": ("shared_experts", "deepseek_v3, kimi_linear: shared experts"),
    "--first-k-dense": (
        "first_k_dense",
        "deepseek_v3, kimi_linear: leading layers with a dense MLP",
    ),
    "--mtp-layers": ("mtp_layers", "deepseek_v3: multi-token-prediction layers"),
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-tiny",
        help="write a small random-weight checkpoint",
        description="Write a random-weight checkpoint of FAMILY to DIR, deterministic from "
        "--seed: the same arguments give the same bytes. Unset sizes take the family's "
        "tiny defaults.",
    )
    p.add_argument("family", choices=FAMILIES, metavar="FAMILY", help=", ".join(FAMILIES))
    p.add_argument("dir", type=Path, metavar="DIR")
    p.add_argument("--seed", type=int, default=0)
    for flag, (dest, help_) in _SIZE_FLAGS.items():
        p.add_argument(flag, dest=dest, type=positive_int, metavar="N", help=help_)
    for flag, (dest, help_) in _COUNT_FLAGS.items():
        p.add_argument(flag, dest=dest, type=count, metavar="N", help=help_)
    p.add_argument(
        "--yarn-factor",
        type=float,
        metavar="F",
        help="deepseek_v3 (v4: its compressed layers): YaRN RoPE scaling by F over an "
        "original context of 64; gpt_oss: over 4,096 (default 32; 0: plain RoPE)",
    )
    p.add_argument(
        "--fp8",
        action="store_true",
        help="deepseek_v3: store projections as block-scaled FP8 (weight_scale_inv); "
        "deepseek_v4: write the release's format (its names, FP8 projections with e8m0 "
        "scales, FP4 routed experts); gpt_oss: the release's MXFP4 experts (blocks and "
        "scales)",
    )
    p.add_argument(
        "--no-norm-topk-prob",
        dest="norm_topk_prob",
        action="store_const",
        const=False,
        help="qwen3_moe, qwen3_next: do not renormalize the top-k routing weights",
    )
    p.add_argument(
        "--decoder-sparse-step",
        type=positive_int,
        metavar="N",
        help="qwen3_moe, qwen3_next: every Nth layer is sparse",
    )
    p.add_argument(
        "--mlp-only-layers",
        type=index_list,
        metavar="LAYERS",
        help="qwen3_moe, qwen3_next: layers with a dense MLP, e.g. 0,3",
    )
    p.add_argument(
        "--max-position-embeddings",
        type=positive_int,
        metavar="N",
        help="the context config.json declares, e.g. 131072 for an agent's long prompts "
        "(default: the family's tiny default; not for kimi_linear, whose config has none)",
    )
    p.add_argument("--tie-embeddings", action="store_true", help="share embedding and LM head")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--shards", type=positive_int, default=1, help="safetensors files")
    p.add_argument(
        "--tokenizer",
        choices=("json", "tiktoken", "harmony"),
        help="json: tokenizer.json (the default, but for gpt_oss); tiktoken: kimi_linear only, "
        "Kimi's tiktoken.model and tokenizer_config.json (its vocabulary sets the model's); "
        "harmony: gpt_oss only (its default), gpt-oss's markers as the last ids",
    )
    p.add_argument("--force", action="store_true", help="replace files in a non-empty DIR")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # torch loads with kern.tiny: imported here, so that `kern --help` answers at once.
    from kern.tiny import make_tiny

    sizes = {
        dest: getattr(args, dest) for dest, _ in (*_SIZE_FLAGS.values(), *_COUNT_FLAGS.values())
    }
    for dest in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "yarn_factor"):
        sizes[dest] = getattr(args, dest)
    try:
        out = make_tiny(
            args.family,
            args.dir,
            seed=args.seed,
            tie_embeddings=args.tie_embeddings,
            dtype=args.dtype,
            shards=args.shards,
            tokenizer=args.tokenizer,
            overwrite=args.force,
            fp8=args.fp8,
            max_position_embeddings=args.max_position_embeddings,
            **sizes,
        )
    except (ValueError, FileExistsError) as e:
        raise UsageError(str(e)) from e
    print(out)
    return 0
