"""``qwen3_next`` (Qwen3-Next) and ``qwen3_5_moe`` (Qwen3.5/3.6-MoE): folders transformers'
own ``save_pretrained`` wrote, at shapes chosen here rather than make-tiny's, answer like
transformers; the Qwen3.5-MoE release's layout (multimodal config, the language model under
``model.language_model.``, fused experts) reads as the same tensors; what kern does not run
is refused by name; expert-parallel ranks hold disjoint experts and the shared expert whole.
The make-tiny folders' logits, chunked prefill and cached prefixes are test_oracle.py's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from support.release import rewrite

from kern.checkpoint.config import parse_config
from kern.checkpoint.errors import CheckpointError, TensorShapeError, UnsupportedModelError
from kern.checkpoint.load import index_tensors, load_checkpoint
from kern.engine.generate import generate
from kern.engine.ranks.shard import Shard, load_shard
from kern.tiny import make_tiny

transformers = pytest.importorskip("transformers")

PAGE = 16
VOCAB = 512

# Shapes make-tiny does not write: one key head serving three value heads, a conv of 3, head
# and DeltaNet dims that differ, two linear layers before the full one, a dense first layer.
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    num_hidden_layers=3,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=16,
    layer_types=["linear_attention", "linear_attention", "full_attention"],
    linear_num_key_heads=1,
    linear_num_value_heads=3,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=3,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=24,
    shared_expert_intermediate_size=20,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)
MODELS = {
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(intermediate_size=40, mlp_only_layers=[0]),
    ),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {}),
}


def _saved(family: str, out: Path) -> tuple[Path, object]:
    """A random model of ``family`` built by transformers and saved by it, with make-tiny's
    tokenizer files beside it (transformers writes none)."""
    config_cls, model_cls, extra = MODELS[family]
    torch.manual_seed(5)
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # zero-centred norms start at 0: give them something to do
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    tok = make_tiny("qwen3", out.parent / f"{out.name}-tok", vocab=VOCAB)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, out / name)
    return out, model


@pytest.fixture(scope="module", params=sorted(MODELS))
def saved(request, tmp_path_factory):
    return request.param, *_saved(request.param, tmp_path_factory.mktemp(request.param) / "hf")


@pytest.mark.parametrize("length", [7, 41])
def test_a_folder_transformers_saved_answers_like_transformers(saved, length):
    family, folder, model = saved
    raw = json.loads((folder / "config.json").read_text())
    assert parse_config(raw).model_type == family
    ckpt = load_checkpoint(folder)
    ids = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(9)).tolist()
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    assert generate(ckpt, ids, 24, page_tokens=PAGE).ids == ref[0, length:].tolist()


def _release(folder: Path, model, out: Path) -> Path:
    """The Qwen3.5-MoE release's layout of ``folder``'s model: a multimodal config, the
    language model under ``model.language_model.``, the experts as transformers holds them in
    memory (fused), a vision tensor and an MTP tensor kern must skip, two shards."""
    out.mkdir()
    text = json.loads((folder / "config.json").read_text())
    raw = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "vision_config": {"depth": 1},
        "tie_word_embeddings": False,
    }
    (out / "config.json").write_text(json.dumps(raw))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (6, 48, 48)
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in state.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)
    renamed["mtp.fc.weight"] = torch.zeros(4, 4)
    names = sorted(renamed)
    shards = {"model-1.safetensors": names[::2], "model-2.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({k: renamed[k] for k in part}, str(out / file))
    index = {"weight_map": {k: f for f, part in shards.items() for k in part}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, out / name)
    return out


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("qwen3_5_moe-release")
    folder, model = _saved("qwen3_5_moe", tmp / "hf")
    return folder, _release(folder, model, tmp / "release")


def test_the_release_layout_reads_as_the_saved_tensors(release):
    saved, fused = release
    a, b = load_checkpoint(saved), load_checkpoint(fused)
    entries = index_tensors(fused, b.config)
    piece = entries["model.layers.0.mlp.experts.3.up_proj.weight"]
    assert piece.stored_name == "model.language_model.layers.0.mlp.experts.gate_up_proj"
    assert piece.piece == (3, 24, 48) and piece.shape == (24, 48)
    assert a.config == b.config
    assert sorted(a.tensors) == sorted(b.tensors)
    for name, t in a.tensors.items():
        assert torch.equal(t, b.tensors[name]), name
    ids = list(range(3, 44))
    assert generate(a, ids, 8, page_tokens=PAGE).ids == generate(b, ids, 8, page_tokens=PAGE).ids


def test_a_misshapen_or_doubled_fused_tensor_is_refused_by_name(release, tmp_path):
    _, fused = release
    name = "model.language_model.layers.1.mlp.experts.gate_up_proj"

    def shrink(t):
        t[name] = t[name][:5].clone()

    with pytest.raises(TensorShapeError, match=rf"'{name}' has shape \[5, 48, 48\], expected"):
        load_checkpoint(rewrite(fused, tmp_path / "shrunk", shrink))

    def double(t):
        t["model.language_model.layers.1.mlp.experts.2.up_proj.weight"] = t[name][2, 24:].clone()

    with pytest.raises(CheckpointError, match=r"experts.2.up_proj.weight"):
        load_checkpoint(rewrite(fused, tmp_path / "doubled", double))


@pytest.mark.parametrize(
    ("family", "change", "message"),
    [
        ("qwen3_5_moe", {"norm_topk_prob": False}, "norm_topk_prob False is not supported"),
        ("qwen3_5_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step 2 is not supported"),
        ("qwen3_5_moe", {"mlp_only_layers": [1]}, r"mlp_only_layers \[1\] is not supported"),
        ("qwen3_5_moe", {"attn_output_gate": False}, "attn_output_gate=false"),
        ("qwen3_next", {"linear_num_value_heads": 3}, "multiple of linear_num_key_heads"),
        ("qwen3_next", {"mlp_only_layers": [9]}, "mlp_only_layers must be a list"),
        ("qwen3_next", {"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) exceeds"),
        ("qwen3_next", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        (
            "qwen3_next",
            {"quantization_config": {"quant_method": "fp8"}},
            "quantization_config \\(quant_method 'fp8'\\) is not supported",
        ),
        (
            "qwen3_5_moe",
            {"quantization_config": {"quant_method": "gptq"}},
            "quant_method 'gptq'",
        ),
    ],
)
def test_config_refusals(tmp_path, family, change, message):
    raw = json.loads((make_tiny(family, tmp_path / family) / "config.json").read_text())
    raw.update(change)
    with pytest.raises(CheckpointError, match=message):
        parse_config(raw)
    assert issubclass(UnsupportedModelError, CheckpointError)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_expert_parallel_ranks_split_the_routed_experts_only(tmp_path, family):
    folder = make_tiny(family, tmp_path / family)
    full = load_checkpoint(folder)
    parts = [load_shard(folder, Shard(r, 2, "ep")) for r in range(2)]
    routed = [{n for n in p.tensors if ".experts." in n} for p in parts]
    assert not routed[0] & routed[1]
    assert routed[0] | routed[1] == {n for n in full.tensors if ".experts." in n}
    for part in parts:
        for name, t in part.tensors.items():
            if ".experts." not in name and name != "lm_head.weight":
                assert torch.equal(t, full.tensors[name]), name  # shared expert, DeltaNet, ...
    with pytest.raises(ValueError, match=f"'tp' is implemented for .*, not {family}"):
        Shard(0, 2, "tp").check(full.config)


def test_the_released_dims_bytes():
    """The benchmark's table: pages a token and a state slot at the released dims, each
    checked against its formula inside ``bytes_rows``."""
    from kern.bench.qwen_moe import bytes_rows

    rows = bytes_rows()
    assert "| Qwen3-Next-80B-A3B | 24,576 |" in rows[2] and "77,266,944" in rows[2]
    assert "| Qwen3.5-35B-A3B | 20,480 |" in rows[3] and "64,389,120" in rows[3]
