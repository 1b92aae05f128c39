"""``deepseek_v4`` served: a folder transformers saved answers through ``kern serve`` as
``kern run`` does; prefix hits (at page ends, mid-HCA-window, and at prompt-end snapshots)
are exact; parked entries wake bit for bit; speculative rows rewind the pooling state; the
page's bytes are the formula's. (Oracle cases: test_oracle.py; loading:
test_deepseek_v4_load.py; batch invariance: test_invariance.py.)"""

from __future__ import annotations

import shutil

import pytest
import torch
from support.scheduler import Harness, load, prompt

from kern.checkpoint.config import parse_config
from kern.checkpoint.load import load_checkpoint
from kern.engine.generate import generate
from kern.engine.layout import Layout
from kern.errors import UsageError
from kern.tiny import make_tiny

PT = 4  # pages of 4 tokens: the tiny HCA rate is 8, so every other page end is mid-window
WINDOW = 8  # the tiny sliding window: a window page holds 8 positions


@pytest.fixture(scope="module")
def folder(tiny_dir):
    return tiny_dir("deepseek_v4")


def test_a_folder_transformers_saved_serves_like_kern_run(folder, tmp_path):
    transformers = pytest.importorskip("transformers")
    from support.server import MODEL, Server

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    out = tmp_path / "saved"
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(folder / name, out / name)
    ckpt = load_checkpoint(out)
    eos = set(ckpt.tokenizer.eos_token_ids)
    ids = prompt(11, 30)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)
    assert generate(ckpt, ids, 20, page_tokens=16).ids == ref[0, len(ids) :].tolist()
    s = Server(tmp_path, "v4", pool_bytes="1MiB", host_bytes="4MiB", model=out)
    try:
        for n, p in enumerate([ids, prompt(12, 45), prompt(13, 7)]):
            body = {"model": MODEL, "prompt": p, "max_tokens": 24, "temperature": 0}
            r = s.http.post("/v1/completions", json={**body, "return_token_ids": True})
            assert r.status_code == 200, r.text
            got = r.json()["choices"][0]["token_ids"]
            want = generate(ckpt, p, 24, page_tokens=16).ids
            cut = next((i + 1 for i, t in enumerate(want) if t in eos), len(want))
            assert got == want[:cut], n
        s.assert_no_leak(counts=False)  # window pages and pages share chunks, several each
    finally:
        s.close()


def test_every_hit_resumes_at_a_snapshot_and_is_exact(folder):
    """Prompts sharing j tokens with an answered one hit its last prefill snapshot at or
    before j (every lcm(page, window) = 8 tokens), a repeat its prompt-end snapshot (one token
    short, mid window), a next turn the entry's end (mid window, mid HCA window), and each
    answers as kern run does."""
    engine = load(folder, pool_bytes=2**20, host_bytes=4 * 2**20, page_tokens=PT)
    h = Harness(engine)
    base = prompt(21, 41)
    first = h.submit(base, 10, ignore_eos=True)
    h.run()
    h.assert_identical(first)
    for j in (4, 8, 13, 20, 23, 37):
        req = h.submit(base[:j] + prompt(22 + j, 9), 8, ignore_eos=True)
        h.run()
        h.assert_identical(req)
        assert req.cached_tokens == j // WINDOW * WINDOW, j
    again = h.submit(base, 10, ignore_eos=True)
    h.run()
    h.assert_identical(again)
    assert again.cached_tokens == len(base) - 1
    # A prompt ending at a snapshot recomputes its last token: it resumes at the one before.
    edge = h.submit(base[:16], 4, ignore_eos=True)
    h.run()
    h.assert_identical(edge)
    assert edge.cached_tokens == 8
    turn = h.submit(base + h.answer(first) + prompt(23, 6), 6, ignore_eos=True)
    h.run()
    h.assert_identical(turn)
    assert turn.cached_tokens == len(base) + 10 - 1  # 50: 2 into a window, 2 into an HCA one
    h.assert_idle_and_clean()


@pytest.mark.parametrize("every", [1, 2])
def test_snapshots_every_k_pages_fall_mid_hca_window(tmp_path, every):
    """A window of 12 over pages of 4: prefill snapshots every 12 * k tokens, so with the HCA
    rate 8 they fall mid HCA window (12, 36); hits at or before each are exact and cut back
    to the last snapshot, never resumed between."""
    folder = make_tiny("deepseek_v4", tmp_path / "w12", sliding_window=12)
    engine = load(folder, pool_bytes=2**20, page_tokens=PT, snapshot_pages=every)
    h = Harness(engine)
    base = prompt(51, 50)
    first = h.submit(base, 4, ignore_eos=True)
    h.run()
    h.assert_identical(first)
    for j in (11, 12, 20, 30, 36, 47):
        req = h.submit(base[:j] + prompt(52 + j, 5), 4, ignore_eos=True)
        h.run()
        h.assert_identical(req)
        assert req.cached_tokens == j // (12 * every) * (12 * every), j
    h.assert_idle_and_clean()


