"""``gpt_oss``: folders transformers' own ``save_pretrained`` wrote, at shapes chosen here rather
than make-tiny's (non-alternating windows, a window of 6, a clamp the activations reach,
sinks that matter), answer like transformers; the release's MXFP4 experts (blocks and scales,
two shards) answer like transformers' own dequantising loader; what kern does not run is
refused by name; expert-parallel ranks hold disjoint experts. The make-tiny folders' logits,
chunked prefill and cached prefixes are test_oracle.py's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from support.release import rewrite

from kern.checkpoint.config import parse_config
from kern.checkpoint.errors import CheckpointError, TensorError, TensorShapeError
from kern.checkpoint.load import index_tensors, load_checkpoint
from kern.engine.generate import generate
from kern.engine.layout import Layout
from kern.engine.ranks.shard import Shard, load_shard
from kern.engine.targets import check_target
from kern.errors import UsageError
from kern.kern_toml import Target
from kern.models.gpt_oss.tiny import quantize
from kern.tiny import make_tiny

PAGE = 16
VOCAB = 512
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=96,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=32,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    sliding_window=6,
    num_local_experts=6,
    num_experts_per_tok=3,
    swiglu_limit=0.5,
    max_position_embeddings=256,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 8.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 32,
    },
)


def _saved(out: Path, **changes) -> tuple[Path, object]:
    """A random gpt-oss built and saved by transformers, make-tiny's tokenizer files beside."""
    torch.manual_seed(5)
    config = transformers.GptOssConfig(**{**CONFIG, **changes})
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():  # initialised near 0, sinks and router biases would do nothing
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "router.bias")):
                p.copy_(2 * torch.randn_like(p))
            elif name.endswith("_bias"):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(out)
    tok = make_tiny("qwen3", out.parent / f"{out.name}-tok", vocab=VOCAB)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, out / name)
    return out, model


