"""Tiny checkpoints a config names but a fresh clone lacks, made with `kern make-tiny`.

A recipes file (``models.toml`` beside the config) maps a checkpoint path, relative to that
file, to the `kern make-tiny` arguments that write it::

    [models."models/qwen3"]
    family = "qwen3"
    seed = 1
    args = ["--layers", "2"]        # optional: more make-tiny flags

make-tiny is deterministic from its arguments, so a folder is remade only when its recipe
changed (the recipe is stamped inside it) or it is missing.
"""

from __future__ import annotations

import json
import subprocess
import tomllib
from pathlib import Path

__all__ = ["RECIPE_STAMP", "RecipeError", "make_missing", "read_recipes"]

RECIPE_STAMP = "kern-e2e-recipe.json"
_KEYS = {"family", "seed", "args"}


class RecipeError(ValueError):
    """The recipes file is malformed (the message names the file and the key)."""


def read_recipes(path: Path) -> dict[Path, dict]:
    """Recipes by resolved checkpoint folder."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{path}: not valid TOML: {e}") from e
    unknown = set(data) - {"models"}
    if unknown:
        raise RecipeError(f"{path}: unknown key {sorted(unknown)[0]!r} (expected [models.DIR])")
    out = {}
    for folder, table in data.get("models", {}).items():
        where = f"{path}: models.{folder!r}"
        if not isinstance(table, dict):
            raise RecipeError(f"{where} must be a table")
        for key in table:
            if key not in _KEYS:
                raise RecipeError(f"{where}: unknown key {key!r} (known: family, seed, args)")
        if not isinstance(table.get("family"), str):
            raise RecipeError(f"{where}: 'family' must be a string")
        seed = table.get("seed", 0)
        args = table.get("args", [])
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise RecipeError(f"{where}: 'seed' must be an integer")
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise RecipeError(f"{where}: 'args' must be a list of strings")
        recipe = {"family": table["family"], "seed": seed, "args": args}
        out[(path.parent / folder).resolve()] = recipe
    return out


def make_missing(kern: list[str], recipes: dict[Path, dict], needed: set[Path]) -> list[str]:
    """Make each folder of ``needed`` that has a recipe and is missing or stale. Returns one
    line per folder made; raises ``RuntimeError`` naming the command when make-tiny fails."""
    made = []
    for folder in sorted(needed):
        recipe = recipes.get(folder)
        if recipe is None:
            continue
        stamp = folder / RECIPE_STAMP
        if stamp.is_file() and json.loads(stamp.read_text(encoding="utf-8")) == recipe:
            continue
        cmd = [*kern, "make-tiny", recipe["family"], str(folder), "--seed", str(recipe["seed"])]
        cmd += [*recipe["args"], "--force"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit {out.returncode}: {out.stderr.strip()}")
        stamp.write_text(json.dumps(recipe) + "\n", encoding="utf-8")
        made.append(f"made {folder} ({recipe['family']}, seed {recipe['seed']})")
    return made
