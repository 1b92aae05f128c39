"""The ``kern`` command: make-tiny, run, test (see docs/cli.md).

Design notes
------------
* Exit codes: 0 success; 1 a check failed (``kern test``) or an internal error (traceback);
  2 the command line, the config file or the checkpoint it names is wrong, with one line on
  stderr that names the flag, key or file. A user's mistake never prints a traceback.
* Torch's intra-op thread count is pinned before anything runs and printed with every result:
  CPU float32 results can differ between 1 and 2 threads (docs/invariance.md), so an answer is only
  comparable with one computed at the same count. The default is fixed
  (:data:`~kern.kern_toml.DEFAULT_THREADS`), not the machine's core count.
* ``kern run`` is one request alone, greedy unless a sampling flag is given: it stops after
  ``--steps`` tokens or at an end-of-sequence token (kept in ``ids``; ``--ignore-eos`` runs on),
  as the server does with ``max_tokens``. ``text`` skips special tokens, as the server does.
* Heavy imports (torch, the runner) happen inside the commands, so ``kern --help`` and argument
  errors answer at once.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from kern.errors import UsageError
from kern.kern_toml import DEFAULT_THREADS, Target, TomlConfigError
from kern.model_config import FAMILIES, CheckpointError

__all__ = ["main", "probe_ulps", "read_probe"]

PROBE_FORMAT = "kern-probe/1"
_LABEL = re.compile(r"^[A-Za-z0-9._-]+$")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (UsageError, CheckpointError, TomlConfigError) as e:
        print(f"kern {args.command}: error: {e}", file=sys.stderr)
        return 2


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (``kern serve: error: argument --port: ...``), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    from kern import __version__

    parser = _Parser(prog="kern", description="kern: an LLM inference server (see docs/cli.md)")
    parser.add_argument("--version", action="version", version=f"kern {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_make_tiny(sub)
    _add_run(sub)
    _add_test(sub)
    from kern.cli.bench import add_parser as _add_bench
    from kern.cli.serve import add_parser as _add_serve

    _add_serve(sub)
    _add_bench(sub)
    return parser


# --- make-tiny ------------------------------------------------------------------------------

_SIZE_FLAGS = {
    # flag: (make_tiny keyword, help)
    "--layers": ("layers", "decoder layers"),
    "--hidden": ("hidden", "hidden size"),
    "--heads": ("heads", "attention heads"),
    "--kv-heads": ("kv_heads", "key/value heads"),
    "--head-dim": ("head_dim", "dims per attention head"),
    "--intermediate": ("intermediate", "dense MLP width"),
    "--vocab": ("vocab", "vocabulary size (tokenizer and embedding)"),
    "--experts": ("experts", "qwen3_moe: experts per MoE layer"),
    "--experts-per-tok": ("experts_per_tok", "qwen3_moe: experts each token is routed to"),
    "--moe-intermediate": ("moe_intermediate", "qwen3_moe: expert MLP width"),
    "--linear-key-heads": ("linear_key_heads", "qwen3_5: DeltaNet key heads"),
    "--linear-value-heads": ("linear_value_heads", "qwen3_5: DeltaNet value heads"),
    "--linear-key-head-dim": ("linear_key_head_dim", "qwen3_5: DeltaNet key head dims"),
    "--linear-value-head-dim": ("linear_value_head_dim", "qwen3_5: DeltaNet value head dims"),
    "--conv-kernel": ("conv_kernel", "qwen3_5: causal conv kernel size"),
    "--full-attention-interval": (
        "full_attention_interval",
        "qwen3_5: every Nth layer is full attention, the others linear",
    ),
}


def _add_make_tiny(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-tiny",
        help="write a small random-weight checkpoint",
        description="Write a random-weight checkpoint of FAMILY to DIR, deterministic from "
        "--seed: the same arguments give the same bytes. Unset sizes take the family's "
        "tiny defaults.",
    )
    p.add_argument("family", choices=FAMILIES, metavar="FAMILY", help=", ".join(FAMILIES))
    p.add_argument("dir", type=Path, metavar="DIR")
    p.add_argument("--seed", type=int, default=0)
    for flag, (dest, help_) in _SIZE_FLAGS.items():
        p.add_argument(flag, dest=dest, type=_positive_int, metavar="N", help=help_)
    p.add_argument(
        "--no-norm-topk-prob",
        dest="norm_topk_prob",
        action="store_const",
        const=False,
        help="qwen3_moe: do not renormalize the top-k routing weights",
    )
    p.add_argument(
        "--decoder-sparse-step",
        type=_positive_int,
        metavar="N",
        help="qwen3_moe: every Nth layer is sparse",
    )
    p.add_argument(
        "--mlp-only-layers",
        type=_index_list,
        metavar="LAYERS",
        help="qwen3_moe: layers with a dense MLP, e.g. 0,3",
    )
    p.add_argument("--tie-embeddings", action="store_true", help="share embedding and LM head")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--shards", type=_positive_int, default=1, help="safetensors files")
    p.add_argument("--force", action="store_true", help="replace files in a non-empty DIR")
    p.set_defaults(func=_cmd_make_tiny)


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    from kern.tiny import make_tiny

    sizes = {dest: getattr(args, dest) for dest, _ in _SIZE_FLAGS.values()}
    for dest in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
        sizes[dest] = getattr(args, dest)
    try:
        out = make_tiny(
            args.family,
            args.dir,
            seed=args.seed,
            tie_embeddings=args.tie_embeddings,
            dtype=args.dtype,
            shards=args.shards,
            overwrite=args.force,
            **sizes,
        )
    except (ValueError, FileExistsError) as e:
        raise UsageError(str(e)) from e
    print(out)
    return 0


# --- shared by run and test -----------------------------------------------------------------


def _add_model_args(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", type=Path, metavar="DIR", help="a checkpoint folder")
    source.add_argument("--config", type=Path, metavar="FILE", help="a kern.toml (with --target)")
    p.add_argument("--target", metavar="NAME", help="the [targets.NAME] of --config")
    p.add_argument(
        "--threads",
        type=_positive_int,
        metavar="N",
        help=f"torch intra-op threads (default: the target's, else {DEFAULT_THREADS})",
    )
    p.add_argument(
        "--ranks",
        type=_positive_int,
        metavar="N",
        help="processes that split the model (default: the target's, else 1; see docs/serve.md)",
    )


def _resolve_target(args: argparse.Namespace) -> tuple[Target, str | None]:
    """The target to run and its name: --config/--target, --model, or the embedded model,
    checked as every command checks one (kern.targets)."""
    from kern.targets import check_target, resolve_target

    target, name = resolve_target(
        config=args.config,
        target=args.target,
        model=args.model,
        overrides={"threads": args.threads, "ranks": args.ranks},
    )
    check_target(target, serving=False)
    return target, name


def _load(target: Target):
    import torch

    from kern.checkpoint import load_checkpoint

    # Pin before loading: loading casts with torch ops too, and nothing after may differ.
    torch.set_num_threads(target.threads)
    return load_checkpoint(target.checkpoint, device=target.device, dtype=target.dtype)


def _load_draft(target: Target):
    """The target's draft checkpoint (checked by kern.targets), or None."""
    from kern.checkpoint import load_checkpoint

    if target.draft_checkpoint is None:
        return None
    return load_checkpoint(target.draft_checkpoint, device=target.device, dtype=target.dtype)


