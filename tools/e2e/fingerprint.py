"""A refactor's witness: what kern computes for every target of a kern.toml, recorded bit for bit,
so that a change that claims to change no behaviour can be held to it.

Usage::

    python tools/e2e/fingerprint.py --config tools/e2e/kern.toml --out before.json
    python tools/e2e/fingerprint.py --config tools/e2e/kern.toml --out after.json \
        --compare before.json

Per target, at each declared row shape: ``kern run --json`` on three prompts (ids, text, finish
reason) with every step's probe written (``--probe-dir``; the files' sha256, which holds each
logit's float32 bits); ``kern test --json``'s checks (name, verdict, detail) (single-rank targets).
And ``kern make-tiny`` of every family the recipes name, with its variants: the sha256 of each
file written. ``--compare`` exits 1 and names every entry that differs.

Run it with the Python that has kern installed (``.venv/bin/python``); it makes missing tiny
checkpoints from the recipes beside the config, as e2e.py does.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_models import make_missing, read_recipes  # noqa: E402

PROMPTS = (
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "Once upon a time",
)
STEPS = 24
# make-tiny variants beyond each family's defaults: (family, extra flags).
VARIANTS = (
    ("qwen3", ["--tie-embeddings"]),
    ("qwen3", ["--shards", "3", "--dtype", "bfloat16"]),
    ("qwen3_moe", ["--mlp-only-layers", "0", "--no-norm-topk-prob"]),
    ("deepseek_v3", ["--fp8", "--mtp-layers", "1", "--yarn-factor", "4"]),
    ("deepseek_v3", ["--q-lora-rank", "0"]),
    ("kimi_linear", ["--tokenizer", "tiktoken"]),
    ("deepseek_v4", ["--fp8", "--yarn-factor", "4"]),
    ("deepseek_v4", ["--tie-embeddings"]),
)


def _kern() -> list[str]:
    return [sys.executable, "-m", "kern.cli"]


def _run(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {out.returncode}: {out.stderr.strip()[-2000:]}")
    return out.stdout


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def target_runs(config: Path, name: str, table: dict) -> dict:
    rows = table.get("rows", [1])
    out: dict = {}
    for r in sorted(set(rows)):
        for i, prompt in enumerate(PROMPTS):
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [*_kern(), "run", "--config", str(config), "--target", name]
                cmd += ["--prompt", prompt, "--steps", str(STEPS), "--rows", str(r)]
                cmd += ["--ignore-eos", "--json", "--probe-dir", tmp]
                got = json.loads(_run(cmd))
                probes = {p.name: _sha(p) for p in sorted(Path(tmp).iterdir())}
            out[f"rows{r}/prompt{i}"] = {
                "ids": got["ids"],
                "text": got["text"],
                "finish": got["finish_reason"],
                "family": got["family"],
                "probes": probes,
            }
    if table.get("ranks", 1) == 1:
        checks = json.loads(
            _run([*_kern(), "test", "--config", str(config), "--target", name, "--json"])
        )
        out["kern test"] = [[c["name"], c["ok"], c["detail"]] for c in checks["checks"]]
    return out


def tiny_hashes(families: list[str]) -> dict:
    out: dict = {}
    jobs = [(f, []) for f in families] + [v for v in VARIANTS if v[0] in families]
    for family, flags in jobs:
        with tempfile.TemporaryDirectory() as tmp:
            _run([*_kern(), "make-tiny", family, tmp, "--seed", "7", *flags])
            files = {p.name: _sha(p) for p in sorted(Path(tmp).iterdir())}
        out[" ".join([family, *flags])] = files
    return out


def compare(before: dict, after: dict, where: str = "") -> list[str]:
    diffs = []
    for key in sorted(set(before) | set(after)):
        here = f"{where}/{key}" if where else key
        if key not in before or key not in after:
            diffs.append(f"{here}: only in {'after' if key not in before else 'before'}")
        elif isinstance(before[key], dict) and isinstance(after[key], dict):
            diffs.extend(compare(before[key], after[key], here))
        elif before[key] != after[key]:
            diffs.append(f"{here}: {before[key]!r} != {after[key]!r}"[:400])
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--targets", help="comma-separated (default: all)")
    ap.add_argument("--compare", type=Path, help="a fingerprint to compare with")
    args = ap.parse_args()
    config = args.config.resolve()
    targets = tomllib.loads(config.read_text(encoding="utf-8"))["targets"]
    names = args.targets.split(",") if args.targets else list(targets)
    recipes_file = config.parent / "models.toml"
    recipes = read_recipes(recipes_file) if recipes_file.is_file() else {}
    needed = {(config.parent / targets[n]["checkpoint"]).resolve() for n in names}
    needed |= {
        (config.parent / targets[n]["draft"]).resolve()
        for n in names
        if targets[n].get("draft") not in (None, "ngram", "mtp")
    }
    for line in make_missing(_kern(), recipes, needed):
        print(line, file=sys.stderr)
    result: dict = {"targets": {}}
    for name in names:
        print(f"fingerprint: {name}", file=sys.stderr)
        result["targets"][name] = target_runs(config, name, targets[name])
    families = sorted({r["family"] for r in recipes.values()})
    result["make-tiny"] = tiny_hashes(families)
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    if args.compare is None:
        return 0
    diffs = compare(json.loads(args.compare.read_text(encoding="utf-8")), result)
    for d in diffs:
        print(d)
    print(f"{len(diffs)} difference(s) from {args.compare}")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
