"""Multi-head latent attention: ``python -m kern.bench.mla``.

1. Bytes a token of KV at DeepSeek-V3's and Kimi K2's released dims: kern's latent pages
   (``Layout.of``) against the formula ``layers x (kv_lora_rank + qk_rope_head_dim) x 2``
   (bf16) and against caching K and V per head (``layers x heads x (qk_nope + qk_rope +
   v_head) x 2``), the saving.
2. One decode step of one attention layer, absorbed against expanded, at batch 1 and 32,
   every sequence at ``--context`` tokens, best of ``--repeat``, in plain torch float32 on the
   CPU (the same op style for both, so the ratio is the algorithms'):
   - absorbed (what kern runs): queries into the latent space by each head's W_UK, scores
     against the cached latents and rope keys, the weighted latents out through W_UV;
   - expanded: every cached latent of the context through ``kv_b_proj`` into per-head keys
     and values, then per-head attention.
   And kern's own CPU backend (batch-invariant ``latent_attention`` plus the two per-head
   absorptions) on the same shapes, for scale. Shapes: the tiny test config and one layer
   at the released widths with 16 heads.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from kern.backend import CpuOps
from kern.batch import build_step
from kern.bench.forward import best
from kern.checkpoint.config import parse_config
from kern.chunk import SeqChunk
from kern.engine.layout import Layout

# Released config.json fields that set the KV size (DeepSeek-V3 / R1, Kimi K2).
RELEASED = {
    "DeepSeek-V3": dict(
        num_hidden_layers=61,
        num_attention_heads=128,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
    ),
    "Kimi-K2": dict(
        num_hidden_layers=61,
        num_attention_heads=64,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
    ),
}

SHAPES = {
    # heads, kv_lora_rank, rope, nope, v
    "tiny (make-tiny deepseek_v3)": (4, 32, 16, 16, 16),
    "released widths, 16 heads": (16, 512, 64, 128, 128),
}


def bytes_table() -> list[str]:
    rows = [
        "| model | kern latent page, bytes/token | formula | K/V per head | saving |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, dims in RELEASED.items():
        raw = {
            "model_type": "deepseek_v3",
            "vocab_size": 129280,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "n_routed_experts": 256,
            "max_position_embeddings": 4096,
            **dims,
        }
        c = parse_config(raw)
        m = c.mla
        assert m is not None
        kern_bytes = Layout.of(c, torch.bfloat16, 1).page_bytes
        formula = c.num_hidden_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * 2
        per_head = (
            c.num_hidden_layers
            * c.num_attention_heads
            * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
            * 2
        )
        saving = per_head / kern_bytes
        rows.append(f"| {name} | {kern_bytes:,} | {formula:,} | {per_head:,} | {saving:.1f}x |")
    return rows


def decode_times(shape: tuple[int, ...], batch: int, context: int, repeat: int) -> dict[str, float]:
    h, rank, rope, nope, v = shape
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(batch, context, rank + rope, generator=gen)  # latents, then rope keys
    kv_b = torch.randn(h, nope + v, rank, generator=gen) / rank**0.5
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]  # [H, nope, rank], [H, v, rank]
    q = torch.randn(batch, h, nope + rope, generator=gen)
    scale = (nope + rope) ** -0.5

    def absorbed() -> torch.Tensor:
        q_lat = torch.einsum("bhn,hnr->bhr", q[:, :, :nope], w_uk)
        query = torch.cat([q_lat, q[:, :, nope:]], dim=2)  # [B, H, rank + rope]
        p = torch.softmax(torch.einsum("bhc,btc->bht", query, cache) * scale, dim=-1)
        o = torch.einsum("bht,btr->bhr", p, cache[:, :, :rank])
        return torch.einsum("bhr,hvr->bhv", o, w_uv)

    def expanded() -> torch.Tensor:
        kv = torch.einsum("btr,hdr->bhtd", cache[:, :, :rank], kv_b)  # every cached latent
        k = torch.cat([kv[..., :nope], cache[:, None, :, rank:].expand(-1, h, -1, -1)], dim=3)
        p = torch.softmax(torch.einsum("bhd,bhtd->bht", q, k) * scale, dim=-1)
        return torch.einsum("bht,bhtv->bhv", p, kv[..., nope:])

    torch.testing.assert_close(absorbed(), expanded(), atol=1e-3, rtol=1e-3)
    times = {
        "absorbed": best(absorbed, repeat, warmup=True),
        "expanded": best(expanded, repeat, warmup=True),
    }
    # kern's CPU backend on the same step: latent pages of 16 tokens, one layer.
    ops = CpuOps()
    page = 16
    pages_per_seq = -(-context // page)
    arena = torch.zeros(batch * pages_per_seq, 1, page, rank + rope)
    for b in range(batch):
        rows = arena[b * pages_per_seq : (b + 1) * pages_per_seq, 0].reshape(-1, rank + rope)
        rows[:context] = cache[b]
    chunks = [
        SeqChunk([0], context - 1, list(range(b * pages_per_seq, (b + 1) * pages_per_seq)))
        for b in range(batch)
    ]
    step = build_step(chunks, page, ops.device)
    step = dataclasses.replace(step, attention=ops.plan_latent_attention(step, arena, h))
    uk = ops.prepare_head_linear(w_uk.transpose(1, 2))
    uv = ops.prepare_head_linear(w_uv)

    def kern_cpu() -> torch.Tensor:
        q_lat = ops.head_linear(q[:, :, :nope].contiguous(), uk)
        query = torch.cat([q_lat, q[:, :, nope:]], dim=2)
        o = ops.latent_attention(step, query, arena[:, 0], scale, rank)
        return ops.head_linear(o, uv)

    torch.testing.assert_close(kern_cpu(), expanded(), atol=1e-3, rtol=1e-3)
    times["kern cpu"] = best(kern_cpu, repeat, warmup=True)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kern.bench.mla", description=__doc__.split("\n")[0])
    p.add_argument("--context", type=int, default=512, help="tokens of context a sequence")
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args(argv)
    print("## KV bytes a token at the released dims (bf16)\n")
    print("\n".join(bytes_table()))
    print(
        f"\n## One decode step of one layer, {args.context} tokens of context, "
        f"best of {args.repeat}, {torch.get_num_threads()} threads\n"
    )
    print("| shape | batch | absorbed ms | expanded ms | expanded / absorbed | kern cpu ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, shape in SHAPES.items():
        for batch in (1, 32):
            t = decode_times(shape, batch, args.context, args.repeat)
            print(
                f"| {name} | {batch} | {t['absorbed'] * 1e3:.2f} | {t['expanded'] * 1e3:.2f} | "
                f"{t['expanded'] / t['absorbed']:.1f}x | {t['kern cpu'] * 1e3:.2f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
