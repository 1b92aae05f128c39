"""Decode tokens/s at rows 1 against rows R drafted by the checkpoint's own MTP layer
(``draft = "mtp"``), through the server's scheduler in this process: ``python -m
kern.bench.mtp``.

Design notes
------------
* The measurement is :mod:`kern.bench.spec`'s (its :class:`~kern.bench.spec.Driver`): one
  greedy request at a time, ``ignore_eos``, first token to last, rows 1 and rows R
  alternating, best of ``--repeat``; the answers at both rows are compared and must be equal.
* Random weights: an MTP layer never trained beside its target agrees with it on next to no
  token, so every round pays the drafting for one token; that is the cost side. The agreeing
  side is :func:`agreeing` (``--agree``): the same checkpoint with every layer's output
  projections scaled down, so the target's next token is mostly a function of the current
  one, and an MTP layer that passes the normalised embedding through, so it predicts that
  function too. Neither is a trained model; they bound what a trained MTP layer's acceptance
  buys on this machine.
* The default model is a small ``make-tiny deepseek_v3`` with one MTP layer (8 layers of 512,
  8 heads, latent rank 128, 8 experts of which 2 routed and 1 shared, vocab 8192): large
  enough that a forward is not all fixed overhead, small enough for a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import torch

from kern.bench.spec import Driver, compare, engine_for

__all__ = ["agreeing", "main"]

MODEL_MTP = dict(
    layers=8,
    hidden=512,
    heads=8,
    intermediate=1024,
    vocab=8192,
    experts=8,
    experts_per_tok=2,
    moe_intermediate=256,
    kv_lora_rank=128,
    q_lora_rank=192,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    n_group=2,
    topk_group=1,
    shared_experts=1,
    first_k_dense=1,
    mtp_layers=1,
)


def agreeing(src: Path, dst: Path, scale: float) -> Path:
    """A copy of the one-file checkpoint ``src`` whose MTP layer agrees with its target often:
    every layer's output projections (attention and MLP, the MTP's too) scaled by ``scale``,
    so the target's next token is mostly a function of the current one, and the MTP's
    ``eh_proj`` passing the normalised embedding through (its hidden half zero), its ``enorm``
    plain and its head norm the target's final norm: it predicts that function too."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    h, n = config["hidden_size"], config["num_hidden_layers"]
    t = load_file(dst / "model.safetensors")
    for k in list(t):
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            t[k] = t[k] * scale
    p = f"model.layers.{n}."
    t[p + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
    t[p + "enorm.weight"] = torch.ones(h)
    t[p + "shared_head.norm.weight"] = t["model.norm.weight"].clone()
    save_file(t, str(dst / "model.safetensors"))
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kern.bench.mtp", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=4, help="the speculative rows (default 4)")
    p.add_argument("--steps", type=int, default=64, help="tokens per answer (default 64)")
    p.add_argument("--prompts", type=int, default=3, help="random prompts measured (default 3)")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3, help="best of this many runs per prompt")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a deepseek_v3 folder with MTP layers (default: make-tiny deepseek_v3, seed 0, "
        "8 layers of 512 and one MTP layer)",
    )
    p.add_argument(
        "--agree",
        type=float,
        default=None,
        metavar="SCALE",
        help="measure the agreeing copy of the model instead (output projections times SCALE, "
        "e.g. 0.1; needs a one-file checkpoint)",
    )
    args = p.parse_args(argv)
    if args.rows < 2:
        p.error("--rows must be at least 2")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        name = str(model)
        if model is None:
            from kern.tiny import make_tiny

            model = make_tiny("deepseek_v3", Path(tmp) / "deepseek_v3", seed=0, **MODEL_MTP)
            name = "deepseek_v3 (make-tiny, seed 0, 8 layers of 512, one MTP layer)"
        if args.agree is not None:
            if not (model / "model.safetensors").is_file():
                p.error(f"--agree needs a one-file checkpoint: {model} has no model.safetensors")
            model = agreeing(model, Path(tmp) / "agreeing", args.agree)
            name += f", agreeing (output projections x {args.agree})"
        engine = engine_for(model, args.rows, args.threads, draft="mtp")
        one, wide = Driver(engine, 1), Driver(engine, args.rows)
        vocab = min(256, engine.checkpoint.config.vocab_size)
        rng = random.Random(args.seed)
        prompts = [
            [rng.randrange(1, vocab) for _ in range(args.prompt_tokens)]
            for _ in range(args.prompts)
        ]
        print(
            f"kern.bench.mtp: {name}, torch {torch.__version__}, {args.threads} threads, "
            f"{args.steps} tokens per answer, rows 1 vs rows {args.rows} (MTP drafts), best of "
            f"{args.repeat}; load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
        )
        compare(prompts, one, wide, args.rows, args.steps, args.repeat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
