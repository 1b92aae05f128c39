"""Batch-invariance harness: does a sequence get the same logits, bit for bit, alone and in
company?

For one checkpoint, a target sequence is prefilled and decoded greedily alone (the
reference), then again under each scenario, and the harness counts the steps whose logits are
bitwise equal to the reference's:

* ``batch-N``: inside a batch with N other sequences that prefill (in chunks of varying size)
  and decode alongside it, the target at a random place in the batch each step;
* ``chunks-a-b-c``: with its prompt prefilled in chunks of those sizes (other sequences in
  the batch too);
* ``rows-R``: decoded with speculative verification of up to R-1 n-gram drafts per step
  (``generate(rows=R)``), compared with ``rows=1``;
* ``decode-kv``: the K/V (and recurrent state) that decoding wrote, compared with what a
  prefill of the same tokens writes, position by position (a next turn reads the former,
  ``kern run`` computes the latter).

Run ``python -m kern.bench.invariance`` for a table over tiny checkpoints of every family.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from kern.arith import cdiv
from kern.checkpoint.load import Checkpoint, load_checkpoint
from kern.chunk import SeqChunk
from kern.engine.generate import generate
from kern.engine.runner import Runner

__all__ = ["Score", "check_decode_kv", "run_batched", "run_invariance", "run_rows"]


@dataclass(frozen=True)
class Score:
    """How many of ``total`` steps were bitwise equal; ``max_diff`` the largest absolute
    logit difference over the others (0.0 when all were equal)."""

    equal: int
    total: int
    max_diff: float = 0.0

    def __str__(self) -> str:
        s = f"{self.equal}/{self.total}"
        return s if self.equal == self.total else f"{s} (max |diff| {self.max_diff:.1e})"


def _score(got: list[Tensor], ref: list[Tensor]) -> Score:
    equal = sum(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    diff = max((float((a - b).abs().max()) for a, b in zip(got, ref, strict=True)), default=0.0)
    return Score(equal, len(ref), diff)


class _Seq:
    def __init__(self, prompt: list[int], splits: list[int], pages: list[int], slot: int):
        self.prompt = prompt
        self.splits = list(splits)
        self.pages = pages
        self.slot = slot
        self.pos = 0
        self.tokens: list[int] = []  # generated
        self.logits: list[Tensor] = []

    def next_chunk(self) -> SeqChunk:
        if self.pos < len(self.prompt):
            n = self.splits.pop(0)
            ids = self.prompt[self.pos : self.pos + n]
            last = self.pos + n == len(self.prompt)
            return SeqChunk(ids, self.pos, self.pages, self.slot, "last" if last else "none")
        return SeqChunk([self.tokens[-1]], self.pos, self.pages, self.slot, "last")

    def advance(self, chunk: SeqChunk, logits: Tensor | None) -> None:
        self.pos += len(chunk.token_ids)
        if logits is not None:
            self.logits.append(logits)
            self.tokens.append(int(logits.argmax()))


def run_batched(
    ckpt: Checkpoint,
    prompt: list[int],
    steps: int,
    *,
    splits: list[int] | None = None,
    companions: int = 0,
    seed: int = 0,
    page_tokens: int = 16,
) -> list[Tensor]:
    """Greedy-decode ``prompt`` for ``steps`` tokens (its prefill in chunks of ``splits``)
    while ``companions`` other random sequences share every step; the target's logits per
    generated token."""
    rng = random.Random(seed)
    vocab = ckpt.config.vocab_size
    seqs_spec = [(prompt, splits or [len(prompt)])]
    for _ in range(companions):
        n = rng.randint(3, 2 * len(prompt))
        other = [rng.randrange(vocab) for _ in range(n)]
        cuts = []
        left = n
        while left:
            c = min(left, rng.choice([1, 3, 8, 17, 64]))
            cuts.append(c)
            left -= c
        seqs_spec.append((other, cuts))
    per_seq = [cdiv(len(p) + steps + 2, page_tokens) for p, _ in seqs_spec]
    runner = Runner.with_pages(
        ckpt, num_pages=sum(per_seq), page_tokens=page_tokens, num_slots=len(seqs_spec)
    )
    first = 0
    seqs = []
    for i, ((p, cuts), n) in enumerate(zip(seqs_spec, per_seq, strict=True)):
        seqs.append(_Seq(p, cuts, list(range(first, first + n)), i))
        first += n
    target = seqs[0]
    while len(target.tokens) < steps:
        live = [s for s in seqs if len(s.tokens) < steps]
        rng.shuffle(live)
        chunks = [s.next_chunk() for s in live]
        logits = runner.forward(chunks)
        row = 0
        for s, c in zip(live, chunks, strict=True):
            if c.logits == "none":
                s.advance(c, None)
            else:
                s.advance(c, logits[row])
                row += 1
    return target.logits


def run_rows(ckpt: Checkpoint, prompt: list[int], steps: int, rows: int) -> Score:
    """generate(rows=rows) against rows=1: full-vocabulary logits of every step."""
    vocab = ckpt.config.vocab_size
    probe = list(range(steps))
    base = generate(ckpt, prompt, steps, probe_steps=probe, probe_k=vocab)
    wide = generate(ckpt, prompt, steps, rows=rows, probe_steps=probe, probe_k=vocab)

    def dense(result) -> list[Tensor]:
        return [
            torch.empty(vocab).scatter_(0, result.probes[s][1], result.probes[s][0])
            for s in probe
            if s in result.probes
        ]

    if wide.ids != base.ids:
        return Score(0, steps, float("inf"))
    return _score(dense(wide), dense(base))


def check_decode_kv(
    ckpt: Checkpoint, prompt: list[int], steps: int, page_tokens: int = 16
) -> Score:
    """Positions whose K/V (every attention layer) written while decoding equal those a
    prefill of the same tokens writes; for a stateful model the final state counts as one
    more position."""
    n = len(prompt) + steps
    pages = cdiv(n, page_tokens)
    runner = Runner.with_pages(ckpt, num_pages=2 * pages, page_tokens=page_tokens, num_slots=2)
    decoded = list(range(pages))
    tokens = list(prompt)
    logits = runner.forward([SeqChunk(prompt, 0, decoded, 0)])
    for _ in range(steps):
        tokens.append(int(logits[0].argmax()))
        logits = runner.forward([SeqChunk([tokens[-1]], len(tokens) - 1, decoded, 0)])
    prefilled = list(range(pages, 2 * pages))
    runner.forward([SeqChunk(tokens, 0, prefilled, 1, "none")])
    positions = list(range(len(prompt), n))
    a = runner.kv_at(decoded, positions)
    b = runner.kv_at(prefilled, positions)
    equal = sum(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    worst = float((a - b).abs().max()) if positions else 0.0
    total = steps
    if runner.stateful:
        assert runner.delta_states is not None and runner.conv_states is not None
        same = torch.equal(runner.delta_states[0], runner.delta_states[1]) and torch.equal(
            runner.conv_states[0], runner.conv_states[1]
        )
        equal += same
        total += 1
        worst = max(worst, float((runner.delta_states[0] - runner.delta_states[1]).abs().max()))
    return Score(equal, total, 0.0 if equal == total else worst)


def run_invariance(
    ckpt: Checkpoint,
    *,
    prompt_len: int = 40,
    steps: int = 12,
    batch_sizes: tuple[int, ...] = (2, 4, 8, 16),
    chunkings: tuple[tuple[int, ...], ...] = ((1, 15, 24), (7, 9, 20, 4), (33, 7)),
    rows: tuple[int, ...] = (2, 4),
    seed: int = 0,
) -> dict[str, Score]:
    """Every scenario for one checkpoint: scenario name -> score against the lone run."""
    gen = torch.Generator().manual_seed(seed)
    vocab = ckpt.config.vocab_size
    # A repetitive prompt, so n-gram drafts exist and get accepted.
    base = torch.randint(0, vocab, (prompt_len // 4,), generator=gen).tolist()
    prompt = (base * 5)[:prompt_len]
    ref = run_batched(ckpt, prompt, steps)
    out: dict[str, Score] = {}
    for n in batch_sizes:
        out[f"batch-{n}"] = _score(run_batched(ckpt, prompt, steps, companions=n, seed=n), ref)
    for cuts in chunkings:
        assert sum(cuts) == prompt_len
        got = run_batched(ckpt, prompt, steps, splits=list(cuts), companions=3, seed=len(cuts))
        out["chunks-" + "-".join(map(str, cuts))] = _score(got, ref)
    for r in rows:
        out[f"rows-{r}"] = run_rows(ckpt, prompt, steps, r)
    out["decode-kv"] = check_decode_kv(ckpt, prompt, steps)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kern.bench.invariance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "checkpoints",
        nargs="*",
        type=Path,
        help="checkpoint folders (default: make_tiny of every family)",
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        paths = list(args.checkpoints)
        if not paths:
            from kern.tiny import make_tiny

            paths = [make_tiny(f, Path(tmp) / f) for f in ("qwen3", "qwen3_moe", "qwen3_5")]
        rows = []
        for path in paths:
            ckpt = load_checkpoint(path)
            scores = run_invariance(ckpt, steps=args.steps)
            rows.append((ckpt.config.model_type, scores))
    names = list(rows[0][1])
    print("| scenario | " + " | ".join(f for f, _ in rows) + " |")
    print("| --- |" + " --- |" * len(rows))
    for name in names:
        print(f"| {name} | " + " | ".join(str(s[name]) for _, s in rows) + " |")
    print(f"(torch {torch.__version__}, {torch.get_num_threads()} threads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
