"""Decode tokens/s at rows 1 against rows R (n-gram drafts, or a draft checkpoint with
``--draft``), through the server's scheduler in this process: ``python -m kern.bench.spec``.

Design notes
------------
* The path measured is the server's: :class:`kern.engine.scheduler.Scheduler` over an engine
  (:class:`kern.engine.load.Engine`), stepped on this thread, no HTTP. One request at a time,
  greedy, ``ignore_eos``; decode time runs from its first token to its last, so prefill is
  not in it. Each prompt is run at rows 1 and at rows R in the same process, alternating,
  best of ``--repeat``; the ratio is of the summed decode times.
* Answers that repeat themselves: an n-gram drafter can only propose what the context already
  holds, so its acceptance depends on the answer. Random-weight checkpoints fall into loops,
  some within a few dozen tokens, some after a few hundred, some not at all. So the bench
  draws seeded random prompts, decodes each ``--probe`` tokens at rows 1, and where the answer
  has fallen into a loop takes the prompt and the answer up to there as a measured prompt:
  its continuation is the loop. ``--loop exact`` (the default) asks for 32 tokens in a row
  that repeat with a period of at most 8 (``ids[j] == ids[j - p]``), the answers the issue's
  acceptance target is about; ``--loop loose`` for 32 tokens in a row with at most 4 distinct
  ids, loops that need not keep one period (lower acceptance). It takes the first
  ``--prompts`` it finds, says how many it tried, and prints every prompt's acceptance, so the
  speed-up is read against it. Random-weight answers drift out of their loops (a loop of 4
  tokens for 50, then something else), so ``--min-acceptance A`` also keeps a candidate only
  if its answer at rows R accepts at least ``A`` of its drafts, which is how the issue's
  speed-up target (>= 2x at >= 80% acceptance) is measured.
* ``--draft``: the draft-checkpoint case. The draft is the target's first ``--draft-layers``
  layers (default 2) with its embedding, final norm and head: ``make-tiny`` with the target's
  arguments but fewer layers (each tensor is seeded by its name, so the shared ones are the
  same bytes), or ``--draft-model DIR``. Its KV pages come from the target's pool, as in the
  server. A draft model does not need answers that loop, so the prompts are the first
  ``--prompts`` seeded random prompts, as drawn (no probe).
* The answers at rows 1 and rows R are compared: a mismatch is an error (identity is what
  makes the drafts free to be wrong).
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from kern.bench.forward import MODEL_100M

__all__ = ["main"]


def engine_for(checkpoint: Path, rows: int, threads: int, draft: str | Path | None = None):
    """An engine of ``checkpoint`` at rows 1 and ``rows``, drafting with ``draft`` (a drafter's
    name or a draft folder; None: n-gram lookup)."""
    from kern.engine.load import Engine
    from kern.kern_toml import Target

    target = Target(
        name="bench",
        checkpoint=checkpoint,
        pool_bytes=256 * 2**20,
        rows=tuple(sorted({1, rows})),
        draft=None if draft is None else str(draft),
        threads=threads,
    )
    return Engine.load(target)


class Driver:
    """A scheduler at some rows over the engine, stepped here; one request at a time."""

    def __init__(self, engine, rows: int) -> None:
        from kern.engine.request import Request

        self.Request = Request
        self.done: dict[int, list[float]] = {}
        self.ids: dict[int, list[int]] = {}
        self.sched = engine.scheduler(self._deliver, rows=rows)

    def _deliver(self, events) -> None:
        now = time.perf_counter()
        for req, (tok, _, reason) in events:
            key = id(req)
            if tok is not None:
                self.ids.setdefault(key, []).append(tok)
                self.done.setdefault(key, [now, now])[1] = now
            if reason is not None:
                self.finished = True

    def run(self, prompt: list[int], steps: int) -> tuple[list[int], float, float, float]:
        """The answer, its decode seconds (first token to last), drafts verified and
        accepted."""
        m = self.sched.metrics
        drafted0 = m.value("kern_spec_decode_num_draft_tokens_total")
        accepted0 = m.value("kern_spec_decode_num_accepted_tokens_total")
        req = self.Request(list(prompt), steps, ignore_eos=True)
        self.finished = False
        self.sched.submit(req)
        while not self.finished:
            self.sched.step()
        first, last = self.done.pop(id(req))
        ids = self.ids.pop(id(req))
        drafted = m.value("kern_spec_decode_num_draft_tokens_total") - drafted0
        accepted = m.value("kern_spec_decode_num_accepted_tokens_total") - accepted0
        return ids, last - first, drafted, accepted


def compare(
    prompts: list[list[int]], one: Driver, wide: Driver, rows: int, steps: int, repeat: int
) -> None:
    """Print a table: each prompt's decode tok/s at rows 1 and ``rows``, best of ``repeat``
    alternating runs, the speed-up and the acceptance; then all prompts together. An answer
    at ``rows`` other than rows 1's is an error."""
    print(f"| prompt | rows 1 tok/s | rows {rows} tok/s | speed-up | acceptance |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    total = {1: 0.0, rows: 0.0}
    all_drafted = all_accepted = 0.0
    for i, prompt in enumerate(prompts):
        best = {1: float("inf"), rows: float("inf")}
        answers: dict[int, list[int]] = {}
        drafted = accepted = 0.0
        for _ in range(repeat):
            for r, driver in ((1, one), (rows, wide)):
                ids, secs, d, a = driver.run(prompt, steps)
                answers[r] = ids
                best[r] = min(best[r], secs)
                if r > 1:
                    drafted, accepted = d, a
        if answers[1] != answers[rows]:
            raise SystemExit(f"prompt {i}: the answer at rows {rows} differs from rows 1")
        for r in best:
            total[r] += best[r]
        all_drafted += drafted
        all_accepted += accepted
        n = steps - 1
        print(
            f"| {i} | {n / best[1]:.1f} | {n / best[rows]:.1f} | "
            f"{best[1] / best[rows]:.2f}x | {accepted / max(drafted, 1):.0%} |"
        )
    n = (steps - 1) * len(prompts)
    print(
        f"| all | {n / total[1]:.1f} | {n / total[rows]:.1f} | "
        f"{total[1] / total[rows]:.2f}x | {all_accepted / max(all_drafted, 1):.0%} |"
    )


def _loop_start(
    ids: list[int], exact: bool, window: int = 32, distinct: int = 4, period: int = 8
) -> int | None:
    """Where ``ids`` falls into a loop (None: it does not): the first ``window`` tokens in a
    row that repeat with a period of at most ``period`` (``exact``), or that hold at most
    ``distinct`` ids."""
    for i in range(len(ids) - window + 1):
        w = ids[i : i + window]
        if exact:
            if any(all(w[j] == w[j - p] for j in range(p, window)) for p in range(1, period + 1)):
                return i
        elif len(set(w)) <= distinct:
            return i
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kern.bench.spec", description=__doc__.split("\n")[0]
    )
    p.add_argument("--rows", type=int, default=5, help="the speculative rows (default 5)")
    p.add_argument("--steps", type=int, default=128, help="tokens per answer (default 128)")
    p.add_argument("--prompts", type=int, default=4, help="prompts measured (default 4)")
    p.add_argument(
        "--probe", type=int, default=256, help="tokens of a candidate's answer searched for a loop"
    )
    p.add_argument("--tries", type=int, default=24, help="candidate prompts at most")
    p.add_argument(
        "--loop",
        choices=("exact", "loose"),
        default="exact",
        help="which answers count as repeating themselves: exact (a period of at most 8 "
        "tokens, the default) or loose (at most 4 distinct ids in 32)",
    )
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument(
        "--prompt-vocab",
        type=int,
        default=256,
        help="prompt ids are drawn from [1, this) (default 256: byte tokens, in every kern "
        "tokenizer)",
    )
    p.add_argument(
        "--min-acceptance",
        type=float,
        default=0.0,
        help="keep only prompts whose answer at --rows accepts at least this share of its "
        "drafts (default 0: every looping prompt)",
    )
    p.add_argument("--repeat", type=int, default=3, help="best of this many runs per prompt")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a checkpoint folder (default: a ~88M qwen3 made with make-tiny, seed 0)",
    )
    p.add_argument(
        "--draft",
        action="store_true",
        help="draft with a draft checkpoint instead of n-gram lookup (see --draft-layers)",
    )
    p.add_argument(
        "--draft-layers",
        type=int,
        default=2,
        help="with --draft and the default model: the draft is its first this many layers",
    )
    p.add_argument("--draft-model", type=Path, default=None, help="with --draft: a draft folder")
    args = p.parse_args(argv)
    if args.rows < 2:
        p.error("--rows must be at least 2")
    if args.draft and args.model is not None and args.draft_model is None:
        p.error("--draft with --model needs --draft-model")
    if args.draft_model is not None and not args.draft:
        p.error("--draft-model needs --draft")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from kern.tiny import make_tiny

            model = Path(tmp) / "qwen3-100m"
            make_tiny("qwen3", model, seed=0, **MODEL_100M)
        draft = args.draft_model
        if args.draft and draft is None:
            draft = Path(tmp) / "qwen3-100m-draft"
            make_tiny("qwen3", draft, seed=0, **{**MODEL_100M, "layers": args.draft_layers})
        engine = engine_for(model, args.rows, args.threads, draft if args.draft else None)
        vocab = min(args.prompt_vocab, engine.checkpoint.config.vocab_size)
        one = Driver(engine, 1)
        wide = Driver(engine, args.rows)
        rng = random.Random(args.seed)
        chosen: list[list[int]] = []
        tried = 0
        while len(chosen) < args.prompts and tried < args.tries:
            tried += 1
            prompt = [rng.randrange(1, vocab) for _ in range(args.prompt_tokens)]
            if args.draft:
                chosen.append(prompt)
                continue
            ids, *_ = one.run(prompt, args.probe)
            at = _loop_start(ids, args.loop == "exact")
            if at is None:
                continue
            candidate = prompt + ids[: at + 32]
            if args.min_acceptance > 0:
                # Random-weight answers drift out of their loops; keep the candidate only if
                # its measured answer accepts enough drafts (it is deterministic: the same
                # answer, the same acceptance, in the timed runs below).
                _, _, drafted, accepted = wide.run(candidate, args.steps)
                if accepted < args.min_acceptance * max(drafted, 1):
                    continue
            chosen.append(candidate)
        load = os.getloadavg()[0]
        name = model.name if args.model else "qwen3 ~88M (make-tiny, seed 0)"
        if args.draft:
            draft = getattr(engine.drafting, "runner", None)
            assert draft is not None
            d = draft.config
            how = (
                f"a draft checkpoint of {d.num_hidden_layers} layers of {d.hidden_size} "
                f"({draft.page_tokens} tokens a pool page); {len(chosen)} random prompts"
            )
        else:
            how = (
                f"n-gram drafts; {len(chosen)} of {tried} prompts have answers that fall into an "
                f"{args.loop} loop within {args.probe} tokens (measured from there)"
            )
            if args.min_acceptance > 0:
                how += (
                    f" and accept >= {args.min_acceptance:.0%} of their drafts at rows {args.rows}"
                )
        print(
            f"kern.bench.spec: {name}, torch {torch.__version__}, {args.threads} threads, "
            f"{args.steps} tokens per answer, rows 1 vs rows {args.rows}, best of "
            f"{args.repeat}; {how}; load average {load:.2f} on {os.cpu_count()} CPUs"
        )
        if not chosen:
            print("no prompt with a repeating answer: nothing to measure")
            return 1
        compare(chosen, one, wide, args.rows, args.steps, args.repeat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
