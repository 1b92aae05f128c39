"""DeepSeek-V4: ``python -m kern.bench.deepseek_v4``.

1. Bytes at the released dims (bf16): a page of 16 and of 128 tokens and a window page
   (``Layout.of``), a million-token sequence running (its pages and the two window pages it
   holds) against the compressed-entries-plus-one-window formula, and cached (its pages and
   a snapshot every k lcm(page, window) tokens), with vLLM's quoted figure for Pro beside it.
2. Prefix hits with snapshots every k = 1, 4, 16 (``--requests`` of ``kern.bench.prefix``'s
   multi-turn trace, and its first turns alone: a shared system prompt and a question),
   replayed through the cache's books as the scheduler places V4's snapshots, with the
   tree's bytes at the released Flash dims, beside a hit at every page end (what keeping
   every token's window entry bought).
3. CPU decode of the tiny config (``make-tiny deepseek_v4``, or ``--model``) at batch 1 and
   ``--batch`` against transformers' ``DeepseekV4ForCausalLM.generate`` in the same run,
   float32, best of ``--repeat``: ``--steps`` greedy tokens after a ``--prompt``-token
   prefill (prompts of one length: transformers' compressors count left pads). The greedy
   answers must be equal.
4. Prefill of ``--long`` tokens (in chunks of 512, as a server's step budget takes it) on
   the tiny config, with the share of the time in the indexer (its pooling and its top-k).
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
import time
from pathlib import Path

import torch

from kern.arith import cdiv
from kern.bench.forward import best
from kern.checkpoint.config import parse_config
from kern.engine.layout import Layout

__all__ = ["main"]

FLASH = [0, 0] + [4, 128] * 20 + [4]  # 43 layers: 2 sliding, then CSA and HCA alternating
PRO = [128, 128] + [4 if i % 2 else 128 for i in range(59)]  # transformers' default, 61
VLLM_PRO_GIB = 9.6  # vLLM's quoted KV for a million-token Pro sequence, bf16


def released(kinds: list[int], hidden: int, heads: int) -> dict:
    return {
        "model_type": "deepseek_v4",
        "vocab_size": 129280,
        "hidden_size": hidden,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": len(kinds),
        "num_attention_heads": heads,
        "head_dim": 512,
        "q_lora_rank": 1024,
        "n_routed_experts": 256,
        "num_experts_per_tok": 6,
        "compress_ratios": kinds,
        "index_head_dim": 128,
        "index_n_heads": 64,
        "o_groups": heads // 8,
        "o_lora_rank": 1024,
        "qk_rope_head_dim": 64,
    }


def bytes_rows() -> list[str]:
    """A page, a window page, and a million-token sequence running and cached, at the
    released dims, against the compressed-entries-plus-one-window formula."""
    rows = [
        "| config | page tokens | page bytes | window page bytes | bytes a token | running "
        "1M-token sequence | formula (entries + one window) | running / formula | cached, "
        "k = 1 / 4 / 16 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    d, di, item, w, n = 512, 128, 2, 128, 10**6
    for name, kinds, hidden, heads in (("Flash", FLASH, 4096, 64), ("Pro", PRO, 7168, 128)):
        c = parse_config(released(kinds, hidden, heads))
        csa, hca = kinds.count(4), kinds.count(128)
        entries = n * (csa * (d + di) * item / 4 + hca * d * item / 128)
        formula = entries + len(kinds) * w * d * item
        for pt in (16, 128):
            layout = Layout.of(c, torch.bfloat16, pt)
            page, window = layout.page_bytes, layout.state_bytes
            pages = page * cdiv(n, pt)
            running = pages + 2 * window  # the window's two pages: the last window, and now
            every = math.lcm(pt, w)
            cached = " / ".join(
                f"{(pages + (n // (k * every) + 1) * window) / 2**30:.2f}" for k in (1, 4, 16)
            )
            rows.append(
                f"| {name} ({csa} CSA, {hca} HCA, {kinds.count(0)} sliding) | {pt} | {page:,} "
                f"| {window:,} | {page / pt:,.0f} | {running / 2**30:.2f} GiB | "
                f"{formula / 2**30:.2f} GiB | "
                f"{running / formula:.3f} | {cached} GiB |"
            )
    rows.append(f"| Pro, vLLM's quoted figure | | | | | {VLLM_PRO_GIB} GiB | | | |")
    return rows


def _prompts(vocab: int, batch: int, n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab - 3, (batch, n), generator=gen).tolist()


def kern_decode(runner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy ``steps`` tokens for every prompt, batched, on ``runner``'s pages (each
    sequence starts at position 0, so what earlier calls left there is never read)."""
    from kern.chunk import SeqChunk

    n = len(prompts[0])
    per = runner.num_pages // len(prompts)
    tables = [list(range(b * per, (b + 1) * per)) for b in range(len(prompts))]
    logits = runner.forward([SeqChunk(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    out = [[int(t)] for t in logits.argmax(-1)]
    for s in range(steps - 1):
        chunks = [SeqChunk([o[-1]], n + s, t) for o, t in zip(out, tables, strict=True)]
        for o, t in zip(out, runner.forward(chunks).argmax(-1), strict=True):
            o.append(int(t))
    return out


def speed_rows(model: Path, prompt_len: int, steps: int, batch: int, repeat: int) -> list[str]:
    import transformers

    from kern.checkpoint.load import load_checkpoint
    from kern.engine.runner import Runner

    ckpt = load_checkpoint(model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        model, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    # No end-of-sequence: every answer runs ``steps`` tokens on both sides, and no logits
    # processor masks the end token (min_new_tokens would, where kern's argmax may pick it).
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    rows = ["| batch | kern tokens/s | transformers tokens/s | kern / transformers |"]
    rows.append("| ---: | ---: | ---: | ---: |")
    for b in (1, batch):
        prompts = _prompts(ckpt.config.vocab_size, b, prompt_len)

        def theirs(prompts=prompts) -> list[list[int]]:
            with torch.no_grad():
                ids = torch.tensor(prompts)
                out = hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=steps,
                    do_sample=False,
                )
            return out[:, prompt_len:].tolist()

        pages = b * cdiv(prompt_len + steps, 16)
        runner = Runner.with_pages(ckpt, num_pages=pages, page_tokens=16)
        if kern_decode(runner, prompts, steps) != theirs():
            raise SystemExit(f"batch {b}: kern's greedy answers differ from transformers'")
        ours = best(lambda r=runner, p=prompts: kern_decode(r, p, steps), repeat)
        hf_s = best(theirs, repeat)
        rows.append(
            f"| {b} | {b * steps / ours:.1f} | {b * steps / hf_s:.1f} | {hf_s / ours:.2f}x |"
        )
    return rows


def prefill_rows(model: Path, long: int) -> list[str]:
    from kern.checkpoint.load import load_checkpoint
    from kern.chunk import SeqChunk
    from kern.engine.runner import Runner
    from kern.models.deepseek_v4 import attention as ca

    ckpt = load_checkpoint(model)
    spent = {"indexer": 0.0}
    top_k = ca.index_topk

    def timed_topk(*args, **kw):
        t = time.perf_counter()
        try:
            return top_k(*args, **kw)
        finally:
            spent["indexer"] += time.perf_counter() - t

    ids = _prompts(ckpt.config.vocab_size, 1, long)[0]
    runner = Runner.with_pages(ckpt, num_pages=cdiv(long, 16), page_tokens=16)
    table = list(range(runner.num_pages))
    ca.index_topk = timed_topk
    try:
        t0 = time.perf_counter()
        for a in range(0, long, 512):
            runner.forward([SeqChunk(ids[a : a + 512], a, table, logits="none")])
        total = time.perf_counter() - t0
    finally:
        ca.index_topk = top_k
    return [
        "| prompt tokens | prefill s | tokens/s | indexer top-k s | indexer share |",
        "| ---: | ---: | ---: | ---: | ---: |",
        f"| {long} | {total:.2f} | {long / total:.0f} | {spent['indexer']:.2f} | "
        f"{spent['indexer'] / total:.0%} |",
    ]


def hit_rows(requests: int, page_tokens: int) -> list[str]:
    """Hit rates of the prefix bench's multi-turn trace and of its first turns alone (a
    shared system prompt and one question each), replayed through the cache's books as
    kern's scheduler places V4's snapshots, at k = 1, 4, 16 and, for comparison, a hit at
    every page end (what keeping every window entry bought)."""
    from kern.bench.prefix import make_trace

    c = parse_config(released(FLASH, 4096, 64))
    layout = Layout.of(c, torch.bfloat16, page_tokens)
    trace = make_trace(requests, seed=0)
    window = layout.state_bytes
    # A page that kept its tokens' window entries and its accumulators (kern before window
    # pages): the header, the entries, and per layer a window entry a token and the states.
    d, di, item = 512, 128, 2
    states = FLASH.count(4) * 4 * 3 * 2 * (d + di) + FLASH.count(128) * 4 * 3 * d
    kept = 16 + layout.page_bytes + len(FLASH) * page_tokens * d * item + states
    # Each conversation's first request: its system prompt and one question.
    first = sorted({s: r for r, s in reversed(list(enumerate(trace.req_session)))}.values())
    rows = [
        "| trace | snapshots | hit rate | tree pages | tree window pages | tree bytes |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    every_request = range(len(trace.req_session))
    for name, reqs in (("multi-turn chat", every_request), ("system prompt", first)):
        for k in (1, 4, 16, 0):
            hit, total, stats = replay_snapshots(trace, list(reqs), layout, k)
            tree = stats.resident_pages * layout.page_bytes + stats.resident_states * window
            if not k:  # every page held its tokens' window entries and a state
                tree = stats.resident_pages * kept
            what = f"k = {k}" if k else "every page end (all windows kept)"
            states = f"{stats.resident_states:,}" if k else "in the pages"
            rows.append(
                f"| {name} ({len(reqs)} requests) | {what} | {hit / total:.1%} | "
                f"{stats.resident_pages:,} | {states} | {tree / 2**30:.2f} GiB |"
            )
    return rows


def replay_snapshots(trace, reqs: list[int], layout: Layout, k: int):
    """Each request of ``reqs`` in order: its hit (the deepest snapshot at most its prompt
    but one token, ``Memory``'s rule), then the snapshots its run leaves (every k
    lcm(page, window) tokens of prefill, the prompt's end but one, the request's end but one)
    with the pages under them. ``k`` 0: every page end is a snapshot. A budget that holds
    everything: the hit rate is the snapshots' placement alone."""
    import numpy as np

    from kern.pool import Cache

    pt, w = layout.page_tokens, layout.pages.window_tokens
    cache = Cache(
        page_tokens=pt,
        page_bytes=64,
        device_bytes=1 << 34,
        state_bytes=64,
    )
    every = math.lcm(pt, w) * k if k else pt
    hit = total = 0
    for r in reqs:
        tokens = trace.sessions[trace.req_session[r]]
        prompt, full = trace.req_prompt[r], trace.req_full[r]
        m = cache.match(np.ascontiguousarray(tokens[: prompt - 1]))
        got = m.state_len or 0
        if m.node is not None:
            cache.unlock(m.node)
        hit += got
        total += prompt
        points = range(got // every * every + every, prompt, every)
        for end in [*points, prompt - 1, full - 1]:
            if end > got:
                pages, _ = cache.take_pages(cdiv(end, pt))
                cache.insert(np.ascontiguousarray(tokens[:end]), pages, cache.alloc_slot())
    cache.check_integrity()
    return hit, total, cache.stats()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kern.bench.deepseek_v4", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", type=Path, default=None, help="a deepseek_v4 folder (default: tiny)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens (default 64)")
    p.add_argument("--steps", type=int, default=32, help="greedy tokens (default 32)")
    p.add_argument("--batch", type=int, default=32, help="the larger batch (default 32)")
    p.add_argument("--long", type=int, default=8192, help="the long prefill (default 8192)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument(
        "--requests", type=int, default=2000, help="the hit-rate trace's requests (default 2000)"
    )
    p.add_argument(
        "--page-tokens", type=int, default=128, help="the hit-rate replay's pages (default 128)"
    )
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"kern.bench.deepseek_v4: torch {torch.__version__}, {args.threads} threads, load "
        f"average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs\n"
    )
    print("## Bytes at the released dims (bf16)\n")
    print("\n".join(bytes_rows()))
    print(
        f"\n## Prefix hits by snapshot spacing: {args.requests} requests, pages of "
        f"{args.page_tokens}, window pages of 128, tree bytes at Flash's dims\n"
    )
    print("\n".join(hit_rows(args.requests, args.page_tokens)))
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from kern.tiny import make_tiny

            model = make_tiny("deepseek_v4", Path(tmp) / "deepseek_v4", seed=0)
        name = str(args.model) if args.model else "make-tiny deepseek_v4, seed 0"
        print(f"\n## CPU decode, {name}, against transformers (float32, best of {args.repeat})\n")
        print("\n".join(speed_rows(model, args.prompt, args.steps, args.batch, args.repeat)))
        print(f"\n## Prefill of {args.long} tokens in chunks of 512, {name}\n")
        print("\n".join(prefill_rows(model, args.long)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
