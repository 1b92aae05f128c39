"""``kern run``: one prompt, alone: the reference answer the server's are compared with.

Design notes
------------
* One request alone, greedy unless a sampling flag is given: it stops after ``--steps`` tokens
  or at an end-of-sequence token (kept in ``ids``; ``--ignore-eos`` runs on), as the server
  does with ``max_tokens``. ``text`` skips special tokens, as the server does.
* Every mistake in the flags is named before the target is selected, and the target is checked
  (kern.engine.targets) before anything loads; only what needs the tokenizer (the prompt) is checked
  after the load.
* ``--probe-dir`` writes the probed steps' top logits in the probe format (kern.probe), with
  how the run was made; a step after the end-of-sequence token was never produced and gets no
  file.
* torch, the checkpoint and the generator are imported inside the functions, as in every
  command: the parser imports this module, and ``kern --help`` answers at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kern.arith import cdiv
from kern.cli.args import id_list, index_list, label_list, positive_int
from kern.cli.target import add_target_args, load, load_draft, select_target
from kern.errors import UsageError
from kern.kern_toml import Target
from kern.probe import RunInfo, write_probe

if TYPE_CHECKING:
    from kern.checkpoint.load import Checkpoint
    from kern.engine.generate import GenerateResult
    from kern.engine.params import SamplingParams
    from kern.engine.ranks.launch import Ranks
    from kern.tokenizer import Tokenizer

__all__ = ["add_parser", "run"]

_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "seed")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="generate from one prompt, alone (the reference answer)",
        description="Generate --steps tokens after a prompt, alone, greedy unless a sampling "
        "flag is given. With neither --model nor --config, runs the embedded tiny model.",
    )
    add_target_args(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="prompt text (encoded as is)")
    prompt.add_argument("--prompt-ids", type=id_list, metavar="IDS", help="e.g. 1,2,3")
    p.add_argument(
        "--chat", action="store_true", help="wrap --prompt in the chat template as one user message"
    )
    p.add_argument(
        "--steps", type=positive_int, required=True, metavar="N", help="tokens to generate at most"
    )
    p.add_argument(
        "--rows",
        type=positive_int,
        metavar="R",
        help="positions verified per decode step (default: the target's widest)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int, help="sampling seed")
    p.add_argument(
        "--probe-dir",
        type=Path,
        metavar="DIR",
        help="write each probed step's top logits to DIR (see docs/cli.md)",
    )
    p.add_argument(
        "--probe-steps",
        type=index_list,
        metavar="STEPS",
        help="0-based steps to probe, e.g. 0,5 (default: every step)",
    )
    p.add_argument(
        "--probe-labels",
        type=label_list,
        metavar="LABELS",
        help="file names for the probed steps, one per --probe-steps entry",
    )
    p.add_argument(
        "--probe-k",
        type=positive_int,
        default=20,
        metavar="K",
        help="logits kept per probe (default 20)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


@dataclass(frozen=True)
class _Answer:
    """The generated ids cut at the end of sequence, and why generation stopped."""

    ids: list[int]
    finish: str
    text: str


def run(args: argparse.Namespace) -> int:
    _check_flags(args)
    selection = select_target(args, args.rows)
    target = selection.target
    rows = target.decode_rows
    sampling = _sampling(args)
    from kern.engine.budgets import check_budgets

    # As kern serve: a budget the machine cannot give is refused before anything loads.
    check_budgets(target)
    ranks, ckpt = _load(target)
    draft = load_draft(target) if rows > 1 else None
    prompt_ids = _prompt_ids(args, ckpt)
    probe_steps = None
    if args.probe_dir is not None:
        probe_steps = args.probe_steps if args.probe_steps is not None else list(range(args.steps))
    result = _generate(args, target, ranks, ckpt, draft, prompt_ids, sampling, probe_steps)
    answer = _cut_at_eos(result.ids, ckpt.tokenizer, args.ignore_eos)
    probe_files: list[str] = []
    if args.probe_dir is not None and probe_steps is not None:
        run_info = RunInfo(
            rows=rows,
            threads=target.threads,
            device=target.device,
            dtype=target.dtype,
            prompt_len=len(prompt_ids),
        )
        probe_files = _write_probes(args, probe_steps, answer.ids, result, run_info)

    if args.json:
        summary = _summary(args, target, selection.name, ckpt, answer, prompt_ids, sampling)
        print(json.dumps({**summary, "probe_files": probe_files}, ensure_ascii=False))
    else:
        _print_plain(target, answer, sampling)
    return 0


def _check_flags(args: argparse.Namespace) -> None:
    """What the flags alone say is wrong, before any target is read."""
    if args.chat and args.prompt is None:
        raise UsageError("--chat needs --prompt")
    if (args.probe_steps is not None or args.probe_labels is not None) and not args.probe_dir:
        raise UsageError("--probe-steps and --probe-labels need --probe-dir")
    if args.probe_labels is not None:
        if args.probe_steps is None:
            raise UsageError("--probe-labels needs --probe-steps (one label per step)")
        if len(args.probe_labels) != len(args.probe_steps):
            raise UsageError(
                f"--probe-labels has {len(args.probe_labels)} labels for "
                f"{len(args.probe_steps)} --probe-steps"
            )
    if args.probe_steps is not None and max(args.probe_steps) >= args.steps:
        raise UsageError(f"--probe-steps {max(args.probe_steps)} is past --steps {args.steps}")


def _sampling(args: argparse.Namespace) -> SamplingParams | None:
    """The sampling flags' parameters; None (greedy) when none is given."""
    given = {k: getattr(args, k) for k in _SAMPLING_KEYS if getattr(args, k) is not None}
    if not given:
        return None
    from kern.engine.params import SamplingParams

    # Asking for top-p/top-k/a seed without a temperature means sampling at temperature 1.
    given.setdefault("temperature", 1.0)
    try:
        return SamplingParams(**given)
    except ValueError as e:
        raise UsageError(str(e)) from e


