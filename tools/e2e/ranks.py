"""Identity across rank counts, reported, not gated: a target's `kern run` answers at its own
ranks against `kern run --ranks 1` on the same prompts.

Within one rank count identity gates as usual (the oracle is `kern run` at the target's
ranks); across rank counts the partial sums of a split matmul are added in another order, so
answers may part where two logits are within rounding of each other. The report says how
many answers are byte-identical and, at the first divergence, how far the two tokens are
from the top logit of the single-rank run, in float32 ULPs (the same probe that excuses a
single-rank divergence).
"""

from __future__ import annotations

import dataclasses
import time

from oracle import Oracle, Reference
from scenarios import STEPS, Result, TargetGate

__all__ = ["SCENARIO", "OneRankOracle", "across_rank_counts"]

SCENARIO = "vs 1 rank"


class OneRankOracle(Oracle):
    """`kern run --ranks 1` on the same target (cached under the target with ``ranks = 1``)."""

    def __init__(self, oracle: Oracle) -> None:
        super().__init__(
            oracle.kern,
            oracle.config,
            dataclasses.replace(oracle.target, ranks=1),
            kern_id=oracle.kern_id,
            cache_dir=oracle.cache_dir,
            work_dir=oracle.work_dir,
            timeout=oracle.timeout,
        )

    def _argv(self, args: list[str]) -> list[str]:
        return [*super()._argv(args), "--ranks", "1"]


def across_rank_counts(gate: TargetGate) -> Result:
    """Compare ``gate``'s `kern run` answers (after ``gate.prepare()``) with one rank's."""
    res = Result(SCENARIO)
    t0 = time.monotonic()
    one = OneRankOracle(gate.oracle)
    one.prefetch([(req.prompt, STEPS, gate.rows, req.chat) for req in gate.prompts])
    identical = 0
    first: str | None = None
    for i, (req, ref) in enumerate(zip(gate.prompts, gate.refs, strict=True)):
        single: Reference = one.answer(req.prompt, STEPS, gate.rows, chat=req.chat)
        res.compared += 1
        if (single.ids, single.text) == (ref.ids, ref.text):
            identical += 1
            continue
        res.diverged += 1
        if first is None:
            n = next(
                (k for k, (a, b) in enumerate(zip(ref.ids, single.ids, strict=False)) if a != b),
                min(len(ref.ids), len(single.ids)),
            )
            if n < min(len(ref.ids), len(single.ids)):
                _, seen = one.excuse(
                    single.prompt_ids + single.ids[:n], (ref.ids[n], single.ids[n]), gate.rows
                )
                first = (
                    f"prompt {i}: first divergence at step {n}: ranks {gate.target.ranks} "
                    f"{ref.ids[n]}, 1 rank {single.ids[n]}; {seen}"
                )
            else:
                first = f"prompt {i}: same ids up to the shorter answer's end"
    res.notes.append(
        f"{identical} of {res.compared} answers byte-identical at ranks "
        f"{gate.target.ranks} ({gate.target.parallel}) and at 1 rank (reported, not gated)"
    )
    if first is not None:
        res.notes.append(first)
    res.wall_s = time.monotonic() - t0
    return res
