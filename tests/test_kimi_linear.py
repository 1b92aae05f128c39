"""``kimi_linear`` (Kimi-Linear): folders in both config spellings and the released tensor
names load and answer like transformers (the oracle cases are in test_oracle.py); what kern
cannot run is refused by name; a state parks and wakes bit for bit, and preemption parks
states (slot growth and the snapshots' hits are test_scheduler.py's, for both stateful
families)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from support.scheduler import Harness, load, prompt

from kern.checkpoint.config import load_config, parse_config
from kern.checkpoint.errors import ConfigFieldError, UnsupportedModelError
from kern.checkpoint.load import load_checkpoint
from kern.engine.generate import generate
from kern.engine.layout import Layout
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


def test_a_saved_folder_with_kimis_tokenizer_serves_like_kern_run_with_kimi_tool_calls(tmp_path):
    """The issue's end to end: a folder transformers' save_pretrained wrote, with Kimi's
    tiktoken tokenizer beside it (no tokenizer.json, no remote code), served by ``kern serve
    --model DIR --tool-call-parser kimi_k2``: answers equal ``kern run``'s, and a required tool
    call comes back as OpenAI ``tool_calls`` with Kimi's ``functions.NAME:N`` ids."""
    transformers = pytest.importorskip("transformers")
    openai = pytest.importorskip("openai")
    from support.server import KEY, MODEL, Server

    src = make_tiny("kimi_linear", tmp_path / "src", seed=3, tokenizer="tiktoken")
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    out = tmp_path / "saved"
    model.save_pretrained(out)
    for name in ("tiktoken.model", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, out / name)
    assert not (out / "tokenizer.json").exists()
    ckpt = load_checkpoint(out)
    eos = set(ckpt.tokenizer.eos_token_ids)
    s = Server(
        tmp_path, "kimi", pool_bytes="4MiB", model=out, extra=("--tool-call-parser", "kimi_k2")
    )
    try:
        for p in (prompt(11, 17), prompt(12, 40)):
            want = generate(ckpt, p, 12, page_tokens=16).ids
            cut = next((k + 1 for k, t in enumerate(want) if t in eos), len(want))
            assert s.complete(p, 12)["choices"][0]["token_ids"] == want[:cut]
        client = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0)
        tool = {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 12}},
                    "required": ["city"],
                },
            },
        }
        ask = [{"role": "user", "content": "Weather in Paris?"}]
        r = client.chat.completions.create(
            model=MODEL, messages=ask, tools=[tool], tool_choice="required", temperature=0,
            max_tokens=120, parallel_tool_calls=False,
        )  # fmt: skip
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        assert re.fullmatch(r"functions\.get_weather:[0-9]+", call.id)
        assert call.function.name == "get_weather"
        assert isinstance(json.loads(call.function.arguments)["city"], str)
        # (assert_no_leak's page arithmetic assumes one page a chunk; nothing held is the point)
        m = s.idle_metrics()
        assert m["kern_pool_pages_held"] == 0 and m["kern_pool_slots_held"] == 0
    finally:
        s.close()


def test_make_tiny_writes_kimis_tokenizer_and_refuses_it_elsewhere(tmp_path, capsys):
    from kern import cli

    assert (
        cli.main(["make-tiny", "kimi_linear", str(tmp_path / "k"), "--tokenizer", "tiktoken"]) == 0
    )
    files = {p.name for p in (tmp_path / "k").iterdir()}
    assert {"tiktoken.model", "tokenizer_config.json"} <= files and "tokenizer.json" not in files
    ckpt = load_checkpoint(tmp_path / "k")
    assert ckpt.config.vocab_size == ckpt.tokenizer.vocab_size == 912
    assert ckpt.tokenizer.token_to_id("<|tool_calls_section_begin|>") is not None
    for argv, what in (
        (["qwen3", str(tmp_path / "q")], "family 'qwen3'"),
        (["kimi_linear", str(tmp_path / "v"), "--vocab", "600"], "option 'vocab'"),
    ):
        assert cli.main(["make-tiny", *argv, "--tokenizer", "tiktoken"]) == 2
        assert f"does not go with {what}" in capsys.readouterr().err
