"""kern.bench.decode on the embedded tiny model, a few steps: every field prints, the step's
split adds up (linears + other ops + host = ms/step), the weight bytes are the checkpoint's
linear weights, the rates and the floor follow from them, and the host table's parts add up
to its host row."""

from __future__ import annotations

import importlib.util

import pytest

from kern.bench import decode
from kern.checkpoint.load import load_checkpoint
from kern.tiny import default_model_path


def _rows(text: str, first: str) -> list[list[str]]:
    """The cells of the markdown table rows after the header line starting with ``first``."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(first))
    rows = []
    for line in lines[at + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def _num(cell: str) -> float:
    return float(cell.replace(",", "").rstrip("x"))


def test_the_split_adds_up_and_the_floor_follows(capsys):
    model = default_model_path()
    decode.main(
        ["--model", str(model), "--batches", "1", "3", "--steps", "4", "--prompt", "8"]
        + ["--bw-mib", "16", "--repeat", "2"]
    )
    text = capsys.readouterr().out
    assert "machine: read (sum)" in text and "GB/s, copy" in text
    bws = [float(text.split(key)[1].split(" GB/s")[0]) for key in ("(sum) ", "copy ", "bytes at ")]
    assert min(bws) > 0 and bws[2] == max(bws[:2])
    floor_bw = bws[2] * 1e9
    tensors = load_checkpoint(model).tensors
    weights = sum(
        t.numel() * 4
        for name, t in tensors.items()
        if name.endswith("_proj.weight") or name == "lm_head.weight"
    )
    rows = _rows(text, "| batch | tok/s")
    assert [r[0] for r in rows] == ["1", "3"]
    walls = {}
    for r in rows:
        b, tok_s, ms, lin, other, host, mb, gb_s, floor, ratio = map(_num, r)
        walls[int(b)] = ms
        assert ms > 0 and lin > 0 and other > 0
        assert tok_s == pytest.approx(b / ms * 1e3, rel=0.02, abs=0.1)
        assert lin + other + host == pytest.approx(ms, abs=0.03)
        assert mb == pytest.approx(weights / 1e6, abs=0.05)
        assert gb_s == pytest.approx(weights / (ms / 1e3) / 1e9, rel=0.05, abs=0.1)
        assert floor == pytest.approx(weights / floor_bw * 1e3, rel=0.1, abs=0.01)
        if floor >= 0.05:
            assert ratio == pytest.approx(ms / floor, rel=0.1)
    host_rows = {r[0]: r[1:] for r in _rows(text, "| per step |")}
    assert _num(host_rows["wall"][0]) == pytest.approx(walls[1], abs=0.006)
    _parts_add_up(host_rows)


def test_linears_times_the_steps_own_shapes_four_ways(capsys):
    model = default_model_path()
    decode.main(
        ["--model", str(model), "--batches", "1", "--steps", "2", "--prompt", "8"]
        + ["--bw-mib", "16", "--repeat", "2", "--linears"]
    )
    text = capsys.readouterr().out
    mb = _num(_rows(text, "| batch | tok/s")[0][6])
    head = next(line for line in text.splitlines() if line.startswith("| the step's "))
    ckpt = load_checkpoint(model)
    layers = ckpt.config.num_hidden_layers
    exact = sum(t.numel() * 4 for n, t in ckpt.tensors.items() if n.endswith("_proj.weight"))
    exact += ckpt.config.vocab_size * ckpt.config.hidden_size * 4
    # q/k/v fused, o, gate/up fused, down per layer, and the LM head
    assert head.startswith(f"| the step's {4 * layers + 1} linears ({mb:,.1f} MB)")
    rows = _rows(text, "| the step's ")
    assert [r[0] for r in rows] == [
        "oneDNN, weight reordered at load (kern's), M = 2",
        "oneDNN, plain [out, in] weight, M = 2",
        "MKL torch.mv, M = 1",
        "a torch sum over the same bytes",
    ]
    for _, ms, gb_s in rows:
        assert _num(ms) > 0  # printed to 0.001 ms, the rate to 0.1 GB/s
        low, high = exact / 1e6 / (_num(ms) + 5e-4), exact / 1e6 / max(_num(ms) - 5e-4, 1e-9)
        assert low - 0.05 <= _num(gb_s) <= high + 0.05


def test_host_itemises_a_step_at_each_batch(capsys):
    decode.main(["--host", "--host-batches", "1", "4", "--steps", "4", "--prompt", "8"])
    text = capsys.readouterr().out
    assert "Host overhead per scheduler step, embedded tiny qwen3" in text
    host_rows = {r[0]: r[1:] for r in _rows(text, "| per step |")}
    assert all(len(v) == 2 for v in host_rows.values())
    for part, _ in decode.PARTS:
        assert any(name.startswith(f"host: {part} (") for name in host_rows)
    _parts_add_up(host_rows)


def _parts_add_up(host_rows: dict[str, list[str]]) -> None:
    for col in range(len(host_rows["wall"])):
        wall = _num(host_rows["wall"][col])
        ops = _num(host_rows["torch ops"][col])
        host = _num(host_rows["**host** (wall - ops)"][col])
        assert wall > 0 and ops > 0 and _num(host_rows["torch calls from Python"][col]) > 10
        assert wall - ops == pytest.approx(host, abs=0.003)
        fixed = next(v for k, v in host_rows.items() if k.startswith("of the ops: calls x"))
        # A separate timing (calls x a 1-element add's cost): on a loaded machine it can
        # exceed the ops it estimates, so only its presence is checked, not its size.
        assert _num(fixed[col]) > 0
        parts = sum(_num(v[col]) for k, v in host_rows.items() if k.startswith("host: "))
        assert parts == pytest.approx(host, abs=0.006)


def test_bad_arguments_are_named(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        decode.main(["--steps", "0"])
    assert "--steps must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        decode.main(["--model", "/nonexistent/model"])
    assert "--model /nonexistent/model: no config.json" in capsys.readouterr().err
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llama_cpp" else find_spec(name, *a),
    )
    with pytest.raises(SystemExit):
        decode.main(["--llama-cpp", "model.gguf"])
    err = capsys.readouterr().err
    assert "--llama-cpp needs the llama_cpp package" in err and "llama-cpp-python" in err
