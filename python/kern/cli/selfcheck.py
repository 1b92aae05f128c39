"""``kern test``: check a target's runner against the torch reference path, and against itself.

Design notes
------------
* The reference is the kernels' torch references and ``F.linear``, float32 on the CPU. The
  greedy tokens must be equal and the logits within a tolerance; a divergence passes only at
  a near tie, where the reference itself puts the runner's token within the tolerance of its
  top logit.
* Then each decoded token's logits against a fresh prefill of the same context, the widest
  rows against rows 1 (a target without speculative rows still checks rows 2), and seeded
  sampling against itself. Exit 0 when every check passes, 1 otherwise.
* One rank only: several ranks run one rank's backend each, which is what this checks.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kern.cli.args import positive_int
from kern.cli.target import add_target_args, load, load_draft, select_target
from kern.errors import UsageError
from kern.kern_toml import Target

if TYPE_CHECKING:
    from torch import Tensor

    from kern.checkpoint.load import Checkpoint
    from kern.engine.generate import GenerateResult

__all__ = ["add_parser", "run"]

_TEST_PROMPTS = (
    ("chat", "What is the capital of France?"),
    ("text", "Once upon a time there was a small model"),
    ("code", "def add(a: int, b: int) -> int:\n"),
)
_TEST_STEPS = 8


@dataclass
class _Check:
    name: str
    ok: bool
    detail: str


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "test",
        help="check a target's runner against the torch reference path",
        description="Load a target and check its runner (its backend: CPU torch ops or CUDA "
        "Triton kernels) on a few prompts against the torch reference path (the kernels' "
        "torch references and F.linear, float32 on the CPU): greedy tokens equal and logits "
        "within a tolerance. Then each decoded token's logits against a fresh prefill of "
        "the same context, the widest rows against rows 1, and seeded sampling against "
        "itself. Exit 0 when every check passes, 1 otherwise.",
    )
    add_target_args(p)
    p.add_argument(
        "--steps",
        type=positive_int,
        default=_TEST_STEPS,
        metavar="N",
        help=f"tokens per prompt (default {_TEST_STEPS})",
    )
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # A --model target declares no rows; its rows check runs at 2, with --draft's drafter.
    selection = select_target(args, 2 if args.draft is not None and args.config is None else None)
    target = selection.target
    if target.ranks > 1:
        raise UsageError(
            f"{target.where('ranks')}: ranks = {target.ranks}: kern test checks one rank's "
            "backend; run it on a target with ranks = 1 (kern run and kern serve take ranks)"
        )
    ckpt = load(target)
    checks = _checks(target, ckpt, load_draft(target), args.steps)
    return _report(args, selection.name, target, ckpt, checks)


def _checks(target: Target, ckpt: Checkpoint, draft: Checkpoint | None, steps: int) -> list[_Check]:
    """Every check, in the order they are printed."""
    from kern.engine.generate import generate
    from kern.engine.params import SamplingParams

    tok = ckpt.tokenizer
    # float32 paths differ by rounding only (1e-6 to 5e-6 measured on the tiny models); bf16
    # kernels against the float32 reference, by bf16 rounding of every activation.
    atol = 1e-4 if target.dtype == "float32" else 5e-2
    opts = dict(page_tokens=target.page_tokens, threads=target.threads, device=target.device)
    probed = list(range(steps))
    checks: list[_Check] = []
    for kind, text in _TEST_PROMPTS:
        if kind == "chat" and tok.has_chat_template:
            text = tok.apply_chat_template([{"role": "user", "content": text}])
        prompt = tok.encode(text)
        base = generate(ckpt, prompt, steps, probe_steps=probed, **opts)
        ref = generate(
            ckpt,
            prompt,
            steps,
            probe_steps=probed,
            page_tokens=target.page_tokens,
            threads=target.threads,
            reference=True,
        )
        checks.append(_against_reference(kind, base, ref, atol))
        checks.append(_decode_vs_prefill(kind, ckpt, prompt, base, atol, opts, generate))
        # Speculative rows must give the rows-1 answer; a target without any still gets 2.
        for rows in [r for r in target.rows if r > 1] or [2]:
            mtp = target.draft == "mtp"
            wide = generate(ckpt, prompt, steps, rows=rows, draft=draft, mtp=mtp, **opts)
            same = wide.ids == base.ids
            checks.append(
                _Check(
                    f"{kind}: rows {rows} vs rows 1",
                    same,
                    "identical" if same else f"{wide.ids} != {base.ids}",
                )
            )
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234)
    prompt = tok.encode(_TEST_PROMPTS[1][1])
    a = generate(ckpt, prompt, steps, sampling=seeded, **opts).ids
    b = generate(ckpt, prompt, steps, sampling=seeded, **opts).ids
    checks.append(
        _Check("seeded sampling repeats", a == b, "identical" if a == b else f"{a} != {b}")
    )
    return checks


def _report(
    args: argparse.Namespace,
    target_name: str | None,
    target: Target,
    ckpt: Checkpoint,
    checks: list[_Check],
) -> int:
    """Print the checks (as JSON with --json); the exit code."""
    ok = all(c.ok for c in checks)
    if args.json:
        print(
            json.dumps(
                {
                    "ok": ok,
                    "target": target_name,
                    "model": str(target.checkpoint),
                    "device": target.device,
                    "dtype": target.dtype,
                    "threads": target.threads,
                    "checks": [c.__dict__ for c in checks],
                }
            )
        )
    else:
        print(
            f"kern test {target_name or target.checkpoint}: {ckpt.config.model_type}, "
            f"{target.device}/{target.dtype}, threads={target.threads}"
        )
        for c in checks:
            print(f"  {'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}")
        print("passed" if ok else "FAILED")
    return 0 if ok else 1


def _against_reference(kind: str, base: GenerateResult, ref: GenerateResult, atol: float) -> _Check:
    """The target's greedy run against the reference's: tokens equal, logits within atol
    while they agree. A divergence passes only at a near tie, where the reference itself
    puts the target's token within atol of its top logit."""
    name = f"{kind}: runner vs torch reference"
    worst = 0.0
    for s, (mine, theirs) in enumerate(zip(base.ids, ref.ids, strict=True)):
        if mine != theirs:
            values, ids = ref.probes[s]
            gap = _gap_to_top(values, ids, mine)
            detail = (
                f"step {s}: runner chose {mine}, reference {theirs}; the reference puts "
                f"{mine} {'below its top k' if gap is None else f'{gap:.3g} under the top'}"
            )
            if gap is not None and gap <= atol:
                return _Check(name, True, f"{detail} (a near tie, within {atol:g})")
            return _Check(name, False, detail)
        worst = max(worst, _probe_diff(base.probes[s], ref.probes[s]))
    return _tokens_equal(name, len(base.ids), worst, atol)


