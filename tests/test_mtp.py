"""``draft = "mtp"`` (kern.engine.drafters.mtp): a deepseek_v3 checkpoint's own
multi-token-prediction layer drafts. Its draft logits are transformers' (``MtpModel``) at every
position of a sequence, and transformers' greedy answer with ``use_mtp=True`` is kern's at rows 4
and 1. At rows 2, 4 and 5 the answer is the rows-1 answer bit for bit, through ``kern run`` and the
scheduler, alone, in a batch, after a prefix hit (the MTP's entries there filled blind) and in a
pool too tight for every MTP page; seeded sampling too; the scheduler drafts exactly what ``kern
run`` drafts. What kern cannot run is refused by name.

Acceptance: random weights accept next to nothing (the MTP layer was never trained to agree
with its target); it is measured, and shown with ``-s``, on a tiny model whose MTP layer is
built to agree with its target (:func:`kern.bench.mtp.agreeing`)."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.scheduler import draft_of, fresh, prompt, spec_counts

from kern.arith import cdiv
from kern.bench.mtp import agreeing
from kern.checkpoint.load import load_checkpoint
from kern.chunk import SeqChunk
from kern.engine.drafters.mtp import mtp_runner
from kern.engine.generate import generate
from kern.engine.load import Engine
from kern.engine.params import SamplingParams
from kern.engine.runner import Runner
from kern.engine.targets import select
from kern.errors import UsageError
from kern.kern_toml import Target, load_toml_config
from kern.tiny import make_tiny

PT = 4
STEPS = 24


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp")
    ds = make_tiny("deepseek_v3", root / "random", seed=5, mtp_layers=1)
    return {
        "random": ds,
        "agree": agreeing(ds, root / "agree", 0.1),
        "plain": make_tiny("deepseek_v3", root / "plain", seed=5),
    }


def target(checkpoint: Path, **kw) -> Target:
    kw.setdefault("pool_bytes", 8 * 2**20)
    kw.setdefault("rows", (1, 2, 4, 5))
    return Target(
        name="t",
        checkpoint=checkpoint,
        page_tokens=PT,
        draft="mtp",
        origin={"draft": "kern.toml: targets.t.draft"},
        **kw,
    )


@pytest.fixture(scope="module")
def engines(folders):
    made: dict[str, Engine] = {}

    def get(kind: str) -> Engine:
        if kind not in made:
            made[kind] = Engine.load(target(folders[kind]))
        return made[kind]

    return get


def test_draft_logits_and_greedy_answer_are_transformers(folders):
    transformers = pytest.importorskip("transformers")
    from transformers.cache_utils import MtpCache
    from transformers.modeling_layers import MtpModel
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3ForCausalLM

    d = folders["random"]
    n = json.loads((d / "config.json").read_text())["num_hidden_layers"]
    # transformers finds the MTP weights by this pattern (DeepSeek-V3's layer 61): the tiny's.
    cls, keys = DeepseekV3ForCausalLM, DeepseekV3ForCausalLM._keys_to_ignore_on_load_unexpected
    cls._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n}.*"]
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            d, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        assert isinstance(model, cls)
        mtp = MtpModel.from_pretrained(model).eval()
    finally:
        cls._keys_to_ignore_on_load_unexpected = keys
    ids = prompt(3, 21)
    with torch.no_grad():
        seq = model.generate(
            torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False, use_mtp=True
        )[0].tolist()
        hidden = model(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1]
        # The MTP over the whole sequence: row i reads token i + 1 and the hidden at i.
        out = mtp.forward_layer(
            0,
            hidden[:, :-1],
            torch.arange(1, len(seq))[None],
            MtpCache(config=model.config.get_mtp_config()),
            input_ids=torch.tensor([seq[1:]]),
        )
        want = mtp._project_to_logits(out)[0]
    ckpt = load_checkpoint(d, mtp=True)
    pages = cdiv(len(seq), PT)
    runner = Runner.with_pages(ckpt, num_pages=pages, page_tokens=PT)
    runner.keep_hidden = True
    table = list(range(pages))
    runner.forward([SeqChunk(seq, 0, table)])
    assert runner.hidden is not None
    torch.testing.assert_close(runner.hidden, hidden[0], atol=1e-4, rtol=0)
    # kern's MTP in chunks of 7 entries over pages of 4 (each chunk attends to the ones before).
    layer = mtp_runner(runner, ckpt, num_pages=pages)
    got = []
    for a in range(0, len(seq) - 1, 7):
        b = min(a + 7, len(seq) - 1)
        chunk = SeqChunk(seq[a + 1 : b + 1], a, table, logits="all")
        # Every row's logits: the target's head on the layer's output (already normed).
        got.append(layer.forward([chunk], inputs=runner.hidden[a:b]))
    torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=0)
    answer = seq[len(ids) :]
    assert generate(ckpt, ids, STEPS, page_tokens=PT).ids == answer
    assert generate(ckpt, ids, STEPS, rows=4, page_tokens=PT, mtp=True).ids == answer


@pytest.mark.parametrize("kind", ["agree", "random"])
def test_rows_2_4_5_are_rows_1_through_kern_run_and_the_scheduler(engines, kind):
    engine = engines(kind)
    ckpt = engine.checkpoint
    p = prompt(1, 11)
    base = generate(ckpt, p, STEPS, page_tokens=PT).ids
    counts = {}
    for rows in (2, 4, 5):
        run = generate(ckpt, p, STEPS, rows=rows, page_tokens=PT, mtp=True)
        assert run.ids == base, rows
        counts[rows] = (run.num_draft_tokens, run.num_accepted_tokens)
    for rows in (2, 5):
        h = fresh(engine, rows=rows)
        alone = h.submit(p, STEPS, ignore_eos=True)
        h.run()
        assert h.answer(alone) == base
        # The same drafts as kern run's: the scheduler's catch-up is the same computation.
        assert spec_counts(h) == counts[rows], rows
    rates = {rows: f"{a}/{d}" for rows, (d, a) in counts.items()}
    print(f"{kind}: kern run, drafts accepted {rates}")
    if kind == "random":
        return  # nothing accepted: the batch below is the agreeing model's
    before = spec_counts(h)
    reqs = [h.submit(prompt(i, 7 + 4 * i), STEPS - 3 * i, ignore_eos=True) for i in range(5)]
    h.run()
    for r in reqs:
        h.assert_identical(r)
    drafted, accepted = (a - b for a, b in zip(spec_counts(h), before, strict=True))
    print(f"{kind}: a batch of 5 at rows 5, drafts accepted {accepted:.0f}/{drafted:.0f}")
    assert 0 < accepted < drafted and counts[5][1] > counts[2][1]
    h.assert_idle_and_clean()


def test_seeded_sampling_at_rows_5_is_rows_1(engines):
    engine = engines("agree")
    params = SamplingParams(temperature=0.6, top_p=0.9, seed=7)
    got = {}
    for rows in (1, 5):
        h = fresh(engine, rows=rows)
        reqs = [
            h.submit(prompt(40 + i, 9 + 4 * i), 20, params=params, ignore_eos=True, num_logprobs=2)
            for i in range(3)
        ]
        h.run()
        got[rows] = [h.events[r] for r in reqs]
        if rows == 5:
            drafted, accepted = spec_counts(h)
            assert 0 < accepted < drafted, (drafted, accepted)
        h.assert_idle_and_clean()
    assert got[5] == got[1]
    p = prompt(40, 9)
    run1 = generate(engine.checkpoint, p, 20, sampling=params, page_tokens=PT)
    run5 = generate(engine.checkpoint, p, 20, rows=5, sampling=params, page_tokens=PT, mtp=True)
    assert run5.ids == run1.ids == [t for t, _, _ in got[1][0][:-1]]


def test_a_prefix_hit_and_a_tight_pool_keep_every_answer(folders):
    """A prompt served again hits the tree (whose pages hold the target's KV, never the
    MTP's): the MTP's entries there are filled blind and it drafts on. A pool too small for
    every MTP page: they are dropped for the target's pages and refused when none is free;
    every answer is the rows-1 answer and every page comes back."""
    engine = Engine.load(target(folders["agree"], pool_bytes=48 * 2304))
    h = fresh(engine, rows=5)
    p = prompt(7, 13)
    first = h.submit(p, STEPS, ignore_eos=True)
    h.run()
    again = h.submit(p, STEPS, ignore_eos=True)
    h.step()
    assert again.cached_tokens and again.cached_tokens >= 8, again.cached_tokens
    # Its prompt's MTP entries, the hit's filled blind: every position the target holds.
    assert draft_of(again).computed == again.num_computed == len(p)
    h.run()
    assert h.answer(again) == h.answer(first)
    h.assert_identical(again)
    assert spec_counts(h)[1] > 0
    h.assert_idle_and_clean()

    seen = {"dropped": 0, "refused": 0}
    memory = h.sched.memory
    drop, take = memory.drop_drafts, memory.take_draft_pages

    def counted_drop() -> bool:
        dropped = drop()
        seen["dropped"] += dropped
        return dropped

    def counted_take(n: int):
        pages = take(n)
        seen["refused"] += pages is None
        return pages

    memory.drop_drafts = counted_drop
    memory.take_draft_pages = counted_take
    reqs = [h.submit(prompt(70 + i, 9 + 3 * i), 24, ignore_eos=True) for i in range(6)]
    most = 0
    while h.open:
        h.step()
        most = max(most, sum(len(draft_of(r).table) for r in h.sched._running))
    for r in reqs:
        h.assert_identical(r)
    assert most > 0 and seen["dropped"] > 0 and seen["refused"] > 0, (most, seen)
    h.assert_idle_and_clean()


def test_mtp_pages_span_more_tokens_where_the_backend_reads_any_stride(folders, engines):
    """Where the latent attention reads pages at any stride (CUDA's kernels, and the torch
    reference path here), an MTP page holds ``page_tokens * m`` tokens, ``m`` up to the
    target's layer count: 2 for the tiny's 3 layers (the CPU backend's needs ``m`` to divide
    3: 1). Answers and drafts are those of ``kern run`` on the same backend."""
    from kern.backend import make_ops

    assert engines("agree").drafting.runner.page_tokens == PT
    engine = Engine.load(target(folders["agree"]), ops=make_ops("cpu", reference=True))
    assert engine.drafting.runner is not None and engine.drafting.runner.page_tokens == 2 * PT
    ckpt, p = engine.checkpoint, prompt(2, 10)
    h = fresh(engine, rows=5)
    r = h.submit(p, 16, ignore_eos=True)
    h.run()
    run = generate(ckpt, p, 16, rows=5, page_tokens=PT, reference=True, mtp=True)
    assert h.answer(r) == run.ids == generate(ckpt, p, 16, page_tokens=PT, reference=True).ids
    assert spec_counts(h) == (run.num_draft_tokens, run.num_accepted_tokens)
    assert run.num_accepted_tokens > 0
    h.assert_idle_and_clean()


def test_kern_run_drafts_with_mtp(folders, capsys):
    from kern.cli import main

    d = folders["agree"]
    ids = prompt(5, 9)
    argv = ["run", "--model", str(d), "--draft", "mtp", "--rows", "4", "--steps", "12"]
    assert main([*argv, "--prompt-ids", ",".join(map(str, ids)), "--ignore-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["draft"] == "mtp" and out["rows"] == 4
    assert out["ids"] == generate(load_checkpoint(d), ids, 12, page_tokens=16).ids


def test_what_kern_cannot_run_is_refused_by_name(folders, tiny_dir, tmp_path):
    qwen = tiny_dir("qwen3")
    cases = [
        (target(qwen), f"target 't''s checkpoint {qwen} is qwen3"),
        (target(folders["plain"]), "has no multi-token-prediction layer"),
        (target(folders["random"], ranks=2), "draft = 'mtp' with ranks = 2"),
        (target(folders["random"], rows=(1,)), "drafts nothing for target 't' at rows [1]"),
    ]
    for t, message in cases:
        with pytest.raises(UsageError, match="kern.toml: targets.t.draft") as e:
            Engine.load(t)
        assert message in str(e.value), str(e.value)
    # A kern.toml keeps "mtp" a drafter, not a folder; kern run/serve check it before loading.
    toml = tmp_path / "kern.toml"
    toml.write_text(f'[targets.q]\ncheckpoint = "{qwen}"\nrows = [1, 4]\ndraft = "mtp"\n')
    parsed = load_toml_config(toml).target("q")
    assert parsed.draft == "mtp" and parsed.draft_checkpoint is None
    with pytest.raises(UsageError, match=rf"{toml}: targets.q.draft: draft = 'mtp' drafts with"):
        select(config=toml, target="q", model=None, overrides={}, serving=True)
    with pytest.raises(UsageError, match=r"--draft: draft = 'mtp' drafts nothing at rows \[1\]"):
        select(
            config=None,
            target=None,
            model=folders["random"],
            overrides={"draft": "mtp"},
            serving=False,
        )
    chosen = select(
        config=None,
        target=None,
        model=folders["random"],
        overrides={"draft": "mtp"},
        rows=4,
        serving=False,
    )
    assert chosen.target.draft == "mtp" and chosen.target.decode_rows == 4


def test_served_with_mtp_is_kern_run_at_rows_4_and_1(tmp_path, folders):
    """Over HTTP, one at a time and four at once: a ``draft = "mtp"`` target answers as kern
    run does at rows 4 (with the MTP layer) and at rows 1, its MTP pages all back after."""
    from support.server import KEY, MODEL, Server

    d = folders["agree"]
    toml = tmp_path / "kern.toml"
    toml.write_text(
        f'[targets.{MODEL}]\ncheckpoint = "{d}"\npool_bytes = "4MiB"\n'
        'rows = [1, 4]\ndraft = "mtp"\n'
    )
    command = [sys.executable, "-m", "kern.cli", "serve", "--port", "{port}"]
    command += ["--config", str(toml), "--target", MODEL]
    s = Server(tmp_path, "mtp", pool_bytes="4MiB", command=command, key=KEY)
    try:
        assert "drafts of the checkpoint's MTP layer, its pages from the same pool" in s.output()
        ckpt = load_checkpoint(d, mtp=True)
        eos = set(ckpt.tokenizer.eos_token_ids)

        def kern_run(p: list[int], rows: int) -> list[int]:
            ids = generate(ckpt, p, 20, rows=rows, page_tokens=16, threads=2, mtp=True).ids
            cut = next((n + 1 for n, t in enumerate(ids) if t in eos), len(ids))
            return ids[:cut]

        prompts = [prompt(90 + i, 6 + 3 * i) for i in range(4)]
        first = s.complete(prompts[0], 20)["choices"][0]["token_ids"]
        assert first == kern_run(prompts[0], 4) == kern_run(prompts[0], 1)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda p: s.complete(p, 20), prompts))
        for p, out in zip(prompts, outs, strict=True):
            assert out["choices"][0]["token_ids"] == kern_run(p, 4) == kern_run(p, 1)
        m = s.metrics()
        drafted = m["kern_spec_decode_num_draft_tokens_total"]
        accepted = m["kern_spec_decode_num_accepted_tokens_total"]
        assert 0 < accepted < drafted
        print(f"served with mtp: {accepted:.0f} of {drafted:.0f} draft tokens accepted")
        s.assert_no_leak()
    finally:
        s.close()


def test_a_folder_transformers_saved_with_its_mtp_shard_serves_like_kern_run(tmp_path, folders):
    """The real checkpoints' shape: transformers' own ``save_pretrained`` writes the target in
    shards with an index (it drops the MTP layer), and the MTP layer rides in a shard of its
    own that the index names, as DeepSeek-V3's layer 61 does. ``kern serve --model DIR --rows 4
    --draft mtp`` answers as ``kern run`` does at rows 4 and 1, and drafts."""
    transformers = pytest.importorskip("transformers")
    from support.server import Server

    src = folders["agree"]
    n = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    out = tmp_path / "saved"
    model.save_pretrained(out, max_shard_size="100KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, out / name)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert not any(k.startswith(f"model.layers.{n}.") for k in index["weight_map"])
    assert len(set(index["weight_map"].values())) > 1
    mtp = {k: v for k, v in load_file(src / "model.safetensors").items() if f"layers.{n}." in k}
    save_file(mtp, str(out / "model-mtp.safetensors"))
    index["weight_map"].update(dict.fromkeys(mtp, "model-mtp.safetensors"))
    (out / "model.safetensors.index.json").write_text(json.dumps(index))

    ckpt = load_checkpoint(out, mtp=True)
    prompts = [prompt(120 + i, 5 + 4 * i) for i in range(3)]
    want = [generate(ckpt, p, 16, rows=1, page_tokens=16, threads=2).ids for p in prompts]
    for p, w in zip(prompts, want, strict=True):
        assert generate(ckpt, p, 16, rows=4, page_tokens=16, threads=2, mtp=True).ids == w
    s = Server(
        tmp_path, "saved", pool_bytes="4MiB", model=out, extra=("--rows", "4", "--draft", "mtp")
    )
    try:
        eos = set(ckpt.tokenizer.eos_token_ids)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(lambda p: s.complete(p, 16), prompts))
        for out_, w in zip(outs, want, strict=True):
            cut = next((k + 1 for k, t in enumerate(w) if t in eos), len(w))
            assert out_["choices"][0]["token_ids"] == w[:cut]
        assert s.metrics()["kern_spec_decode_num_draft_tokens_total"] > 0
        s.assert_no_leak()
    finally:
        s.close()


def test_mtp_benchmark_runs_and_its_rows_agree(folders, capsys):
    """``python -m kern.bench.mtp`` (docs/performance.md): it compares the answers at rows 1
    and 4 before it prints a speed-up, and the agreeing copy it builds accepts drafts."""
    from kern.bench.mtp import main

    args = ["--model", str(folders["random"]), "--steps", "12", "--prompts", "2", "--repeat", "1"]
    assert main([*args, "--agree", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "rows 1 vs rows 4 (MTP drafts)" in out and "agreeing (output projections x 0.1)" in out
    total = next(line for line in out.splitlines() if line.startswith("| all |"))
    assert total.split("|")[5].strip() != "0%"
