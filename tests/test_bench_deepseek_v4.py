"""``python -m kern.bench.deepseek_v4`` runs and prints its tables (small sizes here)."""

from __future__ import annotations

import pytest

from kern.bench import deepseek_v4


def test_the_benchmark_prints_bytes_speeds_and_the_indexer_share(capsys):
    pytest.importorskip("transformers")
    args = ["--prompt", "9", "--steps", "3", "--batch", "2", "--long", "96", "--repeat", "1"]
    assert deepseek_v4.main(args) == 0
    out = capsys.readouterr().out
    rows = [r.split("|") for r in out.splitlines() if r.startswith(("| Flash", "| Pro ("))]
    assert len(rows) == 4
    for r in rows:
        assert r[3].strip() == r[4].strip()  # Layout's page bytes are the formula's
    assert "| Pro, vLLM's quoted figure |" in out
    speeds = [r for r in out.splitlines() if r.startswith(("| 1 |", "| 2 |"))]
    assert len(speeds) == 2 and all(r.rstrip().endswith("x |") for r in speeds)
    assert "| 96 |" in out and "%" in out.split("| 96 |")[1]