def test_a_parked_entry_wakes_bit_for_bit(folder):
    engine = load(folder, pool_bytes=2**20, host_bytes=8 * 2**20, page_tokens=PT)
    h = Harness(engine)
    req = h.submit(prompt(31, 26), 6, ignore_eos=True)
    h.run()
    mem, runner = h.sched.memory, engine.runner
    tokens = req.prompt_ids + h.answer(req)[:-1]
    m = mem.match(tokens)
    assert m.hit_len == len(tokens)
    before = runner.arena.page_rows[mem.pages(m)].clone()
    mem.unlock(m.node)
    while mem.make_room(mem.pages_free + 1):  # park everything the tree holds
        pass
    assert h.cache.stats().parked_pages >= len(before)
    m = mem.match(tokens)
    assert mem.wake(m.node)
    woken = mem.match(tokens)
    mem.unlock(m.node)
    assert torch.equal(runner.arena.page_rows[mem.pages(woken)], before)
    mem.unlock(woken.node)
    nxt = h.submit(tokens + [h.answer(req)[-1], 5, 6], 5, ignore_eos=True)
    h.run()
    h.assert_identical(nxt)
    assert nxt.cached_tokens == len(tokens)
    h.assert_idle_and_clean()


def test_speculative_rows_rewind_the_pooling_state(folder):
    """n-gram drafts on a repetitive prompt: some accepted, some rejected (a rejected row may
    have closed a window and written its page's state), and the answer is rows 1's."""
    ckpt = load_checkpoint(folder)
    base = prompt(41, 40)
    p = base + base[:20] + base
    one = generate(ckpt, p, 60, rows=1, page_tokens=PT)
    five = generate(ckpt, p, 60, rows=5, page_tokens=PT)
    assert 0 < five.num_accepted_tokens < five.num_draft_tokens
    assert five.ids == one.ids


def test_a_page_and_a_window_page_hold_the_formulas_bytes():
    """In bf16 at the released Flash's dims (43 layers: 2 sliding, then CSA and HCA
    alternating; head_dim 512, indexer keys 128, window 128): a page of ``pt`` tokens holds per
    layer only CSA pt / 4 entries and keys and HCA max(1, pt / 128) entries; a window page, a
    16-byte header and per layer 128 window entries plus the float32 accumulators (CSA two of
    each compressor, HCA one)."""
    from kern.bench.deepseek_v4 import FLASH, released

    kinds = FLASH
    raw = released(kinds, 4096, 64)
    c = parse_config(raw)
    d, di, item, w = 512, 128, 2, 128
    csa, hca = kinds.count(4), kinds.count(128)
    window = 16 + len(kinds) * w * d * item + csa * 4 * 3 * 2 * (d + di) + hca * 4 * 3 * d
    for pt in (16, 64, 128, 256):
        entries = csa * (pt // 4) * (d + di) * item + hca * max(1, pt // 128) * d * item
        layout = Layout.of(c, torch.bfloat16, pt)
        assert layout.page_bytes == entries
        assert layout.windowed and layout.state_bytes == window
        assert layout.pages.window_tokens == w
    with pytest.raises(ValueError, match="page_tokens 6 does not fit"):
        Layout.of(c, torch.bfloat16, 6)


def test_what_is_not_supported_is_refused_by_name(folder, tmp_path):
    from kern.engine.targets import check_target
    from kern.kern_toml import Target
    from kern.tiny import make_tiny

    tp = Target(name="t", checkpoint=folder, pool_bytes=2**20, ranks=2, parallel="tp")
    with pytest.raises(UsageError, match="'tp' is implemented for .*, not deepseek_v4"):
        check_target(tp, serving=True)
    qwen3 = make_tiny("qwen3", tmp_path / "qwen3")  # the same tokenizer as the tiny V4
    for d in (folder, qwen3):
        draft = Target(name="t", checkpoint=folder, pool_bytes=2**20, rows=(1, 4), draft=str(d))
        with pytest.raises(UsageError, match="a draft checkpoint for a deepseek_v4 target is not"):
            check_target(draft, serving=True)
    draft = Target(name="t", checkpoint=qwen3, pool_bytes=2**20, rows=(1, 4), draft=str(folder))
    with pytest.raises(UsageError, match="a deepseek_v4 draft checkpoint is not supported"):
        check_target(draft, serving=True)
    odd = Target(name="t", checkpoint=folder, pool_bytes=2**20, page_tokens=6)
    with pytest.raises(UsageError, match="page_tokens 6 does not fit .* rate 4") as e:
        check_target(odd, serving=True)
    assert "compress_rates [4, 8] fit page_tokens 16 (kern serve --page-tokens 16" in str(e.value)
    # Snapshot spacing is a window-page model's: another family refuses it by name.
    check_target(Target(name="t", checkpoint=folder, snapshot_pages=4), serving=True)
    spaced = Target(name="t", checkpoint=qwen3, snapshot_pages=4)
    with pytest.raises(UsageError, match="snapshot_pages = 4 applies to models with window"):
        check_target(spaced, serving=True)


def test_expert_parallel_ranks_hold_disjoint_experts_and_one_head(folder):
    from kern.engine.ranks.shard import Shard, load_shard

    full = load_checkpoint(folder)
    parts = [load_shard(folder, Shard(r, 2, "ep")) for r in range(2)]
    experts = [{n for n in p.tensors if ".ffn.experts." in n} for p in parts]
    assert not experts[0] & experts[1]
    assert experts[0] | experts[1] == {n for n in full.tensors if ".ffn.experts." in n}
    for name in experts[1]:
        assert torch.equal(parts[1].tensors[name], full.tensors[name])  # whole experts
    assert torch.equal(parts[0].tensors["head.weight"], full.tensors["head.weight"])
    assert parts[1].tensors["head.weight"].shape[0] == 1  # rank 1 computes no logits
