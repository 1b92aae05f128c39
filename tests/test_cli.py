"""kern.cli: make-tiny, run (JSON, probes, targets), test, and clear exit-2 errors."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kern import cli
from kern.checkpoint.load import load_checkpoint
from kern.cli import selfcheck
from kern.probe import probe_ulps, read_probe
from kern.tiny import default_model_path, make_tiny


def kern(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "kern.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def run_json(capsys, *args: str) -> dict:
    assert cli.main(["run", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def fail(capsys, *args: str) -> str:
    """Run the CLI expecting exit 2; return its stderr."""
    try:
        code = cli.main(list(args))
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    return capsys.readouterr().err


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_make_tiny_subprocess_matches_the_library(tmp_path):
    out = kern("make-tiny", "qwen3_moe", str(tmp_path / "a"), "--experts", "4", "--seed", "1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "a")
    make_tiny("qwen3_moe", tmp_path / "b", experts=4, seed=1)
    assert digests(tmp_path / "a") == digests(tmp_path / "b")


def test_make_tiny_sets_the_context(tmp_path, capsys):
    """An agent's prompts need a long context: the folder declares the one asked for."""
    assert (
        cli.main(["make-tiny", "qwen3", str(tmp_path), "--max-position-embeddings", "131072"]) == 0
    )
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["max_position_embeddings"] == 131072
    assert load_checkpoint(tmp_path).config.max_position_embeddings == 131072