def _mxfp4(folder: Path, out: Path) -> Path:
    """``folder`` in the release's layout: MXFP4 expert blocks and scales (bf16 elsewhere
    kept float32 here), ``quantization_config`` mxfp4, two shards with an index."""
    shutil.copytree(folder, out)
    (out / "model.safetensors").unlink()
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    tensors = {}
    for name, t in state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            x = f"m.mlp.experts.{{}}.{name.rpartition('.')[2]}"
            per_expert = {x.format(e) + ".weight": t[e].t().contiguous() for e in range(len(t))}
            packed = quantize(per_expert, (1, 32))
            for part in ("blocks", "scales"):
                stacked = [packed[f"{x.format(e)}.{part}"] for e in range(len(t))]
                tensors[f"{name}_{part}"] = torch.stack(stacked).contiguous()
        else:
            tensors[name] = t
    names = sorted(tensors)
    shards = {"model-1.safetensors": names[::2], "model-2.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({k: tensors[k] for k in part}, str(out / file))
    index = {"metadata": {}, "weight_map": {k: f for f, part in shards.items() for k in part}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    raw = json.loads((out / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt_oss")
    folder, model = _saved(tmp / "hf")
    return folder, model, _mxfp4(folder, tmp / "mxfp4")


def _prompt(length: int) -> list[int]:
    gen = torch.Generator().manual_seed(9)
    return torch.randint(0, VOCAB, (length,), generator=gen).tolist()


@pytest.mark.parametrize("length", [7, 41])
def test_a_folder_transformers_saved_answers_like_transformers(saved, length):
    folder, model, _ = saved
    ckpt = load_checkpoint(folder)
    assert ckpt.config.model_type == "gpt_oss"
    ids = _prompt(length)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    assert generate(ckpt, ids, 24, page_tokens=PAGE).ids == ref[0, length:].tolist()


@pytest.mark.parametrize(
    ("changes", "window_tokens", "full"),
    [
        (dict(layer_types=["full_attention"] * 3), 0, 3),
        (dict(layer_types=["sliding_attention"] * 3, sliding_window=20), 32, 0),
    ],
    ids=["no-window", "all-sliding"],
)
def test_layer_mixes_without_one_kind_answer_like_transformers(
    tmp_path, changes, window_tokens, full
):
    """No sliding layer (no window pages: a target's snapshot_pages is refused by name), and
    only sliding layers (pages hold nothing, every K/V in window pages of 32): both answer as
    transformers does, 24 greedy steps past the window and a page."""
    folder, model = _saved(tmp_path / "hf", **changes)
    ckpt = load_checkpoint(folder)
    layout = Layout.of(ckpt.config, torch.float32, PAGE)
    assert layout.pages.window_tokens == window_tokens and layout.pages.num_full == full
    ids = _prompt(41)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    assert generate(ckpt, ids, 24, page_tokens=PAGE).ids == ref[0, 41:].tolist()
    target = Target(name="t", checkpoint=folder, snapshot_pages=2)
    if window_tokens:
        check_target(target, serving=True)
    else:
        with pytest.raises(UsageError, match="snapshot_pages = 2 applies to models with window"):
            check_target(target, serving=True)


def test_the_release_mxfp4_layout_answers_like_transformers_dequantising_loader(saved):
    _, _, release = saved
    ckpt = load_checkpoint(release)
    entry = index_tensors(release, ckpt.config)["model.layers.2.mlp.experts.4.down_proj.weight"]
    assert entry.stored_name == "model.layers.2.mlp.experts.down_proj_blocks"
    assert entry.piece == (4, 0, 96) and entry.shape == (96, 32) and entry.dtype == "U8"
    model = transformers.GptOssForCausalLM.from_pretrained(
        release,
        dtype=torch.float32,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
    ).eval()
    ids = _prompt(41)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    assert generate(ckpt, ids, 24, page_tokens=PAGE).ids == ref[0, 41:].tolist()


def test_misshapen_or_unscaled_experts_are_refused_by_name(saved, tmp_path):
    _, _, release = saved
    blocks = "model.layers.1.mlp.experts.gate_up_proj_blocks"

    def shrink(t):
        t[blocks] = t[blocks][:, :, :2].clone()

    with pytest.raises(TensorShapeError, match=rf"'{blocks}' has shape \[6, 64, 2, 16\]"):
        load_checkpoint(rewrite(release, tmp_path / "shrunk", shrink))

    def unscale(t):
        del t["model.layers.1.mlp.experts.gate_up_proj_scales"]

    with pytest.raises(TensorError, match=rf"'{blocks}' is U8 without a 2-d block scale"):
        load_checkpoint(rewrite(release, tmp_path / "unscaled", unscale))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"quantization_config": {"quant_method": "fp8"}}, "quant_method 'fp8'"),
        ({"layer_types": ["sliding_attention"]}, "layer_types must list 4"),
        ({"layer_types": ["chunked_attention"] * 4}, "layer_types must list 4"),
        ({"sliding_window": 0}, "sliding_window must be a positive integer"),
        ({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) exceeds"),
        ({"rope_parameters": {"rope_type": "llama3"}}, "rope_type 'llama3' is not supported"),
        ({"swiglu_limit": 0}, "swiglu_limit must be positive"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ],
)
def test_config_refusals(tmp_path, change, message):
    raw = json.loads((make_tiny("gpt_oss", tmp_path / "t") / "config.json").read_text())
    raw.update(change)
    with pytest.raises(CheckpointError, match=message):
        parse_config(raw)


def test_transformers_defaults_fill_a_sparse_config(tmp_path):
    """A file that leaves out what GptOssConfig defaults (windows on even layers of 128,
    YaRN 32 over 4,096 at theta 150,000, biases) reads as those defaults."""
    raw = json.loads((make_tiny("gpt_oss", tmp_path / "t") / "config.json").read_text())
    for key in ("layer_types", "sliding_window", "rope_parameters", "attention_bias"):
        del raw[key]
    c = parse_config(raw)
    assert c.layer_types == ("sliding_attention", "full_attention") * 2
    assert c.family_fields.sliding_window == 128 and c.attention_bias
    assert (c.rope_type, c.rope_theta, c.rope_yarn[:2]) == ("yarn", 150000.0, (32.0, 4096.0))


def test_expert_parallel_ranks_split_the_routed_experts_only(tmp_path):
    folder = make_tiny("gpt_oss", tmp_path / "t", fp8=True)
    full = load_checkpoint(folder)
    parts = [load_shard(folder, Shard(r, 2, "ep")) for r in range(2)]
    routed = [{n for n in p.tensors if ".experts." in n} for p in parts]
    assert not routed[0] & routed[1]
    assert routed[0] | routed[1] == {n for n in full.tensors if ".experts." in n}
    for part in parts:
        for name, t in part.tensors.items():
            if name != "lm_head.weight":  # rank 0's alone
                assert torch.equal(t, full.tensors[name]), name
    with pytest.raises(ValueError, match="'tp' is implemented for .*, not gpt_oss"):
        Shard(0, 2, "tp").check(full.config)


def test_a_target_takes_harmony_and_refuses_a_parser_that_would_misread_it(tmp_path):
    from kern.engine.targets import select
    from kern.errors import UsageError

    folder = make_tiny("gpt_oss", tmp_path / "t")

    def chosen(**overrides):
        return select(config=None, target=None, model=folder, overrides=overrides, serving=True)

    assert chosen().target.tool_parser == "harmony"
    assert chosen(tool_parser="harmony").target.tool_parser == "harmony"
    with pytest.raises(UsageError, match="answers in the harmony format; tool_parser 'qwen3'"):
        chosen(tool_parser="qwen3")
    with pytest.raises(UsageError, match="leave reasoning_parser out"):
        chosen(reasoning_parser="qwen3")
