"""``kimi_linear`` (Kimi-Linear): folders in both config spellings and the released tensor
names load and answer like transformers (the oracle cases are in test_oracle.py); what kern
cannot run is refused by name; a state parks and wakes bit for bit, and preemption parks
states (slot growth and the snapshots' hits are test_scheduler.py's, for both stateful
families)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from support.scheduler import Harness, load, prompt

from kern.checkpoint import load_checkpoint
from kern.engine.generate import generate
from kern.engine.layout import Layout
from kern.model_config import (
    ConfigFieldError,
    UnsupportedModelError,
    load_config,
    parse_config,
)
from kern.tiny import make_tiny

PT = 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_tiny("kimi_linear", tmp_path_factory.mktemp("kimi"), seed=1)


@pytest.fixture(scope="module")
def chunk(folder) -> int:
    """Bytes of one pool chunk of the tiny model at pages of PT tokens."""
    return load(folder, pool_bytes=2**20, page_tokens=PT).cache.stats().chunk_bytes


def test_a_folder_transformers_saved_answers_like_transformers(folder, tmp_path):
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    out = tmp_path / "saved"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(folder / name, out / name)
    saved = json.loads((out / "config.json").read_text())
    # transformers writes its own spelling (sizes and 0-indexed layer lists at the top level)
    # beside the released keys it was given; with those removed it must read the same.
    assert saved["layer_types"][1] == "full_attention" and saved["linear_head_dim"] == 16
    for key in ("linear_attn_config", "first_k_dense_replace", "mla_use_nope", "moe_layer_freq"):
        del saved[key]
    (out / "config.json").write_text(json.dumps(saved))
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.block_sparse_moe.experts.3.w1.weight" in names
    assert "model.layers.0.self_attn.q_conv1d.weight" in names
    assert load_config(out) == load_config(folder)
    ckpt = load_checkpoint(out)
    ids = prompt(5, 29)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    assert generate(ckpt, ids, 24, page_tokens=PT).ids == ref[0, len(ids) :].tolist()


def test_the_state_and_the_latent_pages_of_the_released_dims():
    """Kimi-Linear-48B's config: 20 KDA layers of 32 heads of 128 (a float32 128 x 128 state
    a head, a conv over 3 x 4096 channels), 7 latent layers of 512 + 64."""
    from kern.bench.kimi import RELEASED

    c = parse_config(RELEASED)
    layout = Layout.of(c, torch.bfloat16, 1)
    assert layout.page_class == "latent" and layout.page_bytes == 7 * 576 * 2
    assert layout.delta_bytes == 20 * 32 * 128 * 128 * 4  # 40 MiB
    assert layout.conv_bytes == 20 * 3 * 4096 * 3 * 2
    assert c.is_sparse_layer(1) and not c.is_sparse_layer(0)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (
            {"linear_attn_config": {"gate_lower_bound": -5.0}},
            UnsupportedModelError,
            "linear_attn_config.gate_lower_bound -5.0 is not supported",
        ),
        ({"mla_use_nope": False}, UnsupportedModelError, "mla_use_nope False is not supported"),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            UnsupportedModelError,
            "rope_scaling",
        ),
        (
            {"moe_router_activation_func": "softmax"},
            UnsupportedModelError,
            "moe_router_activation_func 'softmax'",
        ),
        (
            {"linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2]}},
            ConfigFieldError,
            "for layers [4]",
        ),
        ({"mlp_layer_types": ["dense"]}, ConfigFieldError, "mlp_layer_types must list"),
        ({"num_expert_group": 3}, ConfigFieldError, "equal groups"),
    ],
)
def test_config_refusals(folder, change, error, message):
    raw = json.loads((folder / "config.json").read_text())
    for key, value in change.items():
        if key == "linear_attn_config":
            raw[key] = {**raw[key], **value}
            if "kda_layers" in value:
                del raw[key]["full_attn_layers"]
                raw[key].update(value)
        else:
            raw[key] = value
    with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_config(raw)


# --- states in the scheduler --------------------------------------------------------------


def test_a_state_parks_and_wakes_bit_for_bit(folder, chunk):
    engine = load(folder, pool_bytes=8 * chunk, host_bytes=16 * chunk, page_tokens=PT)
    h = Harness(engine)
    req = h.submit(prompt(77, 21), 6, ignore_eos=True)
    h.run()
    h.assert_identical(req)
    mem, runner = h.sched.memory, engine.runner
    tokens = req.prompt_ids + h.answer(req)[:-1]  # where the request-end snapshot sits
    m = mem.match(tokens)
    assert m.hit_len == len(tokens) and m.state_slot is not None
    before = (runner.delta_states[m.state_slot].clone(), runner.conv_states[m.state_slot].clone())
    mem.unlock(m.node)
    while mem.make_room(mem.pages_free + 1):  # park everything the tree holds
        pass
    assert h.cache.stats().parked_states >= 1
    m = mem.match(tokens)
    assert m.state_slot is None
    assert mem.wake(m.node)
    woken = mem.match(tokens)
    mem.unlock(m.node)
    assert woken.state_slot is not None
    assert torch.equal(runner.delta_states[woken.state_slot], before[0])
    assert torch.equal(runner.conv_states[woken.state_slot], before[1])
    mem.unlock(woken.node)
    nxt = h.submit(tokens + [h.answer(req)[-1], 5, 6], 5, ignore_eos=True)
    h.run()
    h.assert_identical(nxt)
    assert nxt.cached_tokens == len(tokens)
    h.assert_idle_and_clean()


def test_preemption_parks_states(folder, chunk):
    # Four sequences of 32 tokens need 8 pages and a slot each by their end: more than 3
    # chunks hold, so some are preempted, their states parked, and resumed.
    engine = load(folder, pool_bytes=3 * chunk, host_bytes=16 * chunk, page_tokens=PT)
    h = Harness(engine)
    reqs = [h.submit(prompt(60 + i, 12), 20, ignore_eos=True) for i in range(4)]
    h.run()
    for r in reqs:
        h.assert_identical(r)
    m = h.sched.metrics
    assert m.value("kern_num_preemptions_total") > 0 and m.value("kern_parked_total") > 0
    h.assert_idle_and_clean()


def test_the_benchmark_runs_and_checks_its_answers(capsys):
    """``python -m kern.bench.kimi`` (docs/performance.md): kern's greedy answer is checked
    against transformers' before the timings are printed."""
    pytest.importorskip("transformers")
    from kern.bench.kimi import main

    assert main(["--prompt", "16", "--steps", "4", "--repeat", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "| state a sequence, total | 43,417,600 (41.4 MiB) | |" in out
    assert "| Kimi-Linear-48B | 43,417,600 |" in out