def _load(target: Target) -> tuple[Ranks | None, Checkpoint]:
    """The target's checkpoint, and its rank processes when it splits over several."""
    if target.ranks > 1:
        from kern.engine.ranks.launch import load_for_run

        return load_for_run(target)
    return None, load(target)


def _prompt_ids(args: argparse.Namespace, ckpt: Checkpoint) -> list[int]:
    """--prompt encoded (in the chat template with --chat), or --prompt-ids checked against
    the vocabulary."""
    tok = ckpt.tokenizer
    if args.prompt is not None:
        text = args.prompt
        if args.chat:
            # As the server encodes chat: control-token text in the message stays plain.
            from kern.chat_formats import FORMATS
            from kern.models import registry
            from kern.tokenizer import ChatTemplateError

            message = {"role": "user", "content": text}
            own = registry.of(ckpt.config).chat_format
            if own is not None and FORMATS[own].messages:  # as kern serve renders it
                chat, contents = FORMATS[own].render([message])
                prompt_ids = tok.encode_chat(chat, contents)
            else:
                try:
                    chat = tok.apply_chat_template([message])
                except ChatTemplateError as e:
                    raise UsageError(f"--chat: {e}") from None
                prompt_ids = tok.encode_chat(chat, [text])
        else:
            prompt_ids = tok.encode(text)
        if not prompt_ids:
            raise UsageError("--prompt encodes to no tokens")
        return prompt_ids
    vocab = ckpt.config.vocab_size
    bad = [i for i in args.prompt_ids if i >= vocab]
    if bad:
        raise UsageError(f"--prompt-ids: id {bad[0]} is not below vocab_size {vocab}")
    return args.prompt_ids


