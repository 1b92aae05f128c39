"""The end-to-end gate's rules (tools/e2e), with a fake `kern` where no model is needed: an
unknown target name fails the run, the cache of `kern run` answers is keyed by everything that
determines an answer, the probe passes --rows even when it is 1, and a failed gate exits
non-zero with a summary. The gate itself runs in scripts/test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kern.kern_toml import Target, load_toml_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "e2e"))

import e2e  # noqa: E402
import oracle  # noqa: E402
from http_client import Answer  # noqa: E402
from scenarios import SCENARIOS, Result  # noqa: E402

# A stand-in for `kern run`: logs its arguments, answers [7, 8, 9], and writes a probe where
# token 8 is 3 ULPs under the top (token 7) and token 9 is 50.
FAKE_KERN = r"""
import json, os, pathlib, sys
args = sys.argv[1:]
with open(os.environ["FAKE_KERN_LOG"], "a") as f:
    f.write(json.dumps(args) + "\n")
def opt(name):
    return args[args.index(name) + 1] if name in args else None
if opt("--probe-dir"):
    d = pathlib.Path(opt("--probe-dir"))
    d.mkdir(parents=True, exist_ok=True)
    top = 0x40400000
    probe = {"format": "kern-probe/1", "label": opt("--probe-labels"), "step": 0,
             "position": 1, "token_id": 7, "rows": int(opt("--rows")), "threads": 2,
             "device": "cpu", "dtype": "float32", "prompt_len": 2, "ids": [7, 8, 9],
             "logits_f32_bits": [top, top - 3, top - 50], "logits": [0.0, 0.0, 0.0]}
    (d / (opt("--probe-labels") + ".json")).write_text(json.dumps(probe))
print(json.dumps({"ids": [7, 8, 9], "text": "abc", "prompt_ids": [1, 2],
                  "finish_reason": "length"}))
