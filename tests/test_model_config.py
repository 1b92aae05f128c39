"""kern.checkpoint.config: config.json parsing for each family, defaults equal to transformers',
errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kern.checkpoint.config import load_config, parse_config
from kern.checkpoint.errors import (
    CheckpointError,
    ConfigFieldError,
    MissingFileError,
    UnsupportedModelError,
)
from kern.models.config import ModelConfig

QWEN3 = {
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_theta": 1000000.0,
    "eos_token_id": 7,
    "bos_token_id": 5,
}

QWEN3_MOE = {
    **QWEN3,
    "model_type": "qwen3_moe",
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [3],
    "num_hidden_layers": 6,
}

QWEN3_5_TEXT = {
    "model_type": "qwen3_5_text",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    "eos_token_id": [7, 9],
}


def test_qwen3_fields():
    c = parse_config(QWEN3)
    assert c.model_type == "qwen3"
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.head_dim) == (512, 64, 2, 16)
    assert c.rope_theta == 1e6 and c.partial_rotary_factor == 1.0 and c.rotary_dim == 16
    assert c.layer_types == ("full_attention", "full_attention")
    assert c.eos_token_ids == (7,) and c.bos_token_id == 5
    assert c.experts is None and not c.is_sparse_layer(0)
    assert c.mlp_layer_types == ("dense", "dense") and c.family_fields is None
    assert c.mla is None and c.delta is None and not c.tie_word_embeddings
    assert c.raw == QWEN3


def test_config_is_frozen_and_compares_without_raw():
    c = parse_config(QWEN3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.hidden_size = 1  # type: ignore[misc]
    assert parse_config({**QWEN3, "architectures": ["Qwen3ForCausalLM"]}) == c


def test_qwen3_moe_sparse_layers_follow_transformers_rule():
    c = parse_config(QWEN3_MOE)
    e, own = c.experts, c.family_fields
    assert (e.num_experts, e.num_experts_per_tok, e.moe_intermediate_size) == (8, 2, 32)
    assert e.norm_topk_prob and own.decoder_sparse_step == 2 and own.mlp_only_layers == (3,)
    # sparse when (i + 1) % step == 0 and i not in mlp_only_layers
    assert [c.is_sparse_layer(i) for i in range(6)] == [False, True, False, False, False, True]


def test_qwen3_moe_accepts_transformers_5_alias_num_local_experts():
    raw = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}
    assert parse_config({**raw, "num_local_experts": 4}).experts.num_experts == 4


def test_qwen3_5_text_and_multimodal_parse_to_the_same_family():
    text = parse_config(QWEN3_5_TEXT)
    assert text.model_type == "qwen3_5"
    assert text.is_linear_layer(0) and not text.is_linear_layer(1)
    d = text.delta
    assert (d.num_key_heads, d.num_value_heads) == (2, 4)
    assert (d.key_head_dim, d.value_head_dim) == (16, 16)
    assert d.conv_kernel_dim == 4
    assert text.rope_theta == 1e7 and text.rotary_dim == 8
    assert text.eos_token_ids == (7, 9)
    multimodal = {
        "model_type": "qwen3_5",
        "text_config": {**QWEN3_5_TEXT},
        "vision_config": {"depth": 1},
        "tie_word_embeddings": True,
    }
    mm = parse_config(multimodal)
    assert dataclasses.replace(mm, tie_word_embeddings=False) == text
    # text_config has no tie_word_embeddings of its own here: the top-level value applies
    assert mm.tie_word_embeddings
    assert mm.raw is multimodal


def test_qwen3_5_layer_types_from_full_attention_interval():
    raw = {k: v for k, v in QWEN3_5_TEXT.items() if k != "layer_types"}
    c = parse_config({**raw, "num_hidden_layers": 8})
    assert c.layer_types == (("linear_attention",) * 3 + ("full_attention",)) * 2
    c = parse_config({**raw, "full_attention_interval": 2})
    assert c.layer_types == ("linear_attention", "full_attention") * 2


def test_legacy_and_transformers_5_rope_fields():
    new = {k: v for k, v in QWEN3.items() if k != "rope_theta"}
    new["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6}
    assert parse_config(new).rope_theta == 5e6
    assert parse_config({**QWEN3, "rope_scaling": None}).rope_theta == 1e6
    raw = {k: v for k, v in QWEN3_5_TEXT.items() if k != "rope_parameters"}
    legacy = parse_config({**raw, "rope_theta": 1e6, "partial_rotary_factor": 0.5})
    assert (legacy.rope_theta, legacy.partial_rotary_factor) == (1e6, 0.5)
    assert parse_config(raw).partial_rotary_factor == 0.25  # transformers' qwen3_5 default


@pytest.mark.parametrize(
    ("family", "raw"), [("qwen3", QWEN3), ("qwen3_moe", QWEN3_MOE), ("qwen3_5", QWEN3_5_TEXT)]
)
def test_defaults_agree_with_transformers(family, raw):
    """A field left out of config.json must mean to kern what it means to the oracle."""
    transformers = pytest.importorskip("transformers")
    sparse = {
        k: v for k, v in raw.items() if k not in ("head_dim", "rope_theta", "rope_parameters")
    }
    ours = parse_config(sparse)
    theirs = transformers.AutoConfig.for_model(**sparse)
    head_dim = getattr(theirs, "head_dim", theirs.hidden_size // theirs.num_attention_heads)
    assert ours.head_dim == head_dim
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
    assert ours.rms_norm_eps == theirs.rms_norm_eps
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert ours.max_position_embeddings == theirs.max_position_embeddings
    assert ours.attention_bias == theirs.attention_bias
    layer_types = (
        getattr(theirs, "layer_types", None) or ["full_attention"] * ours.num_hidden_layers
    )
    assert list(ours.layer_types) == list(layer_types)
    if family == "qwen3_5":
        assert ours.partial_rotary_factor == theirs.rope_parameters["partial_rotary_factor"]


def test_load_config_reads_the_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3))
    assert load_config(tmp_path) == parse_config(QWEN3)
    assert load_config(tmp_path / "config.json") == parse_config(QWEN3)


def test_missing_file_names_it(tmp_path):
    with pytest.raises(MissingFileError, match=r"config\.json: no such file"):
        load_config(tmp_path)


def test_invalid_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load_config(tmp_path)


def test_unknown_model_type_names_file_and_value(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3, "model_type": "llama"}))
    with pytest.raises(UnsupportedModelError) as e:
        load_config(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value) and "'llama'" in str(e.value)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"hidden_size": None}, r"field 'hidden_size' must be a positive integer, got None"),
        ({"num_hidden_layers": True}, r"'num_hidden_layers' must be a positive integer"),
        ({"vocab_size": 0}, r"'vocab_size' must be a positive integer, got 0"),
        ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple"),
        ({"rms_norm_eps": "x"}, r"'rms_norm_eps' must be a number"),
        ({"tie_word_embeddings": 1}, r"'tie_word_embeddings' must be a boolean"),
        ({"eos_token_id": "</s>"}, r"'eos_token_id' must hold token ids"),
        ({"rope_theta": -1}, r"rope_theta must be a positive number"),
    ],
)
def test_bad_fields_are_named(change, match):
    with pytest.raises(ConfigFieldError, match=match) as e:
        parse_config({**QWEN3, **change}, source="/ckpt/config.json")
    assert str(e.value).startswith("/ckpt/config.json: ")


def test_missing_required_field_is_named():
    raw = {k: v for k, v in QWEN3.items() if k != "vocab_size"}
    with pytest.raises(ConfigFieldError, match=r"missing required field 'vocab_size'"):
        parse_config(raw)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_type 'yarn'"),
        ({"use_sliding_window": True}, r"use_sliding_window"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
    ],
)
def test_unsupported_variants_are_refused(change, match):
    with pytest.raises(UnsupportedModelError, match=match):
        parse_config({**QWEN3, **change})


def test_qwen3_5_errors_name_text_config():
    bad = {**QWEN3_5_TEXT, "layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}
    with pytest.raises(ConfigFieldError, match=r"\(text_config\): layer_types\[3\]"):
        parse_config({"model_type": "qwen3_5", "text_config": bad})
    with pytest.raises(ConfigFieldError, match=r"layer_types must be a list of num_hidden_layers"):
        parse_config({**QWEN3_5_TEXT, "layer_types": ["full_attention"]})
    with pytest.raises(ConfigFieldError, match=r"linear_num_value_heads \(3\) must be a multiple"):
        parse_config({**QWEN3_5_TEXT, "linear_num_value_heads": 3})


def test_moe_errors():
    with pytest.raises(ConfigFieldError, match=r"num_experts_per_tok \(9\) exceeds num_experts"):
        parse_config({**QWEN3_MOE, "num_experts_per_tok": 9})
    with pytest.raises(ConfigFieldError, match=r"mlp_only_layers"):
        parse_config({**QWEN3_MOE, "mlp_only_layers": [6]})


def test_model_config_is_constructible_directly():
    # The runner's tests build configs without a file.
    c = ModelConfig(
        model_type="qwen3",
        vocab_size=8,
        hidden_size=4,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        tie_word_embeddings=True,
        max_position_embeddings=16,
        layer_types=("full_attention",),
    )
    assert c.rotary_dim == 4 and c.raw == {}