def test_run_json_subprocess(tmp_path):
    out = kern("run", "--prompt-ids", "1,2,3", "--steps", "6", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    from kern.engine.generate import generate

    expected = generate(load_checkpoint(default_model_path()), [1, 2, 3], 6, threads=2).ids
    assert result["ids"] == expected
    assert result["threads"] == 2 and result["rows"] == 1 and result["prompt_ids"] == [1, 2, 3]
    assert result["finish_reason"] == "length" and result["sampling"] is None
    assert result["model"] == str(default_model_path())


def test_run_plain_prints_text_and_says_threads(capsys):
    assert cli.main(["run", "--prompt", "Hello", "--chat", "--steps", "4", "--threads", "1"]) == 0
    out = capsys.readouterr()
    assert out.out.endswith("\n")
    assert "threads=1" in out.err and "greedy" in out.err


def test_run_reports_pinned_threads(capsys):
    assert run_json(capsys, "--prompt", "Hi", "--steps", "2", "--threads", "1")["threads"] == 1


def test_probe_files(tmp_path, capsys):
    probe_dir = tmp_path / "probes"
    result = run_json(
        capsys,
        "--prompt-ids",
        "5,6,7,8",
        "--steps",
        "5",
        "--probe-dir",
        str(probe_dir),
        "--probe-steps",
        "0,3",
        "--probe-labels",
        "first,fourth",
        "--probe-k",
        "8",
    )
    assert sorted(p.name for p in probe_dir.iterdir()) == ["first.json", "fourth.json"]
    assert result["probe_files"] == [str(probe_dir / "first.json"), str(probe_dir / "fourth.json")]
    probe = read_probe(probe_dir / "fourth.json")
    assert probe["step"] == 3 and probe["label"] == "fourth" and probe["position"] == 4 + 3 - 1
    assert probe["rows"] == 1 and probe["threads"] == 2
    assert len(probe["ids"]) == len(probe["logits_f32_bits"]) == 8
    # greedy: the probed step's token is the top entry, and logits are descending
    assert probe["ids"][0] == probe["token_id"] == result["ids"][3]
    assert probe["logits"] == sorted(probe["logits"], reverse=True)
    raw = json.loads((probe_dir / "fourth.json").read_text())
    assert raw["logits"] == probe["logits"]  # the decimal copy is the exact float32 value
    assert probe_ulps(probe["by_id"][probe["ids"][0]], probe["by_id"][probe["ids"][0]]) == 0


def test_probe_every_step_by_default(tmp_path, capsys):
    run_json(capsys, "--prompt", "x", "--steps", "3", "--probe-dir", str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-{i}.json" for i in range(3)]


def test_probe_ulps():
    one = 0x3F800000  # 1.0f
    assert probe_ulps(one, one + 4) == 4
    assert probe_ulps(0x00000000, 0x80000000) == 0  # +0 and -0
    assert probe_ulps(0x00000001, 0x80000001) == 2  # across zero


def test_config_target(tmp_path, capsys):
    toml = tmp_path / "kern.toml"
    model = default_model_path()
    toml.write_text(f'[targets.tiny]\ncheckpoint = "{model}"\nrows = [1, 3]\nthreads = 1\n')
    wide = run_json(
        capsys, "--config", str(toml), "--target", "tiny", "--prompt", "ab", "--steps", "6"
    )
    assert wide["rows"] == 3 and wide["threads"] == 1 and wide["target"] == "tiny"
    narrow = run_json(
        capsys,
        "--config",
        str(toml),
        "--target",
        "tiny",
        "--prompt",
        "ab",
        "--steps",
        "6",
        "--rows",
        "1",
    )
    assert narrow["ids"] == wide["ids"]
    err = fail(
        capsys,
        "run",
        "--config",
        str(toml),
        "--target",
        "tiny",
        "--prompt",
        "a",
        "--steps",
        "1",
        "--rows",
        "2",
    )
    assert "declares rows [1, 3]" in err


def test_sampling_flags(capsys):
    a = run_json(capsys, "--prompt", "x", "--steps", "6", "--top-k", "50", "--seed", "7")
    b = run_json(capsys, "--prompt", "x", "--steps", "6", "--top-k", "50", "--seed", "7")
    assert a["ids"] == b["ids"]
    assert a["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "seed": 7}
    assert "top_p must be in (0, 1]" in fail(
        capsys, "run", "--prompt", "x", "--steps", "1", "--top-p", "0"
    )


def test_stops_at_end_of_sequence(monkeypatch, capsys):
    import kern.engine.generate

    real = kern.engine.generate.generate
    im_end = 511

    def fake(*args, **kwargs):
        result = real(*args, **kwargs)
        return type(result)([*result.ids[:2], im_end, *result.ids[3:]], result.probes)

    monkeypatch.setattr(kern.engine.generate, "generate", fake)
    stopped = run_json(capsys, "--prompt", "x", "--steps", "5")
    assert stopped["ids"][-1] == im_end and len(stopped["ids"]) == 3
    assert stopped["finish_reason"] == "stop" and "<|im_end|>" not in stopped["text"]
    ignored = run_json(capsys, "--prompt", "x", "--steps", "5", "--ignore-eos")
    assert len(ignored["ids"]) == 5 and ignored["finish_reason"] == "length"


def test_kern_test_passes_on_the_default_model(capsys):
    assert cli.main(["test", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "threads=2" in out and out.strip().endswith("passed") and "FAIL" not in out


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_5"])
def test_kern_test_passes_on_every_family(family, tmp_path, capsys):
    make_tiny(family, tmp_path, seed=5)
    assert cli.main(["test", "--model", str(tmp_path), "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert f": {family}, cpu/float32" in out and "runner vs torch reference: 3 tokens" in out


def test_kern_test_fails_when_rows_disagree(monkeypatch, capsys):
    import kern.engine.generate

    real = kern.engine.generate.generate

    def broken(checkpoint, prompt_ids, steps, *, rows=1, **kwargs):
        result = real(checkpoint, prompt_ids, steps, rows=rows, **kwargs)
        if rows > 1:
            return type(result)([(result.ids[0] + 1) % 512, *result.ids[1:]], result.probes)
        return result

    monkeypatch.setattr(kern.engine.generate, "generate", broken)
    assert cli.main(["test", "--steps", "2", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"]
    assert [c["name"] for c in report["checks"] if not c["ok"]] == [
        "chat: rows 2 vs rows 1",
        "text: rows 2 vs rows 1",
        "code: rows 2 vs rows 1",
    ]


def _result(ids, tops):
    """A GenerateResult whose probe at step s has logits tops[s] (descending) over ids 0.."""
    from kern.engine.generate import GenerateResult

    probes = {s: (torch.tensor(t), torch.arange(len(t))) for s, t in enumerate(tops)}
    return GenerateResult(ids, probes)


def test_kern_test_compares_the_runner_with_the_reference():
    ref = _result([0, 0, 1], [[3.0, 1.0], [2.0, 1.0], [2.0, 1.99999]])
    same = selfcheck._against_reference(
        "t", _result([0, 0, 1], [[3.0, 1.0], [2.0, 1.0], [2.0, 1.99999]]), ref, 1e-4
    )
    assert same.ok and "3 tokens equal; max |logit diff| 0" in same.detail
    drift = selfcheck._against_reference(
        "t", _result([0, 0, 1], [[3.0, 1.0], [2.001, 1.0], [2.0, 1.99999]]), ref, 1e-4
    )
    assert not drift.ok and "max |logit diff| 0.001" in drift.detail
    # step 2: the runner picks 0, which the reference has 1e-5 under its top: a near tie
    tie = selfcheck._against_reference(
        "t", _result([0, 0, 0], [[3.0, 1.0], [2.0, 1.0], [2.0, 1.9]]), ref, 1e-4
    )
    assert (
        tie.ok and "step 2: runner chose 0, reference 1" in tie.detail and "near tie" in tie.detail
    )
    far = selfcheck._against_reference(
        "t", _result([1, 0, 1], [[3.0, 1.0], [2.0, 1.0], [2.0, 1.9]]), ref, 1e-4
    )
    assert (
        not far.ok
        and "step 0: runner chose 1, reference 0; the reference puts 1 2 under" in far.detail
    )


def test_kern_test_fails_when_the_runner_leaves_the_reference(monkeypatch, capsys):
    import kern.engine.generate

    real = kern.engine.generate.generate

    def broken(checkpoint, prompt_ids, steps, *, reference=False, **kwargs):
        result = real(checkpoint, prompt_ids, steps, reference=reference, **kwargs)
        if reference:  # a reference whose logits belong to the next token id
            probes = {s: (v, (i + 1) % 512) for s, (v, i) in result.probes.items()}
            return type(result)([(t + 1) % 512 for t in result.ids], probes)
        return result

    monkeypatch.setattr(kern.engine.generate, "generate", broken)
    assert cli.main(["test", "--steps", "2", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in report["checks"] if not c["ok"]] == [
        "chat: runner vs torch reference",
        "text: runner vs torch reference",
        "code: runner vs torch reference",
    ]


def test_bad_arguments_exit_2_subprocess():
    out = kern("run", "--prompt", "a", "--prompt-ids", "1", "--steps", "1")
    assert out.returncode == 2
    assert "not allowed with argument" in out.stderr
    out = kern("run", "--model", "/nonexistent/ckpt", "--prompt", "a", "--steps", "1")
    assert out.returncode == 2
    assert out.stderr.strip() == "kern run: error: /nonexistent/ckpt: no such checkpoint folder"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--prompt", "a"], "the following arguments are required: --steps"),
        (["run", "--prompt", "a", "--steps", "0"], "0 is not a positive integer"),
        (["run", "--prompt-ids", "1,x", "--steps", "1"], "comma-separated list of token ids"),
        (["run", "--prompt-ids", "1,99999", "--steps", "1"], "id 99999 is not below vocab_size"),
        (["run", "--prompt", "a", "--steps", "2", "--probe-steps", "0"], "need --probe-dir"),
        (
            [
                "run",
                "--prompt",
                "a",
                "--steps",
                "2",
                "--probe-dir",
                "d",
                "--probe-steps",
                "0,1",
                "--probe-labels",
                "a",
            ],
            "has 1 labels for 2 --probe-steps",
        ),
        (
            ["run", "--prompt", "a", "--steps", "2", "--probe-dir", "d", "--probe-steps", "2"],
            "--probe-steps 2 is past --steps 2",
        ),
        (
            [
                "run",
                "--prompt",
                "a",
                "--steps",
                "1",
                "--probe-dir",
                "d",
                "--probe-steps",
                "0",
                "--probe-labels",
                "../x",
            ],
            "it names a file",
        ),
        (["run", "--prompt-ids", "1", "--steps", "1", "--chat"], "--chat needs --prompt"),
        (["run", "--prompt", "a", "--steps", "1", "--target", "t"], "--target needs --config"),
        (["make-tiny", "llama", "d"], "invalid choice: 'llama'"),
        (["make-tiny", "qwen3", "d", "--experts", "4"], "'experts' does not apply"),
        (
            ["make-tiny", "kimi_linear", "d", "--max-position-embeddings", "64"],
            "'max_position_embeddings' does not apply to family 'kimi_linear'",
        ),
        (["make-tiny", "qwen3", "d", "--max-position-embeddings", "0"], "positive"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_bad_arguments_exit_2(capsys, args, message):
    assert message in fail(capsys, *args)


def test_config_errors_name_file_and_key(tmp_path, capsys):
    toml = tmp_path / "kern.toml"
    toml.write_text('[targets.a]\ncheckpoint = "x"\npage_token = 32\n')
    err = fail(
        capsys, "run", "--config", str(toml), "--target", "a", "--prompt", "x", "--steps", "1"
    )
    assert f"{toml}: targets.a: unknown key 'page_token'" in err
    toml.write_text('[targets.a]\ncheckpoint = "x"\n')
    err = fail(
        capsys, "run", "--config", str(toml), "--target", "b", "--prompt", "x", "--steps", "1"
    )
    assert f"{toml}: no target 'b' (targets: a)" in err
    toml.write_text(
        '[targets.a]\ncheckpoint = "x"\n[targets.g]\ncheckpoint = "x"\ndevice = "cuda"\n'
        '[targets.f]\ncheckpoint = "x"\ndevice = "cuda"\ndtype = "float32"\n'
        '[targets.h]\ncheckpoint = "x"\ndtype = "bfloat16"\n'
    )
    err = fail(capsys, "test", "--config", str(toml), "--target", "f")
    assert "target 'f' is cuda/float32: the cuda backend runs bfloat16" in err
    err = fail(
        capsys, "run", "--config", str(toml), "--target", "h", "--prompt", "x", "--steps", "1"
    )
    assert "target 'h' is cpu/bfloat16: the cpu backend runs float32" in err
    if not torch.cuda.is_available():
        err = fail(capsys, "test", "--config", str(toml), "--target", "g")
        assert "target 'g' runs on cuda, but torch sees no CUDA device here" in err
    err = fail(capsys, "test", "--config", str(toml))
    assert "--config needs --target NAME" in err
    err = fail(capsys, "test", "--config", str(tmp_path / "missing.toml"), "--target", "a")
    assert "missing.toml: no such file" in err


def test_make_tiny_moe_flags(tmp_path, capsys):
    args = ["make-tiny", "qwen3_moe", str(tmp_path), "--layers", "4", "--no-norm-topk-prob"]
    args += ["--decoder-sparse-step", "2", "--mlp-only-layers", "3"]
    assert cli.main(args) == 0
    c = load_checkpoint(tmp_path).config
    own = c.family_fields
    assert (c.experts.norm_topk_prob, own.decoder_sparse_step, own.mlp_only_layers) == (
        False,
        2,
        (3,),
    )


def test_make_tiny_refuses_a_non_empty_dir(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("x")
    assert "not empty" in fail(capsys, "make-tiny", "qwen3", str(tmp_path))
    assert cli.main(["make-tiny", "qwen3", str(tmp_path), "--force", "--layers", "1"]) == 0
    assert load_checkpoint(tmp_path).config.num_hidden_layers == 1


def test_rows_are_named_before_the_target_check(tmp_path, capsys):
    """kern run and kern serve select a target in one order (kern.engine.targets.select): with a
    --rows the target does not declare and a dtype its backend does not run, the rows first."""
    toml = tmp_path / "kern.toml"
    toml.write_text('[targets.h]\ncheckpoint = "x"\ndtype = "bfloat16"\n')
    where = ["--config", str(toml), "--target", "h", "--rows", "2"]
    err = fail(capsys, "run", "--prompt", "a", "--steps", "1", *where)
    assert "--rows 2: target 'h' declares rows [1]" in err and "bfloat16" not in err
    # A subprocess: kern serve configures the process's logging.
    out = kern("serve", *where)
    assert out.returncode == 2 and "--rows 2: target 'h' declares rows [1]" in out.stderr
    assert "bfloat16" not in out.stderr


def test_chat_on_a_folder_without_a_chat_template_exits_2(tmp_path, capsys):
    from kern.tiny import make_tiny

    model = make_tiny("qwen3", tmp_path / "m")
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    err = fail(capsys, "run", "--model", str(model), "--prompt", "Hi", "--steps", "1", "--chat")
    assert err.startswith("kern run: error: --chat: ") and "chat template" in err
    assert "Traceback" not in err
