"""The end-to-end gate: every target of a kern.toml through the programs a user has (`kern
test`, `kern run`, `kern serve` over HTTP), served answers judged against `kern run`.

    python tools/e2e/e2e.py --config tools/e2e/kern.toml [--targets a,b] [--out DIR]

Exit 0 when every gate passed, 1 when one failed, 2 for a mistake on the command line or in
the config (an unknown target name is one). See README.md beside this file.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from http_client import Client, ServerProcess
from oracle import KernRunError, Oracle, kern_fingerprint
from ranks import across_rank_counts
from scenarios import SCENARIOS, Result, TargetGate, run_kern_test
from summary import TargetReport, failed, write
from tiny_models import RecipeError, make_missing, read_recipes

from kern.kern_toml import KernConfig, Target, TomlConfigError, load_toml_config

HERE = Path(__file__).resolve().parent


class UsageError(Exception):
    """Printed as one line, exit code 2."""


def main(argv: list[str] | None = None, kern: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _gate(args, kern or [sys.executable, "-m", "kern.cli"])
    except (UsageError, TomlConfigError, RecipeError) as e:
        print(f"e2e: error: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="e2e.py",
        description="Drive each target of a kern.toml through kern test, kern run and kern "
        "serve; byte identity of served answers with kern run gates.",
    )
    p.add_argument("--config", type=Path, required=True, metavar="FILE", help="a kern.toml")
    p.add_argument("--targets", metavar="A,B", help="targets to run (default: all, in order)")
    p.add_argument(
        "--out",
        type=Path,
        default=HERE / "out",
        metavar="DIR",
        help="summary.json, summary.md, logs, probes (default: tools/e2e/out)",
    )
    p.add_argument(
        "--cache",
        type=Path,
        metavar="DIR",
        help="kern run answers kept across runs (default: OUT/cache)",
    )
    p.add_argument("--no-cache", action="store_true", help="keep no kern run answer across runs")
    p.add_argument(
        "--models",
        type=Path,
        metavar="FILE",
        help="recipes for missing tiny checkpoints (default: models.toml beside the config, "
        "if there is one)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        metavar="S",
        help="limit for each kern command, server start and request (default 900)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="targets gated at once (default 1); each target's lines are printed when it ends",
    )
    return p


def select_targets(config: KernConfig, names: str | None) -> list[Target]:
    """The targets ``--targets`` names (all when None); raises :class:`UsageError` naming every
    unknown one."""
    if names is None:
        wanted = list(config.targets)
    else:
        wanted = [n.strip() for n in names.split(",")]
        if any(not n for n in wanted):
            raise UsageError(f"--targets {names!r}: an empty name")
        unknown = [n for n in wanted if n not in config.targets]
        if unknown:
            known = ", ".join(config.targets) or "none"
            raise UsageError(
                f"--targets: no target {', '.join(map(repr, unknown))} in {config.path} "
                f"(targets: {known})"
            )
    if not wanted:
        raise UsageError(f"{config.path}: no targets")
    return [config.targets[n] for n in wanted]


def _gate(args: argparse.Namespace, kern: list[str]) -> int:
    t_start = time.monotonic()
    try:
        config = load_toml_config(args.config.resolve())
    except FileNotFoundError:
        raise UsageError(f"{args.config}: no such file") from None
    targets = select_targets(config, args.targets)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    cache = None if args.no_cache else (args.cache or out / "cache").resolve()

    recipes_file = args.models or config.path.parent / "models.toml"
    if args.models is not None and not args.models.is_file():
        raise UsageError(f"--models {args.models}: no such file")
    if recipes_file.is_file():
        recipes = read_recipes(recipes_file.resolve())
        needed = {Path(t.checkpoint) for t in targets}
        needed |= {t.draft_checkpoint for t in targets if t.draft_checkpoint is not None}
        for line in make_missing(kern, recipes, needed):
            _log(line)

    if args.jobs < 1:
        raise UsageError(f"--jobs {args.jobs}: at least 1")
    kern_id = kern_fingerprint()
    gpu = any(t.device.startswith("cuda") for t in targets) and _has_gpu()
    reports = [TargetReport(t.name, _family(t), t.device) for t in targets]

    def gate_one(target: Target, report: TargetReport) -> None:
        # One target's lines together: with --jobs above 1, printed when it ends.
        lines: list[str] = []
        log = _log if args.jobs == 1 else lines.append
        log(f"{target.name}: {report.family}, {target.device}")
        if target.device.startswith("cuda") and not gpu:
            report.skipped = f"needs a GPU ({target.device}); this machine has none"
            report.results = [Result(s, status="skip") for s in SCENARIOS]
            log(f"  skipped: {report.skipped}")
        else:
            report.results = _run_target(args, kern, config.path, target, kern_id, cache, out, log)
        for line in lines:
            _log(line)

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        # Waited for in order: an exception in one target's thread is raised here.
        for done in [pool.submit(gate_one, t, r) for t, r in zip(targets, reports, strict=True)]:
            done.result()

    head = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(["python", *sys.argv]) if __name__ == "__main__" else "e2e.main",
        "config": str(config.path),
        "kern": kern_id,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "wall_s": time.monotonic() - t_start,
        # CPU seconds of the gate and every process it ran: unlike wall time, not inflated
        # when other jobs share the machine.
        "cpu_s": _cpu_seconds(),
    }
    json_file, md_file = write(out, reports, head)
    print(md_file.read_text(encoding="utf-8"))
    _log(f"wrote {json_file} and {md_file}")
    return 1 if failed(reports) else 0


def _run_target(
    args: argparse.Namespace,
    kern: list[str],
    config: Path,
    target: Target,
    kern_id: str,
    cache: Path | None,
    out: Path,
    log: Callable[[str], None],
) -> list[Result]:
    work = out / target.name
    work.mkdir(parents=True, exist_ok=True)
    if not Path(target.checkpoint).is_dir():
        missing = f"checkpoint {target.checkpoint} does not exist"
        return [Result(s, status="fail", failures=[missing]) for s in SCENARIOS]
    if target.ranks > 1:
        results = [Result("kern test", status="n/a", notes=["checks one rank's backend"])]
    else:
        results = [run_kern_test(kern, config, target.name, args.timeout)]
    first = results[0].failures[:1]
    log(f"  kern test: {results[0].status}" + (f" ({first[0]})" if first else ""))
    oracle = Oracle(
        kern,
        config,
        target,
        kern_id=kern_id,
        cache_dir=cache,
        work_dir=work,
        timeout=args.timeout,
    )
    gate = TargetGate(oracle, chat_template=_has_chat_template(target), log=log)
    rest = SCENARIOS[1:]
    try:
        gate.prepare()
        if target.ranks > 1:
            results.append(across_rank_counts(gate))
            log(f"  {results[-1].scenario}: {results[-1].notes[0]}")
        with ServerProcess(
            kern, config, target.name, work / "serve.log", start_limit=args.timeout
        ) as server:
            client = Client(server.port, target.name, timeout=args.timeout)
            results += gate.run(server, client)
    except (KernRunError, RuntimeError, TimeoutError, OSError) as e:
        done = {r.scenario for r in results}
        why = f"{type(e).__name__}: {e}"
        log(f"  failed: {why}")
        results += [Result(s, status="fail", failures=[why]) for s in rest if s not in done]
    log(
        f"  kern run: {oracle.num_runs} run ({oracle.num_batches} batched runs of several), "
        f"{oracle.num_cached} from the cache, {oracle.num_probes} probes"
    )
    return results


def _family(target: Target) -> str:
    try:
        raw = json.loads((Path(target.checkpoint) / "config.json").read_text(encoding="utf-8"))
        return str(raw.get("model_type", "?"))
    except (OSError, json.JSONDecodeError):
        return "?"


def _has_chat_template(target: Target) -> bool:
    folder = Path(target.checkpoint)
    if (folder / "chat_template.jinja").is_file():
        return True
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return bool(config.get("chat_template"))


def _has_gpu() -> bool:
    probe = "import torch; print(torch.cuda.is_available())"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return out.stdout.strip() == "True"


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
