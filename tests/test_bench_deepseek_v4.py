"""``python -m kern.bench.deepseek_v4`` runs and prints its tables (small sizes here)."""

from __future__ import annotations

import pytest

from kern.bench import deepseek_v4


def test_the_benchmark_prints_bytes_hits_speeds_and_the_indexer_share(capsys):
    pytest.importorskip("transformers")
    args = ["--prompt", "9", "--steps", "3", "--batch", "2", "--long", "96", "--repeat", "1"]
    assert deepseek_v4.main([*args, "--requests", "120"]) == 0
    out = capsys.readouterr().out
    rows = [r.split("|") for r in out.splitlines() if r.startswith(("| Flash", "| Pro ("))]
    assert len(rows) == 4
    for r in rows:
        # A running sequence: its pages and two window pages, within 1.2x of the formula.
        assert 1.0 <= float(r[8]) <= 1.2, r
    assert "| Pro, vLLM's quoted figure |" in out
    hits = [r.split("|") for r in out.splitlines() if r.startswith(("| multi-turn", "| system"))]
    assert len(hits) == 8
    for trace in (hits[:4], hits[4:]):
        rates = [float(r[3].strip().rstrip("%")) for r in trace]
        # Sparser snapshots never hit more; a snapshot at every page end hits as k = 1 does
        # here (pages of 128 and a window of 128 end together).
        assert rates[0] >= rates[1] >= rates[2] and rates[3] == rates[0]
    speeds = [r for r in out.splitlines() if r.startswith(("| 1 |", "| 2 |"))]
    assert len(speeds) == 2 and all(r.rstrip().endswith("x |") for r in speeds)
    assert "| 96 |" in out and "%" in out.split("| 96 |")[1]
