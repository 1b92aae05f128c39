"""Budgets the machine cannot give (``pool_bytes`` / ``host_bytes`` = "30TiB") are refused before
anything is allocated: one line on stderr naming the key, the size asked and what the machine
has, under ``kern serve``, ``kern run`` and plain hypercorn alike; and where the figures come
from (MemAvailable, the memory cgroup)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kern.engine import budgets
from kern.errors import UsageError
from kern.kern_toml import Target
from kern.tiny import default_model_path

ASKED = "30TiB (32985348833280 bytes)"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERN_")}
    return {**env, "KERN_API_KEY": "test-key", **extra}


def _toml(tmp: Path, pool: str, host: str) -> Path:
    path = tmp / "kern.toml"
    path.write_text(
        f'[targets.tiny]\ncheckpoint = "{default_model_path()}"\n'
        f'pool_bytes = "{pool}"\nhost_bytes = "{host}"\n'
    )
    return path


def _commands(toml: Path) -> dict[str, list[str]]:
    kern = [sys.executable, "-m", "kern.cli"]
    target = ["--config", str(toml), "--target", "tiny"]
    hypercorn = [sys.executable, "-m", "hypercorn", "kern.app:app", "--bind", "127.0.0.1:0"]
    return {
        "serve": [*kern, "serve", *target, "--port", "0"],
        "run": [*kern, "run", *target, "--prompt", "hi", "--steps", "1"],
        "hypercorn": hypercorn,
        "hypercorn --workers 0": [*hypercorn, "--workers", "0"],
    }


@pytest.mark.parametrize("key", ["pool_bytes", "host_bytes"])
@pytest.mark.parametrize("how", ["serve", "run", "hypercorn", "hypercorn --workers 0"])
def test_a_budget_over_the_machine_is_one_line(tmp_path, key, how):
    sizes = {"pool_bytes": "4MiB", "host_bytes": "0", key: "30TiB"}
    toml = _toml(tmp_path, sizes["pool_bytes"], sizes["host_bytes"])
    out = subprocess.run(
        _commands(toml)[how],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(KERN_CONFIG=str(toml), KERN_TARGET="tiny"),
    )
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    prefix = {"serve": "kern serve", "run": "kern run"}.get(how, "kern")
    want = (
        rf"{prefix}: error: {re.escape(str(toml))}: targets\.tiny\.{key}: {key} = "
        rf"{re.escape(ASKED)} is more than the machine has: [0-9.]+[KMGT]?i?B of host memory "
        r"\((MemAvailable|cgroup memory\.max [0-9.]+\w+|cgroup memory\.limit_in_bytes [0-9.]+\w+)\)"
    )
    assert re.fullmatch(want, lines[0]), lines[0]
    assert out.stdout == ""
    # hypercorn's supervisor exits 0 whatever its worker does: kern ends it (kern.server.startup).
    assert out.returncode == 2 if how != "hypercorn" else out.returncode != 0


def test_the_flag_is_named(tmp_path):
    toml = _toml(tmp_path, "4MiB", "0")
    cmd = _commands(toml)["serve"] + ["--host-bytes", "30TiB"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_env())
    assert out.returncode == 2
    assert out.stderr.startswith(f"kern serve: error: --host-bytes: host_bytes = {ASKED} is more")
    assert len(out.stderr.splitlines()) == 1


# --- where the figures come from ----------------------------------------------------------------


def _target(**kw) -> Target:
    return Target("t", Path("/nowhere"), origin={"pool_bytes": "--pool-bytes"}, **kw)


def test_the_cgroup_limit_counts(tmp_path, monkeypatch):
    # A cgroup v2 at the mount's root with 1 GiB, 256 MiB of it used: 768 MiB left.
    (tmp_path / "memory.max").write_text(f"{2**30}\n")
    (tmp_path / "memory.current").write_text(f"{2**28}\n")
    monkeypatch.setattr(budgets, "_CGROUP_ROOT", tmp_path)
    mem = budgets.host_memory()
    assert mem is not None and mem.free == 3 * 2**28
    assert mem.source == "cgroup memory.max 1GiB"
    budgets.check_budgets(_target(pool_bytes=3 * 2**28))
    with pytest.raises(UsageError) as e:
        budgets.check_budgets(_target(pool_bytes=3 * 2**28 + 1))
    assert str(e.value) == (
        "--pool-bytes: pool_bytes = 768MiB (805306369 bytes) is more than the machine has: "
        "768MiB of host memory (cgroup memory.max 1GiB)"
    )


def test_no_limit_and_the_sum_on_the_cpu(tmp_path, monkeypatch):
    (tmp_path / "memory.max").write_text("max\n")  # v2's "no limit"
    monkeypatch.setattr(budgets, "_CGROUP_ROOT", tmp_path)
    mem = budgets.host_memory()
    assert mem is not None and mem.source == "MemAvailable"
    # Each fits, not both (margins for a machine whose memory moves meanwhile).
    half = mem.free // 2 + mem.free // 8
    with pytest.raises(UsageError, match=r"pool_bytes \+ host_bytes = .* both are host memory"):
        budgets.check_budgets(_target(pool_bytes=half, host_bytes=half))
    budgets.check_budgets(_target(pool_bytes=2**20, host_bytes=2**20))


def test_format_bytes():
    assert budgets.format_bytes(30 * 2**40) == "30TiB"
    assert budgets.format_bytes(3 * 2**29) == "1.5GiB"
    assert budgets.format_bytes(1000) == "1000B"
