"""Kimi-Linear: ``python -m kern.bench.kimi``.

1. Bytes at Kimi-Linear-48B's released dims (``config.json`` of
   moonshotai/Kimi-Linear-48B-A3B-Instruct: 27 layers, 20 of them KDA with 32 heads of 128,
   7 NoPE latent layers of 512 + 64): a sequence's state slot (``Layout.of``, bf16 conv)
   against the formula, and the latent pages' bytes a token against the formula and against
   latent pages in every layer.
2. CPU prefill and decode of the tiny config (``make-tiny kimi_linear``, or ``--model``)
   against transformers' ``KimiLinearForCausalLM`` in the same run, float32, best of
   ``--repeat``: prefill of ``--prompt`` tokens, then ``--steps`` greedy tokens one at a
   time (kern's ``generate``; transformers' ``generate`` with its cache). The greedy
   answers are compared and must be equal.
3. What a next turn's snapshot hit copies: one state slot, ``state_bytes``, as
   ``Runner.copy_slots`` does it (an index copy of the slot's row of the arena), timed at
   the released dims and at the tiny one.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from kern.bench.forward import best
from kern.checkpoint.config import load_config, parse_config
from kern.engine.layout import Layout

__all__ = ["main"]

FULL = [4, 8, 12, 16, 20, 24, 27]
RELEASED = {
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "num_experts": 256,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "linear_attn_config": {
        "full_attn_layers": FULL,
        "kda_layers": [i for i in range(1, 28) if i not in FULL],
        "head_dim": 128,
        "num_heads": 32,
        "short_conv_kernel_size": 4,
    },
}


def bytes_rows() -> list[str]:
    c = parse_config(RELEASED)
    layout = Layout.of(c, torch.bfloat16, 1)
    kda = sum(c.is_linear_layer(i) for i in range(c.num_hidden_layers))
    mla = c.num_hidden_layers - kda
    assert c.delta is not None and c.mla is not None
    heads, d, kernel = c.delta.num_value_heads, c.delta.value_head_dim, c.delta.conv_kernel_dim
    delta = kda * heads * d * d * 4
    conv = kda * 3 * heads * d * (kernel - 1) * 2
    latent = c.mla.kv_lora_rank + c.mla.qk_rope_head_dim
    per_token = mla * latent * 2
    assert layout.state_bytes == delta + conv and layout.page_bytes == per_token
    all_mla = c.num_hidden_layers * latent * 2
    return [
        "| Kimi-Linear-48B | kern | formula |",
        "| --- | ---: | ---: |",
        f"| state a sequence (delta, float32) | {layout.delta_bytes:,} | "
        f"{kda} x {heads} x {d} x {d} x 4 = {delta:,} |",
        f"| state a sequence (conv, bf16) | {layout.conv_bytes:,} | "
        f"{kda} x {3 * heads * d} x {kernel - 1} x 2 = {conv:,} |",
        f"| state a sequence, total | {layout.state_bytes:,} "
        f"({layout.state_bytes / 2**20:.1f} MiB) | |",
        f"| latent pages a token ({mla} layers) | {layout.page_bytes:,} | "
        f"{mla} x 576 x 2 = {per_token:,} (every layer latent: {all_mla:,}) |",
    ]


def copy_time(state_bytes: int, repeat: int) -> float:
    rows = torch.zeros(3, state_bytes, dtype=torch.uint8)
    src, dst = torch.tensor([0]), torch.tensor([2])
    return best(lambda: rows.index_copy_(0, dst, rows.index_select(0, src)), repeat, warmup=True)


def speed_rows(model: Path, prompt_len: int, steps: int, repeat: int) -> list[str]:
    import transformers

    from kern.checkpoint.load import load_checkpoint
    from kern.engine.generate import generate

    ckpt = load_checkpoint(model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    # No end-of-sequence: both sides run n tokens, and no logits processor masks the end
    # token (min_new_tokens would, where kern's argmax, which never stops early, may pick it).
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, ckpt.config.vocab_size - 3, (prompt_len,), generator=gen).tolist()

    def ours(n: int) -> list[int]:
        return generate(ckpt, ids, n, page_tokens=16).ids

    def theirs(n: int) -> list[int]:
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
        return out[0, prompt_len:].tolist()

    if ours(steps) != theirs(steps):
        raise SystemExit("kern's greedy answer differs from transformers'")
    rows = ["| | kern | transformers | transformers / kern |", "| --- | ---: | ---: | ---: |"]
    pre = {
        "kern": best(lambda: ours(1), repeat, warmup=True),
        "hf": best(lambda: theirs(1), repeat, warmup=True),
    }
    full = {
        "kern": best(lambda: ours(steps), repeat, warmup=True),
        "hf": best(lambda: theirs(steps), repeat, warmup=True),
    }
    rows.append(
        f"| prefill {prompt_len} tokens + 1 (ms) | {pre['kern'] * 1e3:.1f} | "
        f"{pre['hf'] * 1e3:.1f} | {pre['hf'] / pre['kern']:.2f}x |"
    )
    tps = {k: (steps - 1) / (full[k] - pre[k]) for k in full}
    rows.append(
        f"| decode tokens/s (after the prefill) | {tps['kern']:.1f} | {tps['hf']:.1f} | "
        f"{tps['kern'] / tps['hf']:.2f}x |"
    )
    return rows


def family_bench(
    argv: list[str] | None, module: str, doc: str, rows: Callable[[], list[str]], families
) -> int:
    """``python -m kern.bench.<module>`` of families with no --model: the bytes table
    ``rows`` gives at the released dims, then each family's tiny model (seed 0) beside
    transformers (:func:`speed_rows`)."""
    p = argparse.ArgumentParser(prog=f"python -m kern.bench.{module}", description=doc)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--steps", type=int, default=64, help="greedy tokens (default 64)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"kern.bench.{module}: torch {torch.__version__}, {args.threads} threads, load "
        f"average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs\n"
    )
    print("## Bytes at the released dims (bf16)\n")
    print("\n".join(rows()))
    from kern.tiny import make_tiny

    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            model = make_tiny(family, Path(tmp) / family, seed=0)
            print(
                f"\n## CPU, make-tiny {family} (seed 0), against transformers "
                f"(float32, best of {args.repeat})\n"
            )
            print("\n".join(speed_rows(model, args.prompt, args.steps, args.repeat)))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kern.bench.kimi", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", type=Path, default=None, help="a kimi_linear folder (default: tiny)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128)")
    p.add_argument("--steps", type=int, default=64, help="greedy tokens (default 64)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"kern.bench.kimi: torch {torch.__version__}, {args.threads} threads, load average "
        f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs\n"
    )
    print("## Bytes at the released dims (bf16)\n")
    print("\n".join(bytes_rows()))
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from kern.tiny import make_tiny

            model = make_tiny("kimi_linear", Path(tmp) / "kimi_linear", seed=0)
        name = str(args.model) if args.model else "make-tiny kimi_linear, seed 0"
        print(f"\n## CPU, {name}, against transformers (float32, best of {args.repeat})\n")
        print("\n".join(speed_rows(model, args.prompt, args.steps, args.repeat)))
        tiny_state = Layout.of(load_config(model), torch.float32, 16).state_bytes
    released = Layout.of(parse_config(RELEASED), torch.bfloat16, 1).state_bytes
    print(f"\n## A next turn's snapshot copy (one state slot), best of {args.repeat}\n")
    print("| model | bytes copied | ms | GB/s |")
    print("| --- | ---: | ---: | ---: |")
    for label, size in (("Kimi-Linear-48B", released), ("tiny", tiny_state)):
        t = copy_time(size, args.repeat)
        print(f"| {label} | {size:,} | {t * 1e3:.3f} | {size / t / 1e9:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
