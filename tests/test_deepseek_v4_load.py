"""deepseek_v4 checkpoints as kern reads them (no model outputs here): config.json as
transformers' DeepseekV4Config reads it, legacy spellings included; the names transformers'
save_pretrained writes; the release's names, FP8 projections and FP4 experts against their
dequantised twins; and every refusal by name."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kern import cli
from kern.checkpoint.config import load_config, parse_config
from kern.checkpoint.errors import (
    ConfigFieldError,
    MissingTensorError,
    TensorError,
    TensorShapeError,
    UnexpectedTensorError,
    UnsupportedModelError,
)
from kern.checkpoint.load import load_checkpoint
from kern.checkpoint.names import canonical_name, expected_shapes
from kern.models.deepseek_v4.tensors import released_name as released_v4_name
from kern.tiny import make_tiny

TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v4")
    return {
        "plain": make_tiny("deepseek_v4", root / "plain", seed=4),
        "release": make_tiny("deepseek_v4", root / "release", seed=4, fp8=True),
    }


def header(folder: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {
            k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()
        }


def rewrite(folder: Path, dst: Path, *, config=None, rename=None, extra=None) -> Path:
    """A copy of ``folder`` with config.json edited by ``config(raw)``, every tensor renamed
    by ``rename(name)`` (None drops it), and ``extra`` tensors added."""
    shutil.copytree(folder, dst)
    raw = json.loads((dst / "config.json").read_text())
    if config is not None:
        config(raw)
    (dst / "config.json").write_text(json.dumps(raw))
    tensors = load_file(dst / "model.safetensors")
    if rename is not None:
        tensors = {rename(k): v for k, v in tensors.items() if rename(k) is not None}
    tensors.update(extra or {})
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def transformers_config(raw: dict):
    transformers = pytest.importorskip("transformers")
    raw = {k: v for k, v in raw.items() if k not in ("model_type", "architectures")}
    return transformers.DeepseekV4Config(**json.loads(json.dumps(raw)))


def test_a_folder_transformers_saved_parses_and_loads(folders, tmp_path):
    """save_pretrained of a transformers model: every tensor's name and shape is what kern
    expects, and it loads (tid2eid as integers); the values kern parses are transformers'."""
    transformers = pytest.importorskip("transformers")
    raw = json.loads((folders["plain"] / "config.json").read_text())
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(transformers_config(raw))
    model.save_pretrained(tmp_path / "hf")
    for name in TOKENIZER:
        shutil.copyfile(folders["plain"] / name, tmp_path / "hf" / name)

    config = load_config(tmp_path / "hf")
    stored = header(tmp_path / "hf")
    assert {k: s for k, (s, _) in stored.items()} == expected_shapes(config)
    # make_tiny writes exactly the names and shapes transformers writes.
    assert {k: s for k, (s, _) in header(folders["plain"]).items()} == expected_shapes(config)
    assert stored["model.layers.0.ffn.gate.tid2eid"][1] == "I64"
    ckpt = load_checkpoint(tmp_path / "hf", dtype="bfloat16")
    assert set(ckpt.tensors) == set(stored)
    assert ckpt.tensors["model.layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert ckpt.tensors["head.weight"].dtype == torch.bfloat16
    tc = model.config
    v4 = config.family_fields
    assert v4.attention_types == tuple(tc.layer_types)
    assert v4.moe_types == tuple(tc.mlp_layer_types)
    assert config.mlp_layer_types == ("sparse",) * config.num_hidden_layers
    assert v4.rope_head_dim == tc.qk_rope_head_dim == 16
    assert v4.compress_rates == (4, 8)
    assert (config.num_key_value_heads, config.head_dim, config.num_mtp_layers) == (1, 64, 0)
    assert config.intermediate_size == config.experts.moe_intermediate_size == 32


LEGACY = {
    "flat yarn": dict(
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 64},
        compress_ratios=[0, 4, 128, 4, 0],
        num_hash_layers=1,
        qk_rope_head_dim=8,
        compress_rate_hca=16,
    ),
    "nested yarn": dict(
        rope_parameters={
            "main": {"rope_type": "default", "rope_theta": 5000.0},
            "compress": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 80000.0},
        },
        layer_types=["heavily_compressed_attention"] * 4,
        mlp_layer_types=["moe"] * 4,
        intermediate_size=48,
    ),
    "defaults": dict(),
}