def _generate(
    args: argparse.Namespace,
    target: Target,
    ranks: Ranks | None,
    ckpt: Checkpoint,
    draft: Checkpoint | None,
    prompt_ids: list[int],
    sampling: SamplingParams | None,
    probe_steps: list[int] | None,
) -> GenerateResult:
    """Generate --steps tokens, on the ranks' runner when the target splits over several
    (closed after)."""
    from kern.engine.generate import generate

    rows = target.decode_rows
    runner = None
    if ranks is not None:
        total = len(prompt_ids) + args.steps + rows  # as generate sizes its own pages
        runner = ranks.runner_with_pages(ckpt, cdiv(total, target.page_tokens))
    result = generate(
        ckpt,
        prompt_ids,
        args.steps,
        runner=runner,
        rows=rows,
        sampling=sampling,
        probe_steps=probe_steps,
        probe_k=args.probe_k,
        page_tokens=target.page_tokens,
        threads=target.threads,
        device=target.device,
        draft=draft,
        mtp=target.draft == "mtp",
    )
    if ranks is not None:
        ranks.close()
    return result


def _cut_at_eos(generated: list[int], tok: Tokenizer, ignore_eos: bool) -> _Answer:
    """The ids up to and including the first end-of-sequence token (all with
    ``ignore_eos``), and their text without special tokens."""
    ids = list(generated)
    finish = "length"
    if not ignore_eos:
        eos = set(tok.eos_token_ids)
        for n, token in enumerate(ids):
            if token in eos:
                ids = ids[: n + 1]
                finish = "stop"
                break
    return _Answer(ids, finish, tok.decode(ids, skip_special_tokens=True))


def _write_probes(
    args: argparse.Namespace,
    probe_steps: list[int],
    ids: list[int],
    result: GenerateResult,
    run_info: RunInfo,
) -> list[str]:
    """One probe file per probed step that was produced; their paths."""
    labels = args.probe_labels or [f"step-{s}" for s in probe_steps]
    args.probe_dir.mkdir(parents=True, exist_ok=True)
    files: list[str] = []
    for step, label in zip(probe_steps, labels, strict=True):
        if step >= len(ids):
            continue  # after the end-of-sequence token: never produced
        values, top_ids = result.probes[step]
        file = args.probe_dir / f"{label}.json"
        write_probe(file, label, step, ids[step], values, top_ids, run_info)
        files.append(str(file))
    return files


def _summary(
    args: argparse.Namespace,
    target: Target,
    name: str | None,
    ckpt: Checkpoint,
    answer: _Answer,
    prompt_ids: list[int],
    sampling: SamplingParams | None,
) -> dict[str, Any]:
    """The --json object, but for ``probe_files`` (its last key)."""
    rows = target.decode_rows
    return {
        "ids": answer.ids,
        "text": answer.text,
        "finish_reason": answer.finish,
        "prompt_ids": prompt_ids,
        "threads": target.threads,
        "ranks": target.ranks,
        "parallel": target.parallel if target.ranks > 1 else None,
        "rows": rows,
        "draft": (target.draft or "ngram") if rows > 1 else None,
        "steps": args.steps,
        "model": str(target.checkpoint),
        "target": name,
        "family": ckpt.config.model_type,
        "device": target.device,
        "dtype": target.dtype,
        "sampling": None if sampling is None else {k: getattr(sampling, k) for k in _SAMPLING_KEYS},
    }


def _print_plain(target: Target, answer: _Answer, sampling: SamplingParams | None) -> None:
    """The text on stdout, and how it was made on one stderr line."""
    print(answer.text, flush=True)  # before the stderr line, when both go to one terminal
    how = "greedy" if sampling is None else "sampled"
    print(
        f"[kern run] {len(answer.ids)} tokens ({answer.finish}), {how}, "
        f"threads={target.threads}, "
        f"ranks={target.ranks}{'/' + target.parallel if target.ranks > 1 else ''}, "
        f"rows={target.decode_rows}, {target.device}/{target.dtype}, {target.checkpoint}",
        file=sys.stderr,
    )
