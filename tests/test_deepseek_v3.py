"""deepseek_v3 (DeepSeek-V3/R1, Kimi K2) beyond the oracle cases of test_oracle.py: folders
written by transformers' own save_pretrained, Kimi's config and tensor names, FP8
block-scaled weights against their dequantised twins, the MTP layer's tensors, the latent
page's bytes, and every refusal by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kern.checkpoint.config import load_config, parse_config
from kern.checkpoint.errors import (
    ConfigFieldError,
    MissingTensorError,
    TensorError,
    TensorShapeError,
    UnsupportedModelError,
)
from kern.checkpoint.load import load_checkpoint
from kern.engine.generate import generate
from kern.engine.layout import Layout
from kern.tiny import make_tiny

STEPS = 16
PAGE = 16


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ds")
    return {
        "plain": make_tiny("deepseek_v3", root / "plain", seed=5),
        "mtp": make_tiny("deepseek_v3", root / "mtp", seed=5, mtp_layers=1),
        "fp8": make_tiny("deepseek_v3", root / "fp8", seed=5, fp8=True, mtp_layers=1),
    }


def prompt(n: int = 37, seed: int = 3) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 500, (n,), generator=gen).tolist()


def rewrite(folder: Path, dst: Path, *, config=None, rename=None, extra=None) -> Path:
    """A copy of ``folder`` with config.json edited by ``config(raw)`` and every tensor
    renamed by ``rename(name)`` (None drops it), plus ``extra`` tensors."""
    shutil.copytree(folder, dst)
    raw = json.loads((dst / "config.json").read_text())
    if config is not None:
        raw = config(raw)
    (dst / "config.json").write_text(json.dumps(raw))
    tensors = load_file(dst / "model.safetensors")
    if rename is not None:
        tensors = {rename(k): v for k, v in tensors.items() if rename(k) is not None}
    tensors.update(extra or {})
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_a_folder_transformers_saved_answers_like_transformers(folders, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folders["plain"], dtype=torch.float32, attn_implementation="eager"
    ).eval()
    out = tmp_path / "saved"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(folders["plain"] / name, out / name)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "model.layers.1.mlp.experts.3.gate_proj.weight" in f.keys()  # DeepSeek's names
    ckpt = load_checkpoint(out)
    ids = prompt()
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False)
    assert generate(ckpt, ids, STEPS, page_tokens=PAGE).ids == ref[0, len(ids) :].tolist()


def test_fp8_weights_equal_their_dequantised_twin(folders, tmp_path):
    raw = json.loads((folders["fp8"] / "config.json").read_text())
    assert raw["quantization_config"]["weight_block_size"] == [16, 16]
    stored = load_file(folders["fp8"] / "model.safetensors")
    name = "model.layers.1.mlp.experts.0.down_proj.weight"
    assert stored[name].dtype == torch.float8_e4m3fn and stored[name].shape == (64, 32)
    assert stored[name + "_scale_inv"].shape == (4, 2)  # 16 x 16 blocks
    quantised = load_checkpoint(folders["fp8"], mtp=True)

    def twin_config(raw: dict) -> dict:
        del raw["quantization_config"]
        return raw

    twin_tensors = {
        k: v for k, v in quantised.tensors.items()
    }  # dequantised by the loader: the twin stores them as float32
    twin = tmp_path / "twin"
    shutil.copytree(folders["fp8"], twin)
    (twin / "config.json").write_text(json.dumps(twin_config(raw)))
    save_file(twin_tensors, str(twin / "model.safetensors"))
    # an independent dequantisation: each 16 x 16 block times its scale
    w, s = stored[name].float(), stored[name + "_scale_inv"]
    by_hand = (w.view(4, 16, 2, 16) * s[:, None, :, None]).view(64, 32)
    assert torch.equal(quantised.tensors[name], by_hand)
    assert not torch.equal(by_hand, load_file(folders["mtp"] / "model.safetensors")[name])
    twin_ckpt = load_checkpoint(twin, mtp=True)
    assert quantised.tensors.keys() == twin_ckpt.tensors.keys()
    ids = prompt()
    a = generate(quantised, ids, STEPS, page_tokens=PAGE).ids
    assert a == generate(twin_ckpt, ids, STEPS, page_tokens=PAGE).ids


def test_fp8_refusals(folders, tmp_path):
    no_scale = rewrite(
        folders["fp8"],
        tmp_path / "no_scale",
        rename=lambda k: None if k == "model.layers.0.mlp.up_proj.weight_scale_inv" else k,
    )
    with pytest.raises(TensorError, match=r"'model.layers.0.mlp.up_proj.weight' is F8_E4M3 with"):
        load_checkpoint(no_scale)
    bad_scale = rewrite(
        folders["fp8"],
        tmp_path / "bad_scale",
        extra={"model.layers.0.mlp.up_proj.weight_scale_inv": torch.ones(3, 3)},
    )
    with pytest.raises(TensorShapeError, match=r"expected float scales of shape \[8, 4\]"):
        load_checkpoint(bad_scale)

    def no_quant(raw: dict) -> dict:
        del raw["quantization_config"]
        return raw

    unannounced = rewrite(folders["fp8"], tmp_path / "unannounced", config=no_quant)
    with pytest.raises(TensorError, match="config.json has no fp8 quantization_config"):
        load_checkpoint(unannounced)
    for qc, message in (
        ({"quant_method": "compressed-tensors"}, "quant_method 'compressed-tensors'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be two"),
    ):
        raw = json.loads((folders["fp8"] / "config.json").read_text())
        raw["quantization_config"] = qc
        with pytest.raises((UnsupportedModelError, ConfigFieldError), match=message):
            parse_config(raw)


def test_mtp_layers_are_read_only_when_asked(folders):
    n = load_config(folders["mtp"]).num_hidden_layers
    plain = load_checkpoint(folders["mtp"])
    assert not any(k.startswith(f"model.layers.{n}.") for k in plain.tensors)
    with_mtp = load_checkpoint(folders["mtp"], mtp=True)
    extra = {k for k in with_mtp.tensors if k.startswith(f"model.layers.{n}.")}
    for leaf in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        assert f"model.layers.{n}.{leaf}" in extra
    assert f"model.layers.{n}.self_attn.kv_b_proj.weight" in extra
    with pytest.raises(MissingTensorError, match="no multi-token-prediction layer"):
        load_checkpoint(folders["plain"], mtp=True)


def test_kimi_k2_and_k25_folders(folders, tmp_path):
    """Kimi K2 ships deepseek_v3's fields as model_type kimi_k2; K2.5 nests them in the
    text_config of a multimodal kimi_k25 and stores the language model under
    language_model., beside a vision tower kern does not read."""
    ids = prompt()
    want = generate(load_checkpoint(folders["plain"]), ids, 8, page_tokens=PAGE).ids

    def k2(raw: dict) -> dict:
        return {**raw, "model_type": "kimi_k2"}

    kimi_k2 = rewrite(folders["plain"], tmp_path / "k2", config=k2)
    assert generate(load_checkpoint(kimi_k2), ids, 8, page_tokens=PAGE).ids == want

    def k25(raw: dict) -> dict:
        return {
            "model_type": "kimi_k25",
            "architectures": ["KimiK25ForConditionalGeneration"],
            "text_config": raw,
            "vision_config": {"hidden_size": 8},
        }

    kimi_k25 = rewrite(
        folders["plain"],
        tmp_path / "k25",
        config=k25,
        rename=lambda k: "language_model." + k,
        extra={"vision_tower.patch_embed.weight": torch.ones(2, 2)},
    )
    ckpt = load_checkpoint(kimi_k25)
    assert ckpt.config.model_type == "deepseek_v3"
    assert generate(ckpt, ids, 8, page_tokens=PAGE).ids == want


def test_latent_pages_hold_one_vector_a_token_a_layer(folders):
    c = load_config(folders["plain"])
    layout = Layout.of(c, torch.float32, PAGE)
    assert layout.page_class == "latent"
    assert layout.page_shape == (3, PAGE, 32 + 16)
    assert layout.page_bytes == 3 * PAGE * 48 * 4
    # the released dims: 576 values a token a layer, 61 layers, bf16 -> 70,272 bytes a token
    released = {
        **json.loads((folders["plain"] / "config.json").read_text()),
        "num_hidden_layers": 61,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "num_attention_heads": 128,
    }
    per_token = Layout.of(parse_config(released), torch.bfloat16, 1).page_bytes
    assert per_token == 61 * 576 * 2 == 70272


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"scoring_func": "softmax"}, UnsupportedModelError, "scoring_func 'softmax'"),
        ({"topk_method": "greedy"}, UnsupportedModelError, "topk_method 'greedy'"),
        ({"n_routed_experts": 6, "n_group": 4}, ConfigFieldError, "multiple of n_group"),
        ({"topk_group": 3}, ConfigFieldError, r"topk_group \(3\) exceeds n_group \(2\)"),
        ({"num_experts_per_tok": 5}, ConfigFieldError, "exceeds the experts of topk_group"),
        ({"qk_rope_head_dim": 15}, ConfigFieldError, "qk_rope_head_dim must be even"),
        ({"moe_layer_freq": 2}, UnsupportedModelError, "moe_layer_freq 2"),
        (
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}},
            UnsupportedModelError,
            "rope_type 'llama3'",
        ),
    ],
)
def test_config_refusals(folders, change, error, message):
    raw = {**json.loads((folders["plain"] / "config.json").read_text()), **change}
    with pytest.raises(error, match=message):
        parse_config(raw)


def test_yarn_is_deepseek_only(tmp_path):
    raw = json.loads((make_tiny("qwen3", tmp_path / "q") / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
    with pytest.raises(UnsupportedModelError, match="rope_type 'yarn' is not supported"):
        parse_config(raw)


def test_mla_benchmark_runs_and_its_paths_agree(capsys):
    """``python -m kern.bench.mla`` (docs/performance.md): the absorbed, expanded and kern
    CPU paths are checked against each other inside it before they are timed."""
    from kern.bench.mla import main

    assert main(["--context", "40", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "| DeepSeek-V3 | 70,272 | 70,272 | 4,997,120 | 71.1x |" in out


def test_make_tiny_flags(tmp_path, capsys):
    """``kern make-tiny deepseek_v3`` maps its flags to make_tiny's keywords, and refuses the
    family's flags on another family."""
    from kern import cli

    args = ["--q-lora-rank", "0", "--mtp-layers", "1", "--fp8", "--yarn-factor", "2", "--seed", "2"]
    assert cli.main(["make-tiny", "deepseek_v3", str(tmp_path / "a"), *args]) == 0
    make_tiny(
        "deepseek_v3",
        tmp_path / "b",
        q_lora_rank=0,
        mtp_layers=1,
        fp8=True,
        yarn_factor=2.0,
        seed=2,
    )
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    capsys.readouterr()
    for family, flag in (("qwen3", "--fp8"), ("qwen3_moe", "--mtp-layers")):
        extra = [flag] if flag == "--fp8" else [flag, "1"]
        assert cli.main(["make-tiny", family, str(tmp_path / family), *extra]) == 2
        assert "does not apply to family" in capsys.readouterr().err
