"""A long prompt's prefill on the CPU, chunk by chunk as the server runs it:
``python -m kern.bench.long_prefill``.

A coding agent's first request is a prompt of tens of thousands of tokens (Claude Code's, on
the tiny model's 512-token vocabulary: 32,166), and on the CPU its prefill is nearly all
attention, which grows with the square of the prompt. This prefills ``--tokens`` random ids
in chunks of ``--chunk`` (the scheduler's ``max_step_tokens``) through kern's runner on a
tiny qwen3 with a 131,072-token context (``--model DIR`` for another checkpoint), and prints
the time of each quarter and the whole, for two ways of running the attention, alternating:

* ``chunked``: the default (kern.backend.cpu_attention: groups of many keys a key chunk at a
  time, in buffers kept across steps);
* ``one pass``: every group through the one-pass path (``LONG_BLOCKS`` set past any group),
  the formulation the chunked path must match bit for bit.

It checks that both gave every chunk's last logits row the same bits, and prints the ratio.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from kern.arith import cdiv
from kern.backend import cpu_attention
from kern.checkpoint.load import load_checkpoint
from kern.chunk import SeqChunk
from kern.engine.runner import Runner

__all__ = ["main"]


def prefill(ckpt, tokens: list[int], chunk: int) -> tuple[list[float], torch.Tensor]:
    """Seconds per quarter of the prompt, and each chunk's last logits row."""
    page = 16
    pages = cdiv(len(tokens), page) + 1
    runner = Runner.with_pages(ckpt, num_pages=pages, page_tokens=page, num_slots=1)
    table = list(range(pages))
    rows, marks, start = [], [], time.perf_counter()
    quarter = max(len(tokens) // 4, 1)
    for s in range(0, len(tokens), chunk):
        logits = runner.forward([SeqChunk(tokens[s : s + chunk], s, table, slot=0)])
        rows.append(logits[-1].clone())
        if (s + chunk) // quarter > s // quarter:
            marks.append(time.perf_counter() - start)
    return [b - a for a, b in zip([0.0, *marks], marks, strict=False)], torch.stack(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=2, help="alternating runs of each way")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from kern.tiny import make_tiny

            model = make_tiny("qwen3", Path(tmp) / "tiny", max_position_embeddings=131072)
        ckpt = load_checkpoint(model)
        gen = torch.Generator().manual_seed(0)
        vocab = ckpt.config.vocab_size
        tokens = torch.randint(0, vocab, (args.tokens,), generator=gen).tolist()
        long_blocks = cpu_attention.LONG_BLOCKS
        best: dict[str, float] = {}
        rows: dict[str, torch.Tensor] = {}
        print(f"{args.tokens} tokens in chunks of {args.chunk}, {args.threads} threads")
        print(f"{'way':10s} {'quarters s':>30s} {'total s':>8s}")
        for _ in range(args.repeat):
            for way, blocks in (("chunked", long_blocks), ("one pass", 1 << 40)):
                cpu_attention.LONG_BLOCKS = blocks
                try:
                    quarters, rows[way] = prefill(ckpt, tokens, args.chunk)
                finally:
                    cpu_attention.LONG_BLOCKS = long_blocks
                total = sum(quarters)
                best[way] = min(best.get(way, total), total)
                print(f"{way:10s} {' '.join(f'{q:7.2f}' for q in quarters):>30s} {total:8.2f}")
        same = torch.equal(rows["chunked"].view(torch.int32), rows["one pass"].view(torch.int32))
        print(
            f"best: chunked {best['chunked']:.2f} s, one pass {best['one pass']:.2f} s, "
            f"ratio {best['chunked'] / best['one pass']:.2f}; same bits: {same}"
        )
        return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
