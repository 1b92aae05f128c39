"""The reference side of the gate: `kern run` answers, cached by everything that determines
them, and the probe that alone may excuse a divergence.

Design notes
------------
* A cached answer is keyed by the sha256 of: the installed kern (its version, every file of
  the package, so a rebuilt kern never reuses an old answer, and the installed versions of
  its dependencies), every file of the checkpoint
  (and of a draft checkpoint), the target's resolved config (all keys, defaults filled), and
  the `kern run` arguments (prompt or prompt ids, steps, rows, chat). A cache keyed on the
  prompt alone once served a stale answer after a checkpoint changed under the same path.
* Answers the gate knows it will ask for are asked for together (:meth:`Oracle.prefetch`):
  with the installed kern (``python -m kern.cli``) and a single-rank target, their `kern run`
  command lines run in one process (``kern_runs.py``, through kern's own entry point), which
  pays Python's and torch's start-up once instead of once an answer: the same answers, a
  third of the gate's time (docs: the gate's README).
* A divergence (served ids != `kern run` ids) is excused only by the logits of that very
  step: `kern run --prompt-ids <prompt + the shared answer> --steps 1 --rows R --probe-dir`,
  excused when both tokens are within 4 float32 ULPs of the top logit. ``--rows`` is passed
  even when it is 1: a probe left to the target's default rows probed a different shape.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kern.kern_toml import Target
from kern.probe import probe_ulps, read_probe

__all__ = [
    "MAX_ULPS",
    "KernRunError",
    "Oracle",
    "Reference",
    "Verdict",
    "cache_key",
    "judge",
    "kern_fingerprint",
    "target_fingerprint",
    "tree_hash",
]

MAX_ULPS = 4
# The installed kern's command; kern_runs.py runs many of its command lines in one process.
KERN = [sys.executable, "-m", "kern.cli"]
KERN_RUNS = Path(__file__).resolve().parent / "kern_runs.py"


class KernRunError(RuntimeError):
    """`kern run` failed (the message has its command and the end of its stderr)."""


@dataclass(frozen=True)
class Reference:
    """A `kern run --json` answer."""

    ids: list[int]
    text: str
    prompt_ids: list[int]
    finish_reason: str


@dataclass(frozen=True)
class Verdict:
    """A served answer against its reference: ``identical`` (ids and text), else ``excused``
    by the probe, else a failure; ``detail`` says what differed. ``gated`` false (a
    multi-rank target) reports a divergence without failing."""

    identical: bool
    excused: bool
    gated: bool
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.identical or self.excused or not self.gated


def tree_hash(path: Path) -> str:
    """sha256 over every file in a folder (names and bytes, sorted), or one file."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        if "__pycache__" in f.parts:
            continue
        h.update(str(f.relative_to(path) if f != path else f.name).encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def kern_fingerprint() -> str:
    """kern's version, a hash of the installed package (what `kern run` executes) and the
    installed versions of its dependencies (torch computes the answer, tokenizers its text)."""
    import kern

    root = Path(kern.__file__).parent
    deps = []
    for req in importlib.metadata.requires("kern") or []:
        if "extra ==" in req:
            continue
        name = re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0]
        try:
            deps.append(f"{name}=={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            deps.append(f"{name} missing")
    return f"{importlib.metadata.version('kern')}+{tree_hash(root)[:16]} " + ",".join(deps)


def target_fingerprint(target: Target) -> dict[str, Any]:
    """The target's resolved config with its files replaced by their hashes (the name and
    the paths do not change an answer; the bytes do)."""
    out = dataclasses.asdict(target)
    del out["name"]
    out["checkpoint"] = tree_hash(Path(target.checkpoint))
    if target.draft_checkpoint is not None:
        out["draft"] = tree_hash(target.draft_checkpoint)
    return json.loads(json.dumps(out))  # tuples -> lists, paths -> str


def cache_key(kern_id: str, target: dict[str, Any], args: list[str]) -> str:
    material = json.dumps({"kern": kern_id, "target": target, "args": args}, sort_keys=True)
    return hashlib.sha256(material.encode()).hexdigest()


class Oracle:
    """`kern run` for one target: answers (cached) and probes."""

    def __init__(
        self,
        kern: list[str],
        config: Path,
        target: Target,
        *,
        kern_id: str,
        cache_dir: Path | None,
        work_dir: Path,
        timeout: float,
    ) -> None:
        self.kern = kern
        self.config = config
        self.target = target
        self.kern_id = kern_id
        self.fingerprint = target_fingerprint(target)
        self.cache_dir = cache_dir
        self.work_dir = work_dir
        self.timeout = timeout
        self._memo: dict[str, Reference] = {}
        self.num_runs = 0  # `kern run` answers computed (not from the cache)
        self.num_batches = 0  # processes that computed several (kern_runs.py)
        self.num_cached = 0  # answers taken from the cache
        self.num_probes = 0

    def _argv(self, args: list[str]) -> list[str]:
        """The `kern` arguments of a run with ``args``."""
        return ["run", "--config", str(self.config), "--target", self.target.name, *args]

    def _run(self, args: list[str]) -> dict[str, Any]:
        cmd = [*self.kern, *self._argv(args)]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            raise KernRunError(f"{_show(cmd)}: no answer after {self.timeout:.0f}s") from None
        if out.returncode != 0:
            tail = "\n".join(out.stderr.strip().splitlines()[-5:])
            raise KernRunError(f"{_show(cmd)}: exit {out.returncode}\n{tail}")
        return json.loads(out.stdout)

    def _ranks(self) -> int:
        """The ranks its runs use."""
        return self.target.ranks

    def _args(self, prompt: str | list[int], steps: int, rows: int, chat: bool) -> list[str]:
        if isinstance(prompt, str):
            args = ["--prompt", prompt] + (["--chat"] if chat else [])
        else:
            if chat:
                raise ValueError("a chat prompt is text")
            args = ["--prompt-ids", ",".join(map(str, prompt))]
        return args + ["--steps", str(steps), "--rows", str(rows), "--json"]

    def _cached(self, args: list[str]) -> tuple[str, Reference | None]:
        """The cache key of ``args`` and its answer when the memo or the cache has it."""
        key = cache_key(self.kern_id, self.fingerprint, args)
        if key in self._memo:
            return key, self._memo[key]
        file = self.cache_dir / f"{key}.json" if self.cache_dir is not None else None
        if file is not None and file.is_file():
            self.num_cached += 1
            return key, self._keep(key, json.loads(file.read_text(encoding="utf-8")), False)
        return key, None

    def _keep(self, key: str, out: dict[str, Any], store: bool) -> Reference:
        if store and self.cache_dir is not None:
            _write_atomic(self.cache_dir / f"{key}.json", json.dumps(out, ensure_ascii=False))
        ref = Reference(out["ids"], out["text"], out["prompt_ids"], out["finish_reason"])
        self._memo[key] = ref
        return ref

    def answer(self, prompt: str | list[int], steps: int, rows: int, *, chat: bool = False):
        """`kern run`'s answer to ``prompt`` (text, or ids) alone, greedy, ``steps`` tokens
        at most (stopping at end-of-sequence, as the server does)."""
        args = self._args(prompt, steps, rows, chat)
        key, ref = self._cached(args)
        if ref is not None:
            return ref
        out = self._run(args)
        self.num_runs += 1
        return self._keep(key, out, True)

    def prefetch(self, requests: list[tuple[str | list[int], int, int, bool]]) -> None:
        """Ask for the answers to ``requests`` (prompt, steps, rows, chat) at once, so the
        :meth:`answer` calls that follow find them (see the notes); those the memo or the
        cache has are not asked again. Without the installed kern or on several ranks,
        nothing is done here (each answer then runs alone when asked for)."""
        if self.kern != KERN or self._ranks() > 1:
            return
        todo: dict[str, list[str]] = {}
        for prompt, steps, rows, chat in requests:
            args = self._args(prompt, steps, rows, chat)
            key, ref = self._cached(args)
            if ref is None:
                todo.setdefault(key, args)
        if not todo:
            return
        lines = "".join(json.dumps(self._argv(args)) + "\n" for args in todo.values())
        cmd = [sys.executable, str(KERN_RUNS)]
        self.num_batches += 1
        try:
            done = subprocess.run(
                cmd, input=lines, capture_output=True, text=True, timeout=self.timeout
            )
        except subprocess.TimeoutExpired:
            raise KernRunError(f"{_show(cmd)}: no answers after {self.timeout:.0f}s") from None
        results = [json.loads(line) for line in done.stdout.splitlines() if line.strip()]
        if done.returncode != 0 or len(results) != len(todo):
            tail = "\n".join(done.stderr.strip().splitlines()[-5:])
            raise KernRunError(f"{_show(cmd)}: exit {done.returncode}\n{tail}")
        for (key, args), got in zip(todo.items(), results, strict=True):
            if got["rc"] != 0:
                tail = "\n".join(got["err"].strip().splitlines()[-5:])
                raise KernRunError(f"kern {_show(self._argv(args))}: exit {got['rc']}\n{tail}")
            self.num_runs += 1
            self._keep(key, json.loads(got["out"]), True)

    def probe_args(self, context: list[int], rows: int, probe_dir: Path, label: str) -> list[str]:
        return [
            "--prompt-ids",
            ",".join(map(str, context)),
            "--steps",
            "1",
            "--rows",
            str(rows),
            "--probe-dir",
            str(probe_dir),
            "--probe-steps",
            "0",
            "--probe-labels",
            label,
            "--json",
        ]

    def excuse(self, context: list[int], tokens: tuple[int, int], rows: int) -> tuple[bool, str]:
        """Whether both ``tokens`` are within :data:`MAX_ULPS` of the top logit after
        ``context`` (a fresh `kern run` probe at ``rows``), and what the probe saw."""
        self.num_probes += 1
        label = f"probe-{self.num_probes}"
        probe_dir = self.work_dir / "probes"
        self._run(self.probe_args(context, rows, probe_dir, label))
        probe = read_probe(probe_dir / f"{label}.json")
        top = probe["logits_f32_bits"][0]
        seen = []
        ok = True
        for t in tokens:
            bits = probe["by_id"].get(t)
            if bits is None:
                seen.append(f"{t}: not in the top {len(probe['ids'])}")
                ok = False
            else:
                ulps = probe_ulps(bits, top)
                seen.append(f"{t}: {ulps} ULPs under the top")
                ok = ok and ulps <= MAX_ULPS
        return ok, f"probe {label} at position {len(context) - 1}: " + ", ".join(seen)


def judge(
    oracle: Oracle,
    prompt_ids: list[int],
    served_ids: list[int],
    served_text: str,
    ref: Reference,
    rows: int,
    *,
    gated: bool = True,
) -> Verdict:
    """A served answer against `kern run`'s: byte identity of ids and text, else the probe."""
    if served_ids == ref.ids:
        if served_text == ref.text:
            return Verdict(True, False, gated)
        return Verdict(
            False,
            False,
            gated,
            f"same ids, text differs: served {served_text!r}, kern run {ref.text!r}",
        )
    n = next(
        (i for i, (a, b) in enumerate(zip(served_ids, ref.ids, strict=False)) if a != b),
        min(len(served_ids), len(ref.ids)),
    )
    what = f"ids differ at step {n} of {len(ref.ids)}"
    if n >= len(served_ids) or n >= len(ref.ids):
        longer = "kern run" if n >= len(served_ids) else "the server"
        return Verdict(False, False, gated, f"{what}: {longer} went on past the other's end")
    what += f": served {served_ids[n]}, kern run {ref.ids[n]}"
    excused, seen = oracle.excuse(prompt_ids + ref.ids[:n], (served_ids[n], ref.ids[n]), rows)
    return Verdict(False, excused, gated, f"{what}; {seen}")


def _write_atomic(file: Path, text: str) -> None:
    file.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=file.parent, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, file)


def _show(cmd: list[str]) -> str:
    shown = [c if len(c) < 80 else c[:77] + "..." for c in cmd]
    return " ".join(shown)