"""


@pytest.fixture
def fake_kern(tmp_path, monkeypatch) -> tuple[list[str], Path]:
    script = tmp_path / "fake_kern.py"
    script.write_text(FAKE_KERN)
    log = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_KERN_LOG", str(log))
    return [sys.executable, str(script)], log


def _calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _checkpoint(tmp_path: Path, weights: bytes = b"w1") -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    (ckpt / "config.json").write_text('{"model_type": "qwen3"}')
    (ckpt / "model.safetensors").write_bytes(weights)
    return ckpt


def _oracle(kern, tmp_path, target: Target, kern_id: str = "k1") -> oracle.Oracle:
    return oracle.Oracle(
        kern,
        tmp_path / "kern.toml",
        target,
        kern_id=kern_id,
        cache_dir=tmp_path / "cache",
        work_dir=tmp_path / "work",
        timeout=60,
    )


def test_unknown_target_names_fail_the_run(tmp_path, capsys):
    config = tmp_path / "kern.toml"
    config.write_text('[targets.a]\ncheckpoint = "x"\n[targets.b]\ncheckpoint = "y"\n')
    code = e2e.main(["--config", str(config), "--targets", "a,nope,other", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert "'nope'" in err and "'other'" in err and "targets: a, b" in err
    assert not (tmp_path / "summary.json").exists()  # nothing ran
    assert [t.name for t in e2e.select_targets(load_toml_config(config), "b,a")] == ["b", "a"]


def test_cache_key_covers_everything_that_determines_an_answer(tmp_path, fake_kern):
    kern, log = fake_kern
    target = Target(name="t", checkpoint=_checkpoint(tmp_path))
    ref = _oracle(kern, tmp_path, target).answer([1, 2], 3, 1)
    assert ref.ids == [7, 8, 9] and len(_calls(log)) == 1
    # Another run, same everything: the answer comes from the cache.
    again = _oracle(kern, tmp_path, target)
    assert again.answer([1, 2], 3, 1) == ref and again.num_cached == 1
    assert len(_calls(log)) == 1
    # Any of these changes the key: prompt ids, steps, rows, kern, config, checkpoint bytes.
    _oracle(kern, tmp_path, target).answer([1, 3], 3, 1)
    _oracle(kern, tmp_path, target).answer([1, 2], 4, 1)
    _oracle(kern, tmp_path, target).answer([1, 2], 3, 2)
    _oracle(kern, tmp_path, target, kern_id="k2").answer([1, 2], 3, 1)
    bigger = Target(name="t", checkpoint=target.checkpoint, pool_bytes=2**20)
    _oracle(kern, tmp_path, bigger).answer([1, 2], 3, 1)
    _checkpoint(tmp_path, weights=b"w2")
    _oracle(kern, tmp_path, target).answer([1, 2], 3, 1)
    assert len(_calls(log)) == 7
    # The name and the path do not change an answer; the bytes do.
    renamed = Target(name="other", checkpoint=target.checkpoint)
    assert oracle.target_fingerprint(renamed) == oracle.target_fingerprint(target)
    # The installed kern's fingerprint covers its version, its files and its dependencies.
    fingerprint = oracle.kern_fingerprint()
    assert "+" in fingerprint and "torch==" in fingerprint and "tokenizers==" in fingerprint


def test_no_cache_keeps_nothing_across_runs(tmp_path, fake_kern):
    kern, log = fake_kern
    target = Target(name="t", checkpoint=_checkpoint(tmp_path))
    for _ in range(2):
        o = oracle.Oracle(
            kern,
            tmp_path / "kern.toml",
            target,
            kern_id="k",
            cache_dir=None,
            work_dir=tmp_path,
            timeout=60,
        )
        o.answer([1, 2], 3, 1)
        o.answer([1, 2], 3, 1)  # within a run, answered once
    assert len(_calls(log)) == 2


def test_the_probe_passes_rows_even_when_it_is_1(tmp_path, fake_kern):
    kern, log = fake_kern
    o = _oracle(kern, tmp_path, Target(name="t", checkpoint=_checkpoint(tmp_path)))
    ok, seen = o.excuse([1, 2, 7], (8, 7), rows=1)
    args = _calls(log)[-1]
    assert args[args.index("--rows") + 1] == "1"
    assert args[args.index("--prompt-ids") + 1] == "1,2,7"
    assert args[args.index("--steps") + 1] == "1"
    assert ok and "3 ULPs" in seen


def test_a_divergence_is_excused_only_within_4_ulps(tmp_path, fake_kern):
    kern, _ = fake_kern
    o = _oracle(kern, tmp_path, Target(name="t", checkpoint=_checkpoint(tmp_path)))
    ref = oracle.Reference([7, 8, 9], "abc", [1, 2], "length")
    same = oracle.judge(o, [1, 2], [7, 8, 9], "abc", ref, 1)
    assert same.identical and same.ok
    text = oracle.judge(o, [1, 2], [7, 8, 9], "ab", ref, 1)
    assert not text.ok and "text differs" in text.detail
    near = oracle.judge(o, [1, 2], [8, 8, 9], "x", ref, 1)  # 8 is 3 ULPs under the top
    assert near.excused and near.ok
    far = oracle.judge(o, [1, 2], [9, 8, 9], "x", ref, 1)  # 9 is 50 ULPs under
    assert not far.ok and "50 ULPs" in far.detail
    short = oracle.judge(o, [1, 2], [7, 8], "ab", ref, 1)
    assert not short.ok and "went on past" in short.detail
    reported = oracle.judge(o, [1, 2], [9, 8, 9], "x", ref, 1, gated=False)
    assert reported.ok and not reported.excused and not reported.identical


def test_a_failed_gate_exits_non_zero_with_a_summary(tmp_path, monkeypatch):
    config = tmp_path / "kern.toml"
    config.write_text(
        '[targets.gone]\ncheckpoint = "missing"\n'
        '[targets.gpu]\ncheckpoint = "missing"\ndevice = "cuda"\n'
    )
    monkeypatch.setattr(e2e, "_has_gpu", lambda: False)
    out = tmp_path / "out"
    assert e2e.main(["--config", str(config), "--out", str(out)]) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] is False
    gone, gpu = summary["targets"]
    assert [s["scenario"] for s in gone["scenarios"]] == list(SCENARIOS)
    assert all(s["status"] == "fail" for s in gone["scenarios"])
    assert "does not exist" in gone["scenarios"][0]["failures"][0]
    # A target that needs a GPU is skipped on a machine without one, and the summary says so.
    assert gpu["skipped"].startswith("needs a GPU")
    assert all(s["status"] == "skip" for s in gpu["scenarios"])
    md = (out / "summary.md").read_text()
    assert "Result: FAIL" in md and "skip: needs a GPU" in md
    # The GPU target alone is skipped, not failed: exit 0.
    assert e2e.main(["--config", str(config), "--targets", "gpu", "--out", str(out)]) == 0


def test_jobs_gate_targets_at_once_and_report_them_in_order(tmp_path, monkeypatch):
    config = tmp_path / "kern.toml"
    config.write_text("".join(f'[targets.t{i}]\ncheckpoint = "missing{i}"\n' for i in range(3)))
    out = tmp_path / "out"
    assert e2e.main(["--config", str(config), "--out", str(out), "--jobs", "2"]) == 1
    summary = json.loads((out / "summary.json").read_text())
    assert [t["name"] for t in summary["targets"]] == ["t0", "t1", "t2"]
    assert all("missing" in t["scenarios"][0]["failures"][0] for t in summary["targets"])
    assert e2e.main(["--config", str(config), "--out", str(out), "--jobs", "0"]) == 2


def test_many_kern_runs_in_one_process_answer_as_the_command_does(tmp_path):
    """kern_runs.py (the oracle's batch): each command line through kern's entry point gives
    the JSON the `kern run` command prints, a failing one its exit code and error."""
    from kern.tiny import default_model_path

    model = str(default_model_path())
    runs = [
        ["run", "--model", model, "--prompt", "The quick brown fox", "--steps", "6", "--json"],
        ["run", "--model", model, "--prompt-ids", "5,6,7", "--steps", "4", "--rows", "3", "--json"],
        ["run", "--model", model, "--prompt", "x", "--steps", "0", "--json"],
    ]
    lines = "".join(json.dumps(r) + "\n" for r in runs)
    script = Path(__file__).resolve().parents[1] / "tools" / "e2e" / "kern_runs.py"
    done = subprocess.run(
        [sys.executable, str(script)], input=lines, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    got = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(got) == 3
    for argv, res in zip(runs[:2], got, strict=False):
        alone = subprocess.run(
            [sys.executable, "-m", "kern.cli", *argv], capture_output=True, text=True, timeout=300
        )
        assert alone.returncode == 0 and res["rc"] == 0, (alone.stderr, res["err"])
        assert json.loads(res["out"]) == json.loads(alone.stdout)
    assert got[2]["rc"] == 2 and "--steps" in got[2]["err"] and got[2]["out"] == ""


def test_prefetch_needs_the_installed_kern(tmp_path, fake_kern):
    """With another kern command (the fake here) answers run one by one, when asked for."""
    kern, log = fake_kern
    o = _oracle(kern, tmp_path, Target(name="t", checkpoint=_checkpoint(tmp_path)))
    o.prefetch([([1, 2], 3, 1, False), ("hi", 3, 1, True)])
    assert _calls(log) == [] and o.num_batches == 0
    assert o.answer([1, 2], 3, 1).ids == [7, 8, 9] and len(_calls(log)) == 1


def test_result_counts_cached_tokens():
    res = Result("warm")
    res.add_cached(Answer([1], "a", "length", cached_tokens=0))
    res.add_cached(Answer([1], "a", "length", cached_tokens=5))
    res.add_cached(Answer([1], "a", "length"))
    assert res.cached_tokens == 5 and res.status == "pass"
    res.fail("x")
    assert res.status == "fail" and res.failures == ["x"]


def test_rank_targets_report_identity_across_rank_counts(tmp_path, fake_kern):
    """The 'vs 1 rank' row: kern run at the target's ranks against `kern run --ranks 1`,
    counted, with the probe's ULP distances at the first divergence; reported, not gated."""
    from types import SimpleNamespace

    from http_client import Request
    from ranks import across_rank_counts

    kern, log = fake_kern
    target = Target(name="t", checkpoint=_checkpoint(tmp_path), ranks=2, parallel="ep")
    gate = SimpleNamespace(
        oracle=_oracle(kern, tmp_path, target),
        target=target,
        rows=1,
        prompts=[Request("a", 32), Request("b", 32)],
        # The fake's one-rank answer is [7, 8, 9]: the first is the same, the second parts
        # at step 1 with token 9, 50 ULPs under the top where the one-rank run took 8 (3).
        refs=[
            oracle.Reference([7, 8, 9], "abc", [1, 2], "length"),
            oracle.Reference([7, 9, 9], "acc", [1, 2], "length"),
        ],
    )
    res = across_rank_counts(gate)
    assert res.status == "pass" and res.compared == 2 and res.diverged == 1
    assert res.notes[0].startswith("1 of 2 answers byte-identical at ranks 2 (ep)")
    assert "step 1: ranks 2 9, 1 rank 8" in res.notes[1]
    assert "9: 50 ULPs under the top, 8: 3 ULPs under the top" in res.notes[1]
    calls = _calls(log)
    assert all(c[-2:] == ["--ranks", "1"] for c in calls)
    probe = calls[-1]
    assert probe[probe.index("--prompt-ids") + 1] == "1,2,7"