@pytest.mark.parametrize("case", sorted(LEGACY))
def test_config_spellings_read_as_transformers_reads_them(folders, case):
    raw = json.loads((folders["plain"] / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters"):
        del raw[key]
    del raw["partial_rotary_factor"], raw["moe_intermediate_size"]
    raw.update(LEGACY[case])
    c, tc = parse_config(raw), transformers_config(raw)
    v4 = c.family_fields
    assert v4.attention_types == tuple(tc.layer_types)
    assert v4.moe_types == tuple(tc.mlp_layer_types)
    # A rate counts only for a kind some layer has (kern holds 0 for the others).
    for i, kind in enumerate(("compressed_sparse_attention", "heavily_compressed_attention")):
        if kind in v4.attention_types:
            assert v4.compress_rates[i] == tc.compress_rates[kind]
    assert v4.rope_head_dim == tc.qk_rope_head_dim
    assert c.partial_rotary_factor == pytest.approx(tc.partial_rotary_factor)
    assert c.experts.moe_intermediate_size == tc.moe_intermediate_size
    main, compress = tc.rope_parameters["main"], tc.rope_parameters["compress"]
    assert c.rope_theta == main["rope_theta"] and c.rope_type == "default"
    assert v4.compress_rope_theta == compress["rope_theta"]
    assert v4.compress_rope_type == compress["rope_type"]
    if v4.compress_rope_type == "yarn":
        assert v4.compress_rope_yarn[0] == compress["factor"]
        assert v4.compress_rope_yarn[1] == compress["original_max_position_embeddings"]
        # Flat: transformers forces attention_factor 1.0; nested: left to derive (0 here).
        assert v4.compress_rope_yarn[6] == compress.get("attention_factor", 0.0)


def test_release_names_and_quantisation_load_to_dequantised_twins(folders, tmp_path):
    """The release's names (and its mtp.* layer, skipped unread), FP8 projections with e8m0
    scales and FP4 experts load to exactly the tensors of a float32 twin in transformers'
    names, dequantised by transformers' own FP8 loader op."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    stored = header(folders["release"])
    assert "embed.weight" in stored and "hc_head_fn" in stored and "head.weight" in stored
    kinds = {d for k, (_, d) in stored.items() if ".experts." in k and k.endswith(".weight")}
    assert kinds == {"I8"}
    assert stored["layers.0.attn.wq_a.scale"][1] == "F8_E8M0"
    assert stored["layers.0.attn.wq_a.weight"][1] == "F8_E4M3"
    assert stored["layers.1.attn.compressor.wkv.weight"][1] == "F32"  # float, as released
    tensors = load_file(folders["release"] / "model.safetensors")
    deq = fp8.Fp8Dequantize(None)
    config = load_config(folders["release"])
    twin = {}
    for name, t in tensors.items():
        if name.endswith(".scale"):
            continue
        scale = tensors.get(name.removesuffix(".weight") + ".scale")
        if scale is not None:
            t = deq._dequantize_one(t, scale, output_dtype=torch.float32)
        twin[canonical_name(config, name)] = t
    assert twin.keys() == expected_shapes(config).keys()
    dst = tmp_path / "twin"
    shutil.copytree(folders["plain"], dst)
    save_file({k: v.contiguous() for k, v in twin.items()}, str(dst / "model.safetensors"))
    mtp = {"mtp.0.attn.wq_a.weight": torch.zeros(2, 2), "mtp.0.emb.weight": torch.zeros(3)}
    release = rewrite(folders["release"], tmp_path / "release", extra=mtp)

    a, b = load_checkpoint(dst), load_checkpoint(release)
    assert a.tensors.keys() == b.tensors.keys()
    for name in a.tensors:
        assert a.tensors[name].dtype == b.tensors[name].dtype, name
        assert torch.equal(a.tensors[name], b.tensors[name]), name
    # And the quantisation is close to the float weights it came from.
    plain = load_checkpoint(folders["plain"]).tensors
    for name in ("model.layers.0.attn.wq_b.weight", "model.layers.2.ffn.experts.1.w2.weight"):
        err = (plain[name] - b.tensors[name]).abs().max() / plain[name].abs().max()
        assert 0 < err < 0.2, (name, err)


def test_release_names_unquantised_load_like_transformers_names(folders, tmp_path):
    released = rewrite(folders["plain"], tmp_path / "r", rename=released_v4_name)
    assert "layers.0.ffn.gate.tid2eid" in header(released)
    a, b = load_checkpoint(folders["plain"]), load_checkpoint(released)
    assert a.tensors.keys() == b.tensors.keys()
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


def edit(**changes):
    def apply(raw):
        for key, value in changes.items():
            if value is None:
                raw.pop(key, None)
            else:
                raw[key] = value

    return apply


@pytest.mark.parametrize(
    "change, error, message",
    [
        (edit(num_key_value_heads=2), UnsupportedModelError, "num_key_value_heads 2"),
        (
            lambda r: r["layer_types"].__setitem__(1, "full_attention"),
            ConfigFieldError,
            r"layer_types\[1\] is 'full_attention'",
        ),
        (
            edit(layer_types=None, compress_ratios=[0, 64, 4, 4]),
            ConfigFieldError,
            r"compress_ratios\[1\] is 64",
        ),
        (edit(layer_types=["sliding_attention"]), ConfigFieldError, "layer_types must be"),
        (
            lambda r: r["mlp_layer_types"].__setitem__(0, "dense"),
            ConfigFieldError,
            r"mlp_layer_types\[0\] is 'dense'",
        ),
        (edit(scoring_func="softmax"), UnsupportedModelError, "scoring_func 'softmax'"),
        (edit(n_shared_experts=2), UnsupportedModelError, "n_shared_experts 2"),
        (
            lambda r: r["rope_parameters"]["main"].update(rope_type="yarn", factor=2.0),
            UnsupportedModelError,
            "rope_parameters.main rope_type 'yarn'",
        ),
        (
            lambda r: r["rope_parameters"]["compress"].update(rope_type="linear", factor=2.0),
            UnsupportedModelError,
            "rope_type 'linear'",
        ),
        (
            edit(quantization_config={"quant_method": "awq", "weight_block_size": [16, 16]}),
            UnsupportedModelError,
            "quant_method 'awq'",
        ),
        (
            edit(
                quantization_config={
                    "quant_method": "fp8",
                    "weight_block_size": [16, 16],
                    "scale_fmt": "e4m3",
                }
            ),
            UnsupportedModelError,
            "scale_fmt 'e4m3'",
        ),
        (
            edit(
                quantization_config={
                    "quant_method": "fp8",
                    "weight_block_size": [16, 16],
                    "expert_dtype": "int4",
                }
            ),
            UnsupportedModelError,
            "expert_dtype 'int4'",
        ),
        (edit(o_groups=3), ConfigFieldError, "o_groups"),
        (edit(hc_mult=0), ConfigFieldError, "'hc_mult'"),
    ],
)
def test_config_refusals(folders, change, error, message):
    raw = json.loads((folders["plain"] / "config.json").read_text())
    change(raw)
    with pytest.raises(error, match=message):
        parse_config(raw, source="v4/config.json")


def test_tensor_refusals_name_the_tensor(folders, tmp_path):
    def drop(name):
        return lambda k: None if k == name else k

    gone = "model.layers.1.attn.indexer.weights_proj.weight"
    with pytest.raises(MissingTensorError, match=gone.replace(".", r"\.")):
        load_checkpoint(rewrite(folders["plain"], tmp_path / "a", rename=drop(gone)))
    extra = {"model.layers.0.attn.indexer.wq_b.weight": torch.zeros(128, 48)}
    with pytest.raises(UnexpectedTensorError, match=r"layers\.0\.attn\.indexer\.wq_b"):
        load_checkpoint(rewrite(folders["plain"], tmp_path / "b", extra=extra))
    floats = {"model.layers.0.ffn.gate.tid2eid": torch.zeros(512, 2)}
    with pytest.raises(TensorError, match=r"'model\.layers\.0\.ffn\.gate\.tid2eid' has dtype F32"):
        load_checkpoint(rewrite(folders["plain"], tmp_path / "c", extra=floats))
    ints = {"model.layers.0.attn.wq_a.weight": torch.zeros(48, 64, dtype=torch.int8)}
    with pytest.raises(TensorError, match=r"'model\.layers\.0\.attn\.wq_a\.weight' has dtype I8"):
        load_checkpoint(rewrite(folders["plain"], tmp_path / "d", extra=ints))

    # The release: FP4 experts with a misshapen scale, or without an fp4 expert_dtype.
    scale = "layers.3.ffn.experts.0.w1.scale"
    bad = {scale: torch.ones(32, 1).to(torch.float8_e8m0fnu)}
    with pytest.raises(TensorShapeError, match=scale.replace(".", r"\.")):
        load_checkpoint(rewrite(folders["release"], tmp_path / "e", extra=bad))
    with pytest.raises(TensorError, match=r"experts\.\d+\.w\d\.weight' has dtype I8"):
        load_checkpoint(rewrite(folders["release"], tmp_path / "f", config=edit(expert_dtype=None)))
    no_quant = edit(quantization_config=None, expert_dtype=None)
    with pytest.raises(TensorError, match="no fp8 quantization_config"):
        load_checkpoint(rewrite(folders["release"], tmp_path / "g", config=no_quant))


def test_make_tiny_cli_and_determinism(folders, tmp_path, capsys):
    """``kern make-tiny deepseek_v4 --fp8`` writes the same bytes as make_tiny(fp8=True); a
    few MB at most; the schedule has every attention kind, hash layers first."""
    assert cli.main(["make-tiny", "deepseek_v4", str(tmp_path / "a"), "--fp8", "--seed", "4"]) == 0
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (tmp_path / "a" / name).read_bytes() == (folders["release"] / name).read_bytes()
    for kind in ("plain", "release"):
        size = sum(p.stat().st_size for p in folders[kind].iterdir())
        assert size < 4_000_000, (kind, size)
    c = load_config(folders["plain"])
    v4 = c.family_fields
    assert set(v4.attention_types) == {
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    }
    assert v4.moe_types[0] == "hash_moe" and v4.moe_types[-1] == "moe"
    assert list(v4.moe_types) == sorted(v4.moe_types)  # hash_moe before moe
    assert v4.index_n_heads >= 8
    released = dataclasses.replace(v4, fp4_experts=True)
    assert load_config(folders["release"]) == dataclasses.replace(
        c, fp8_block=(16, 16), family_fields=released
    )
    capsys.readouterr()
    assert cli.main(["make-tiny", "deepseek_v4", str(tmp_path / "b"), "--mtp-layers", "1"]) == 2
    assert "does not apply to family" in capsys.readouterr().err


def test_tied_embeddings_and_yarn(tmp_path):
    """Tied: no head.weight to require. YaRN on the compressed layers: the release's flat
    rope_scaling and transformers' nested spelling parse alike (attention_factor 1.0)."""
    tied = load_checkpoint(make_tiny("deepseek_v4", tmp_path / "t", tie_embeddings=True))
    assert "head.weight" not in tied.tensors and tied.config.tie_word_embeddings
    nested = load_config(make_tiny("deepseek_v4", tmp_path / "n", yarn_factor=2))
    flat = load_config(make_tiny("deepseek_v4", tmp_path / "f", yarn_factor=2, fp8=True))
    nested, flat = nested.family_fields, flat.family_fields
    assert nested.compress_rope_type == flat.compress_rope_type == "yarn"
    assert nested.compress_rope_yarn == flat.compress_rope_yarn
    assert nested.compress_rope_yarn[6] == 1.0


def test_same_bytes_across_processes(folders, tmp_path):
    code = (
        "from kern.tiny import make_tiny; "
        f"make_tiny('deepseek_v4', {str(tmp_path / 'b')!r}, seed=4, fp8=True)"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)
    for p in sorted(folders["release"].iterdir()):
        assert (tmp_path / "b" / p.name).read_bytes() == p.read_bytes(), p.name