# --- run ------------------------------------------------------------------------------------


def _add_run(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="generate from one prompt, alone (the reference answer)",
        description="Generate --steps tokens after a prompt, alone, greedy unless a sampling "
        "flag is given. With neither --model nor --config, runs the embedded tiny model.",
    )
    _add_model_args(p)
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", metavar="TEXT", help="prompt text (encoded as is)")
    prompt.add_argument("--prompt-ids", type=_id_list, metavar="IDS", help="e.g. 1,2,3")
    p.add_argument(
        "--chat", action="store_true", help="wrap --prompt in the chat template as one user message"
    )
    p.add_argument(
        "--steps", type=_positive_int, required=True, metavar="N", help="tokens to generate at most"
    )
    p.add_argument(
        "--rows",
        type=_positive_int,
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
        type=_index_list,
        metavar="STEPS",
        help="0-based steps to probe, e.g. 0,5 (default: every step)",
    )
    p.add_argument(
        "--probe-labels",
        type=_label_list,
        metavar="LABELS",
        help="file names for the probed steps, one per --probe-steps entry",
    )
    p.add_argument(
        "--probe-k",
        type=_positive_int,
        default=20,
        metavar="K",
        help="logits kept per probe (default 20)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args: argparse.Namespace) -> int:
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
    from kern.targets import choose_rows

    target, target_name = _resolve_target(args)
    target = choose_rows(target, target_name, args.rows, "--rows")
    rows = target.decode_rows
    sampling = _sampling(args)

    ranks = None
    if target.ranks > 1:
        from kern.engine.ranks.launch import load_for_run

        ranks, ckpt = load_for_run(target)
    else:
        ckpt = _load(target)
    draft = _load_draft(target) if rows > 1 else None
    from kern.engine.generate import generate

    tok = ckpt.tokenizer
    if args.prompt is not None:
        text = args.prompt
        if args.chat:
            # As the server encodes chat: control-token text in the message stays plain.
            chat = tok.apply_chat_template([{"role": "user", "content": text}])
            prompt_ids = tok.encode_chat(chat, [text])
        else:
            prompt_ids = tok.encode(text)
        if not prompt_ids:
            raise UsageError("--prompt encodes to no tokens")
    else:
        prompt_ids = args.prompt_ids
        vocab = ckpt.config.vocab_size
        bad = [i for i in prompt_ids if i >= vocab]
        if bad:
            raise UsageError(f"--prompt-ids: id {bad[0]} is not below vocab_size {vocab}")
    probe_steps = None
    if args.probe_dir is not None:
        probe_steps = args.probe_steps if args.probe_steps is not None else list(range(args.steps))

    runner = None
    if ranks is not None:
        total = len(prompt_ids) + args.steps + rows  # as generate sizes its own pages
        runner = ranks.runner_with_pages(ckpt, -(-total // target.page_tokens))
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
    )
    if ranks is not None:
        ranks.close()
    ids = list(result.ids)
    finish = "length"
    if not args.ignore_eos:
        eos = set(tok.eos_token_ids)
        for n, token in enumerate(ids):
            if token in eos:
                ids = ids[: n + 1]
                finish = "stop"
                break
    answer = tok.decode(ids, skip_special_tokens=True)

    probe_files: list[str] = []
    if args.probe_dir is not None and probe_steps is not None:
        labels = args.probe_labels or [f"step-{s}" for s in probe_steps]
        args.probe_dir.mkdir(parents=True, exist_ok=True)
        run_info = {
            "rows": rows,
            "threads": target.threads,
            "device": target.device,
            "dtype": target.dtype,
            "prompt_len": len(prompt_ids),
        }
        for step, label in zip(probe_steps, labels, strict=True):
            if step >= len(ids):
                continue  # after the end-of-sequence token: never produced
            values, top_ids = result.probes[step]
            file = args.probe_dir / f"{label}.json"
            _write_probe(file, label, step, ids[step], values, top_ids, run_info)
            probe_files.append(str(file))

    summary: dict[str, Any] = {
        "ids": ids,
        "text": answer,
        "finish_reason": finish,
        "prompt_ids": prompt_ids,
        "threads": target.threads,
        "ranks": target.ranks,
        "parallel": target.parallel if target.ranks > 1 else None,
        "rows": rows,
        "draft": (target.draft or "ngram") if rows > 1 else None,
        "steps": args.steps,
        "model": str(target.checkpoint),
        "target": target_name,
        "family": ckpt.config.model_type,
        "device": target.device,
        "dtype": target.dtype,
        "sampling": None if sampling is None else _sampling_dict(sampling),
        "probe_files": probe_files,
    }
    if args.json:
        print(json.dumps(summary, ensure_ascii=False))
    else:
        print(answer, flush=True)  # before the stderr line, when both go to one terminal
        how = "greedy" if sampling is None else "sampled"
        print(
            f"[kern run] {len(ids)} tokens ({finish}), {how}, threads={target.threads}, "
            f"ranks={target.ranks}{'/' + target.parallel if target.ranks > 1 else ''}, "
            f"rows={rows}, {target.device}/{target.dtype}, {target.checkpoint}",
            file=sys.stderr,
        )
    return 0


def _sampling(args: argparse.Namespace):
    given = {
        k: getattr(args, k)
        for k in ("temperature", "top_p", "top_k", "seed")
        if getattr(args, k) is not None
    }
    if not given:
        return None
    from kern.engine.params import SamplingParams

    # Asking for top-p/top-k/a seed without a temperature means sampling at temperature 1.
    given.setdefault("temperature", 1.0)
    try:
        return SamplingParams(**given)
    except ValueError as e:
        raise UsageError(str(e)) from e


def _sampling_dict(sampling) -> dict[str, Any]:
    return {k: getattr(sampling, k) for k in ("temperature", "top_p", "top_k", "seed")}


# --- probes ---------------------------------------------------------------------------------


def _write_probe(
    file: Path, label: str, step: int, token_id: int, values, top_ids, run_info: dict[str, Any]
) -> None:
    import numpy as np

    f32 = np.ascontiguousarray(values.detach().cpu().float().numpy(), dtype=np.float32)
    probe = {
        "format": PROBE_FORMAT,
        "label": label,
        "step": step,
        # The sequence position whose logits these are: the last token the model had read.
        "position": run_info["prompt_len"] + step - 1,
        "token_id": token_id,
        **run_info,
        "ids": [int(i) for i in top_ids.tolist()],
        "logits_f32_bits": [int(b) for b in f32.view(np.uint32).tolist()],
        "logits": [float(x) for x in f32.tolist()],
    }
    file.write_text(json.dumps(probe) + "\n", encoding="utf-8")


def read_probe(file: str | Path) -> dict[str, Any]:
    """A probe file as written by ``kern run --probe-dir``, with ``logits`` rebuilt from the
    bits (exact float32 values) and a ``by_id`` map of token id -> bit pattern."""
    probe = json.loads(Path(file).read_text(encoding="utf-8"))
    if probe.get("format") != PROBE_FORMAT:
        raise ValueError(f"{file}: not a {PROBE_FORMAT} file")
    import numpy as np

    bits = np.asarray(probe["logits_f32_bits"], dtype=np.uint32)
    probe["logits"] = bits.view(np.float32).tolist()
    probe["by_id"] = dict(zip(probe["ids"], probe["logits_f32_bits"], strict=True))
    return probe


def probe_ulps(a_bits: int, b_bits: int) -> int:
    """Distance in float32 ULPs between two float32 bit patterns (0 for +0 and -0)."""

    def ordered(u: int) -> int:
        return u & 0x7FFFFFFF if u < 0x80000000 else -(u & 0x7FFFFFFF)

    return abs(ordered(a_bits) - ordered(b_bits))


# --- test -----------------------------------------------------------------------------------

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


def _add_test(sub: argparse._SubParsersAction) -> None:
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
    _add_model_args(p)
    p.add_argument(
        "--steps",
        type=_positive_int,
        default=_TEST_STEPS,
        metavar="N",
        help=f"tokens per prompt (default {_TEST_STEPS})",
    )
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(func=_cmd_test)


def _cmd_test(args: argparse.Namespace) -> int:
    target, target_name = _resolve_target(args)
    if target.ranks > 1:
        raise UsageError(
            f"{target.where('ranks')}: ranks = {target.ranks}: kern test checks one rank's "
            "backend; run it on a target with ranks = 1 (kern run and kern serve take ranks)"
        )
    ckpt = _load(target)
    draft = _load_draft(target)
    from kern.engine.generate import generate
    from kern.engine.params import SamplingParams

    tok = ckpt.tokenizer
    # float32 paths differ by rounding only (1e-6 to 5e-6 measured on the tiny models); bf16
    # kernels against the float32 reference, by bf16 rounding of every activation.
    atol = 1e-4 if target.dtype == "float32" else 5e-2
    run = dict(page_tokens=target.page_tokens, threads=target.threads, device=target.device)
    steps = list(range(args.steps))
    checks: list[_Check] = []
    for kind, text in _TEST_PROMPTS:
        if kind == "chat" and tok.has_chat_template:
            text = tok.apply_chat_template([{"role": "user", "content": text}])
        prompt = tok.encode(text)
        base = generate(ckpt, prompt, args.steps, probe_steps=steps, **run)
        ref = generate(
            ckpt,
            prompt,
            args.steps,
            probe_steps=steps,
            page_tokens=target.page_tokens,
            threads=target.threads,
            reference=True,
        )
        checks.append(_against_reference(kind, base, ref, atol))
        checks.append(_decode_vs_prefill(kind, ckpt, prompt, base, atol, run, generate))
        # Speculative rows must give the rows-1 answer; a target without any still gets 2.
        for rows in [r for r in target.rows if r > 1] or [2]:
            wide = generate(ckpt, prompt, args.steps, rows=rows, draft=draft, **run)
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
    a = generate(ckpt, prompt, args.steps, sampling=seeded, **run).ids
    b = generate(ckpt, prompt, args.steps, sampling=seeded, **run).ids
    checks.append(
        _Check("seeded sampling repeats", a == b, "identical" if a == b else f"{a} != {b}")
    )

    ok = all(c.ok for c in checks)
    header = (
        f"kern test {target_name or target.checkpoint}: {ckpt.config.model_type}, "
        f"{target.device}/{target.dtype}, threads={target.threads}"
    )
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
        print(header)
        for c in checks:
            print(f"  {'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}")
        print("passed" if ok else "FAILED")
    return 0 if ok else 1


def _against_reference(kind: str, base, ref, atol: float) -> _Check:
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


def _gap_to_top(values, ids, token: int) -> float | None:
    """How far ``token``'s logit is below the top one in a probe (None: not in it)."""
    where = (ids == token).nonzero()
    if where.numel() == 0:
        return None
    return float(values[0] - values[int(where[0, 0])])


def _decode_vs_prefill(kind: str, ckpt, prompt, base, atol: float, run, generate) -> _Check:
    """Each decoded token's logits against a fresh prefill of the same context."""
    name = f"{kind}: decode vs prefill"
    worst = 0.0
    for s in range(len(base.ids)):
        fresh = generate(ckpt, prompt + base.ids[:s], 1, probe_steps=[0], **run)
        if fresh.ids[0] != base.ids[s]:
            return _Check(
                name, False, f"step {s}: decode chose {base.ids[s]}, prefill {fresh.ids[0]}"
            )
        worst = max(worst, _probe_diff(base.probes[s], fresh.probes[0]))
    return _tokens_equal(name, len(base.ids), worst, atol)


def _tokens_equal(name: str, n: int, worst: float, atol: float) -> _Check:
    detail = f"{n} tokens equal; max |logit diff| {worst:.3g} (limit {atol:g})"
    return _Check(name, worst <= atol, detail)


def _probe_diff(a, b) -> float:
    """Largest |difference| between two probes' logits over the ids both kept."""
    a_vals = dict(zip(a[1].tolist(), a[0].tolist(), strict=True))
    b_vals = dict(zip(b[1].tolist(), b[0].tolist(), strict=True))
    # The top entry is always shared when the tokens agree; ids at the k-th rank may not be.
    common = a_vals.keys() & b_vals.keys()
    return max(abs(a_vals[i] - b_vals[i]) for i in common)


# --- argument types -------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of {what}"
        ) from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: {what} are not negative")
    return values


def _id_list(text: str) -> list[int]:
    return _int_list(text, "token ids")


def _index_list(text: str) -> list[int]:
    values = _int_list(text, "indices")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r} repeats an index")
    return values


def _label_list(text: str) -> list[str]:
    labels = text.split(",")
    for label in labels:
        if not _LABEL.match(label):
            raise argparse.ArgumentTypeError(
                f"label {label!r}: use letters, digits, '.', '_' and '-' (it names a file)"
            )
    if len(set(labels)) != len(labels):
        raise argparse.ArgumentTypeError(f"{text!r} repeats a label")
    return labels