def _gap_to_top(values: Tensor, ids: Tensor, token: int) -> float | None:
    """How far ``token``'s logit is below the top one in a probe (None: not in it)."""
    where = (ids == token).nonzero()
    if where.numel() == 0:
        return None
    return float(values[0] - values[int(where[0, 0])])


def _decode_vs_prefill(
    kind: str,
    ckpt: Checkpoint,
    prompt: list[int],
    base: GenerateResult,
    atol: float,
    opts: dict[str, int | str],
    generate: Callable[..., GenerateResult],
) -> _Check:
    """Each decoded token's logits against a fresh prefill of the same context."""
    name = f"{kind}: decode vs prefill"
    worst = 0.0
    for s in range(len(base.ids)):
        fresh = generate(ckpt, prompt + base.ids[:s], 1, probe_steps=[0], **opts)
        if fresh.ids[0] != base.ids[s]:
            return _Check(
                name, False, f"step {s}: decode chose {base.ids[s]}, prefill {fresh.ids[0]}"
            )
        worst = max(worst, _probe_diff(base.probes[s], fresh.probes[0]))
    return _tokens_equal(name, len(base.ids), worst, atol)


def _tokens_equal(name: str, n: int, worst: float, atol: float) -> _Check:
    detail = f"{n} tokens equal; max |logit diff| {worst:.3g} (limit {atol:g})"
    return _Check(name, worst <= atol, detail)


def _probe_diff(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> float:
    """Largest |difference| between two probes' logits over the ids both kept."""
    a_vals = dict(zip(a[1].tolist(), a[0].tolist(), strict=True))
    b_vals = dict(zip(b[1].tolist(), b[0].tolist(), strict=True))
    # The top entry is always shared when the tokens agree; ids at the k-th rank may not be.
    common = a_vals.keys() & b_vals.keys()
    return max(abs(a_vals[i] - b_vals[i]) for i in common)
