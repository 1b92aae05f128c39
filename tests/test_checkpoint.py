"""kern.checkpoint: loading single-file, sharded and multimodal folders, and every refusal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kern.checkpoint.errors import (
    CheckpointError,
    MissingFileError,
    MissingShardError,
    MissingTensorError,
    PickleCheckpointError,
    TensorError,
    TensorShapeError,
    UnexpectedTensorError,
    UnsupportedModelError,
)
from kern.checkpoint.load import load_checkpoint
from kern.checkpoint.names import expected_shapes
from kern.tiny import make_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "qwen3": make_tiny("qwen3", root / "qwen3"),
        "qwen3_tied": make_tiny("qwen3", root / "qwen3_tied", tie_embeddings=True),
        "qwen3_sharded": make_tiny("qwen3", root / "qwen3_sharded", shards=3),
        "qwen3_5": make_tiny("qwen3_5", root / "qwen3_5"),
        "qwen3_moe": make_tiny("qwen3_moe", root / "qwen3_moe"),
    }


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("name", ["qwen3", "qwen3_tied", "qwen3_5", "qwen3_moe"])
def test_loads_every_expected_tensor(tiny, name):
    ckpt = load_checkpoint(tiny[name])
    assert set(ckpt.tensors) == set(expected_shapes(ckpt.config))
    stored = load_file(tiny[name] / "model.safetensors")
    for key, tensor in ckpt.tensors.items():
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        assert torch.equal(tensor, stored[key])
    assert ckpt.path == tiny[name]
    assert ckpt.tokenizer.eos_token_ids == (511, 509)


def test_tied_embeddings_need_no_lm_head(tiny):
    ckpt = load_checkpoint(tiny["qwen3_tied"])
    assert ckpt.config.tie_word_embeddings and "lm_head.weight" not in ckpt.tensors


def test_tied_checkpoint_may_still_carry_lm_head(tiny, tmp_path):
    d = copy(tiny["qwen3_tied"], tmp_path / "c")
    tensors = load_file(d / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, d / "model.safetensors")
    assert "lm_head.weight" in load_checkpoint(d).tensors


def test_dtype_cast(tiny):
    ckpt = load_checkpoint(tiny["qwen3"], dtype="bfloat16")
    assert all(t.dtype == torch.bfloat16 for t in ckpt.tensors.values())
    with pytest.raises(ValueError, match=r"dtype 'int8' is not supported"):
        load_checkpoint(tiny["qwen3"], dtype="int8")


def test_sharded_equals_single_file(tiny):
    shards = sorted(p.name for p in tiny["qwen3_sharded"].glob("*.safetensors"))
    assert shards == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    one = load_checkpoint(tiny["qwen3"]).tensors
    three = load_checkpoint(tiny["qwen3_sharded"]).tensors
    assert one.keys() == three.keys()
    assert all(torch.equal(one[k], three[k]) for k in one)


def test_multimodal_qwen3_5_layout_loads_the_language_model(tiny, tmp_path):
    """Published Qwen3.5 folders nest the text config and prefix the LM's tensors."""
    src = tiny["qwen3_5"]
    d = copy(src, tmp_path / "mm")
    text = json.loads((src / "config.json").read_text())
    config = {"model_type": "qwen3_5", "text_config": text, "vision_config": {"depth": 1}}
    (d / "config.json").write_text(json.dumps(config))
    tensors = {}
    for k, v in load_file(src / "model.safetensors").items():
        tensors[
            k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k
        ] = v
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(3, 3)
    tensors["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(tensors, d / "model.safetensors")
    ours = load_checkpoint(d).tensors
    plain = load_checkpoint(src).tensors
    assert ours.keys() == plain.keys()
    assert all(torch.equal(ours[k], plain[k]) for k in ours)


def test_progress_bar_is_off_when_stderr_is_not_a_tty(tiny, capsys):
    load_checkpoint(tiny["qwen3"])  # progress=None: capsys's stderr is not a terminal
    assert capsys.readouterr().err == ""
    load_checkpoint(tiny["qwen3"], progress=True)
    assert "loading qwen3" in capsys.readouterr().err


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(MissingFileError, match=r"no such checkpoint folder"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(MissingFileError, match=r"config\.json: no such file"):
        load_checkpoint(tmp_path)


def test_unknown_model_type_is_refused(tiny, tmp_path):
    d = copy(tiny["qwen3"], tmp_path / "c")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    with pytest.raises(UnsupportedModelError, match=r"config\.json: model_type 'mamba'"):
        load_checkpoint(d)


def test_pickle_only_folder_is_refused(tiny, tmp_path):
    d = copy(tiny["qwen3"], tmp_path / "c")
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(PickleCheckpointError, match=r"pytorch_model\.bin.*safetensors only"):
        load_checkpoint(d)


def test_folder_without_weights(tiny, tmp_path):
    d = copy(tiny["qwen3"], tmp_path / "c")
    (d / "model.safetensors").unlink()
    with pytest.raises(MissingFileError, match=r"no \*\.safetensors files"):
        load_checkpoint(d)


def test_missing_tokenizer(tiny, tmp_path):
    d = copy(tiny["qwen3"], tmp_path / "c")
    (d / "tokenizer.json").unlink()
    with pytest.raises(MissingFileError, match=r"tokenizer\.json: no such file"):
        load_checkpoint(d)


def test_index_naming_a_missing_shard(tiny, tmp_path):
    d = copy(tiny["qwen3_sharded"], tmp_path / "c")
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(MissingShardError) as e:
        load_checkpoint(d)
    assert "model.safetensors.index.json" in str(e.value)
    assert "'model-00002-of-00003.safetensors'" in str(e.value)


def test_index_naming_a_tensor_its_shard_lacks(tiny, tmp_path):
    d = copy(tiny["qwen3_sharded"], tmp_path / "c")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.extra.weight"] = "model-00001-of-00003.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MissingTensorError, match=r"'model\.extra\.weight' is in model-00001"):
        load_checkpoint(d)


def _rewrite(d: Path, edit) -> None:
    tensors = load_file(d / "model.safetensors")
    edit(tensors)
    save_file(tensors, d / "model.safetensors")


def test_missing_tensor_is_named_with_its_shape(tiny, tmp_path):
    d = copy(tiny["qwen3"], tmp_path / "c")
    _rewrite(d, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(MissingTensorError) as e:
        load_checkpoint(d)
    assert "'model.layers.1.self_attn.k_proj.weight'" in str(e.value)
    assert "[32, 64]" in str(e.value)


def test_untied_checkpoint_needs_lm_head(tiny, tmp_path):
    d = copy(tiny["qwen3"], tmp_path / "c")
    _rewrite(d, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(MissingTensorError, match=r"'lm_head\.weight'"):
        load_checkpoint(d)


def test_wrong_shape_names_file_tensor_and_shapes(tiny, tmp_path):
    d = copy(tiny["qwen3_moe"], tmp_path / "c")
    _rewrite(
        d, lambda t: t.update({"model.layers.0.mlp.experts.3.up_proj.weight": torch.zeros(31, 64)})
    )
    with pytest.raises(TensorShapeError) as e:
        load_checkpoint(d)
    message = str(e.value)
    assert "model.safetensors" in message and "experts.3.up_proj.weight" in message
    assert "[31, 64]" in message and "expected [32, 64]" in message


def test_unexpected_tensor_is_named(tiny, tmp_path):
    d = copy(tiny["qwen3"], tmp_path / "c")
    _rewrite(d, lambda t: t.update({"model.layers.2.input_layernorm.weight": torch.ones(64)}))
    with pytest.raises(UnexpectedTensorError, match=r"'model\.layers\.2\.input_layernorm\.weight'"):
        load_checkpoint(d)


def test_integer_tensor_is_refused(tiny, tmp_path):
    d = copy(tiny["qwen3"], tmp_path / "c")
    _rewrite(d, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int8)}))
    with pytest.raises(TensorError, match=r"'model\.norm\.weight' has dtype I8"):
        load_checkpoint(d)


def test_corrupt_safetensors_is_named(tiny, tmp_path):
    d = copy(tiny["qwen3"], tmp_path / "c")
    (d / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a valid safetensors"):
        load_checkpoint(d)


def test_errors_are_value_errors():
    for cls in (MissingShardError, MissingTensorError, TensorShapeError, PickleCheckpointError):
        assert issubclass(cls, CheckpointError) and issubclass(cls, ValueError)
