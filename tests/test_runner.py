"""The runner's API and its CPU building blocks (the oracle tests are in test_oracle.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kern.backend import CudaOps, ReferenceOps, cpu, make_ops
from kern.backend import cpu_attention as attention
from kern.backend import cpu_recurrence as recurrent
from kern.backend.cpu import MIN_ROWS, ROW_TILE, CpuOps
from kern.batch import build_step
from kern.checkpoint.load import load_checkpoint
from kern.chunk import SeqChunk
from kern.engine.runner import Runner
from kern.kernels.causal_conv1d import reference as conv_ref
from kern.kernels.gated_delta_rule import reference as gdr_ref
from kern.kernels.paged_attention import reference as attn_ref
from kern.kernels.pointwise import silu
from kern.tiny import make_tiny

PAGE = 16

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def qwen3(tiny):
    return tiny("qwen3")


@pytest.fixture(scope="module")
def qwen3_5(tiny):
    return tiny("qwen3_5")


def test_arena_layout(qwen3, qwen3_5):
    r = Runner.with_pages(qwen3, num_pages=5, page_tokens=PAGE)
    c = qwen3.config
    assert r.kv_arena.shape == (5, c.num_hidden_layers, 2, c.num_key_value_heads, PAGE, c.head_dim)
    assert r.layout.page_bytes == (
        c.num_hidden_layers * 2 * PAGE * c.num_key_value_heads * c.head_dim * 4
    )
    assert r.layout.state_bytes == 0 and r.conv_states is None
    s = Runner.with_pages(qwen3_5, num_pages=5, page_tokens=PAGE, num_slots=3)
    c = qwen3_5.config
    assert s.kv_arena.shape[1] == c.layer_types.count("full_attention")
    assert s.delta_states.shape == (
        3,
        c.layer_types.count("linear_attention"),
        c.delta.num_value_heads,
        c.delta.key_head_dim,
        c.delta.value_head_dim,
    )
    assert s.delta_states.dtype == torch.float32
    assert s.layout.state_bytes == (
        s.delta_states[0].numel() * 4 + s.conv_states[0].numel() * s.conv_states.element_size()
    )
    with pytest.raises(ValueError, match="num_slots"):
        Runner.with_pages(qwen3_5, num_pages=5, page_tokens=PAGE)


def test_logit_rows(qwen3):
    r = Runner.with_pages(qwen3, num_pages=8, page_tokens=PAGE)
    out = r.forward(
        [
            SeqChunk([1, 2, 3], 0, [0], logits="none"),
            SeqChunk([4, 5, 6, 7], 0, [1], logits="all"),
            SeqChunk([8, 9], 0, [2], logits="last"),
        ]
    )
    assert out.shape == (5, qwen3.config.vocab_size) and out.dtype == torch.float32
    alone = Runner.with_pages(qwen3, num_pages=8, page_tokens=PAGE)
    assert torch.equal(out[4], alone.forward([SeqChunk([8, 9], 0, [5])])[0])


@pytest.mark.parametrize(
    "chunk, message",
    [
        (SeqChunk([], 0, [0]), "no tokens"),
        (SeqChunk([1] * 17, 0, [0]), "need 2"),
        (SeqChunk([1], 0, [99]), "outside"),
        (SeqChunk([1], -1, [0]), "start_pos"),
        (SeqChunk([1], 0, [0], logits="some"), "logits"),  # type: ignore[arg-type]
    ],
)
def test_bad_batches(qwen3, chunk, message):
    r = Runner.with_pages(qwen3, num_pages=4, page_tokens=PAGE)
    before = r.kv_arena.clone()
    with pytest.raises(ValueError, match=message):
        r.forward([chunk])
    assert torch.equal(r.kv_arena, before)


def test_stateful_needs_distinct_slots(qwen3_5):
    r = Runner.with_pages(qwen3_5, num_pages=4, page_tokens=PAGE, num_slots=2)
    with pytest.raises(ValueError, match="slot"):
        r.forward([SeqChunk([1], 0, [0])])
    with pytest.raises(ValueError, match="twice"):
        r.forward([SeqChunk([1], 0, [0], slot=1), SeqChunk([2], 0, [1], slot=1)])


def test_fresh_sequence_clears_its_slot(qwen3_5):
    r = Runner.with_pages(qwen3_5, num_pages=4, page_tokens=PAGE, num_slots=2)
    a = r.forward([SeqChunk([5, 6, 7], 0, [0], slot=0)])
    r.forward([SeqChunk([9, 9, 9, 9], 0, [1], slot=1)])
    r.copy_slots([1], [0])  # slot 0 now holds another sequence's state
    b = r.forward([SeqChunk([5, 6, 7], 0, [0], slot=0)])
    assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "deepseek_v4"])
def test_taps_keep_the_layers_outputs_and_change_no_logit(tiny, family):
    """A drafter that reads several layers' hidden states (Runner.tap) gets each tapped
    layer's output of every row; the last layer's, through the final norm, is what
    keep_hidden keeps; the logits are the same bits with taps on or off."""
    ckpt = tiny(family)
    n = ckpt.config.num_hidden_layers
    batch = [SeqChunk([3, 1, 4, 1, 5], 0, [0], slot=0), SeqChunk([9, 2], 0, [1], slot=1)]
    plain = Runner.with_pages(ckpt, num_pages=4, page_tokens=PAGE, num_slots=2)
    want = plain.forward(batch)
    r = Runner.with_pages(ckpt, num_pages=4, page_tokens=PAGE, num_slots=2)
    r.tap([0, n - 1])
    r.keep_hidden = True
    got = r.forward(batch)
    assert torch.equal(got, want)
    assert sorted(r.layer_hidden) == [0, n - 1]
    assert r.layer_hidden[0].shape[0] == 7 and not torch.equal(
        r.layer_hidden[0], r.layer_hidden[n - 1]
    )
    if family != "deepseek_v4":  # V4's layers output hyper-connection streams
        assert r.hidden is not None
        assert torch.equal(r.model.final_hidden(r.layer_hidden[n - 1]), r.hidden)
    with pytest.raises(ValueError, match="layers to tap"):
        r.tap([n])


def test_copy_pages_and_slots(qwen3_5):
    r = Runner.with_pages(qwen3_5, num_pages=6, page_tokens=PAGE, num_slots=3)
    r.forward([SeqChunk(list(range(20)), 0, [0, 1], slot=0, logits="none")])
    r.copy_pages([0, 1], [3, 4])
    assert torch.equal(r.kv_arena[3:5], r.kv_arena[0:2])
    r.copy_slots([0], [2])
    assert torch.equal(r.delta_states[2], r.delta_states[0])
    assert torch.equal(r.conv_states[2], r.conv_states[0])
    # both continue identically
    x = r.forward([SeqChunk([7], 20, [0, 1], slot=0), SeqChunk([7], 20, [3, 4], slot=2)])
    assert torch.equal(x[0], x[1])
    with pytest.raises(ValueError):
        r.copy_pages([0], [1, 2])


def test_keep_rows_rewinds_state(qwen3_5):
    """Verifying 4 rows and keeping 2 leaves the state as if only 2 were fed."""
    r = Runner.with_pages(qwen3_5, num_pages=8, page_tokens=PAGE, num_slots=2)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for slot, pages in ((0, [0, 1]), (1, [2, 3])):
        r.forward([SeqChunk(prompt, 0, pages, slot=slot)])
    verify = r.forward([SeqChunk([5, 3, 5, 8], 8, [0, 1], slot=0, logits="all")])
    r.keep_rows(0, 2)
    plain = r.forward([SeqChunk([5, 3], 8, [2, 3], slot=1, logits="all")])
    assert torch.equal(verify[:2], plain)
    assert torch.equal(r.delta_states[0], r.delta_states[1])
    assert torch.equal(r.conv_states[0], r.conv_states[1])
    with pytest.raises(ValueError):
        r.keep_rows(1, 3)
    r.forward([SeqChunk([1], 10, [2, 3], slot=1)])
    with pytest.raises(KeyError):
        r.keep_rows(1, 1)


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "fallback"])
@pytest.mark.parametrize("shape", [(80, 96), (512, 2048)], ids=str)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 9, ROW_TILE, ROW_TILE + 3, 300, 1100])
def test_linear_rows_are_batch_invariant(onednn, shape, m):
    ops = CpuOps()
    if onednn and not ops.onednn:
        pytest.skip("the start-up probe found oneDNN's rows vary with the batch here")
    ops.onednn = onednn
    gen = torch.Generator().manual_seed(0)
    w_raw = torch.randn(*shape, generator=gen)
    x = torch.randn(1100, shape[1], generator=gen)
    w = ops.prepare_linear(w_raw)
    assert w.onednn == ops.onednn
    out = ops.linear(x[:m], w)
    # Sums of 2,048 products of magnitude ~45: a different summation order than MKL's
    # moves the last bits by up to ~1.5e-4 (seen on an Intel Xeon host), a few ulp of the sum.
    torch.testing.assert_close(out, x[:m] @ w_raw.t(), atol=5e-4, rtol=1e-4)
    # a row's bits do not depend on how many rows came with it, nor on its place
    assert torch.equal(out[:1], ops.linear(x[:1], w))
    assert torch.equal(out[-1:], ops.linear(x[m - 1 : m + 7], w)[:1])
    assert MIN_ROWS >= 2


def test_onednn_linear_is_used_with_the_pinned_torch():
    # The pinned torch's oneDNN held on every host measured; losing it would halve CPU decode
    # speed. Other torch versions get what the probe finds (torch 2.11's rows varied).
    pins = (ROOT / "constraints.txt").read_text().splitlines()
    if f"torch=={torch.__version__.split('+')[0]}" in pins:
        assert CpuOps().onednn
    else:
        assert CpuOps().onednn == cpu.onednn_rows_hold()


def test_the_probe_sees_what_the_linear_does():
    """Where the probe accepts oneDNN, its rows hold at every count from 1 to 40 and at a
    shape the probe does not try."""
    if not CpuOps().onednn:
        pytest.skip("the start-up probe found oneDNN's rows vary with the batch here")
    gen = torch.Generator().manual_seed(1)
    ops = CpuOps()
    w = ops.prepare_linear(torch.randn(384, 640, generator=gen))
    x = torch.randn(40, 640, generator=gen)
    whole = ops.linear(x, w)
    for m in range(1, 41):
        assert torch.equal(ops.linear(x[:m], w), whole[:m]), m


def _paged(gen, num_pages, hk, d):
    """Random K and V [P, PAGE, Hk, D], and the same in a CPU arena slice (the layout
    kern.backend.cpu_attention reads)."""
    k = torch.randn(num_pages, PAGE, hk, d, generator=gen)
    v = torch.randn(num_pages, PAGE, hk, d, generator=gen)
    cache = torch.zeros(num_pages, 2, hk, PAGE, d)
    k_view, v_view = attention.kv_views(cache)
    k_view.copy_(k)
    v_view.copy_(v)
    return k, v, cache


@pytest.mark.parametrize(
    "hq, hk, d", [(4, 1, 64), (4, 4, 32), (8, 2, 16), (2, 1, 128)], ids=lambda x: str(x)
)
def test_attention_matches_reference(hq, hk, d):
    gen = torch.Generator().manual_seed(hq * d)
    k_cache, v_cache, cache = _paged(gen, 24, hk, d)
    # decode, verify, a mid-page chunk after a prefix, a long prefill (several tiles)
    q_lens = [1, 4, 13, 150]
    ctx = [37, 20, 45, 150]
    tables = [[3, 7, 1], [9, 2], [4, 5, 6], list(range(10, 20))]
    chunks = [SeqChunk([0] * n, c - n, t) for n, c, t in zip(q_lens, ctx, tables, strict=True)]
    step = build_step(chunks, PAGE, torch.device("cpu"))
    plan = attention.plan_attention(
        step.q_starts,
        q_lens,
        ctx,
        step.block_tables,
        PAGE,
        hk,
        hq // hk,
        d,
        cache.stride(0),
        step.page_ids,
        step.page_offsets,
    )
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    ours = attention.attend(plan, q, cache, d**-0.5)
    bt = torch.zeros(4, 10, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    qsl = torch.tensor([0, 1, 5, 18, 168], dtype=torch.int32)
    ref = attn_ref.paged_attention(
        q, k_cache, v_cache, bt, torch.tensor(ctx, dtype=torch.int32), qsl, d**-0.5
    )
    torch.testing.assert_close(ours, ref, atol=2e-6, rtol=1e-5)


def test_attention_row_bits_do_not_depend_on_company():
    gen = torch.Generator().manual_seed(1)
    _, _, cache = _paged(gen, 16, 2, 32)
    q = torch.randn(40, 4, 32, generator=gen)

    def run(q_lens, ctx, rows):
        chunks = [
            SeqChunk([0] * n, c - n, list(range(8))) for n, c in zip(q_lens, ctx, strict=True)
        ]
        step = build_step(chunks, PAGE, torch.device("cpu"))
        plan = attention.plan_attention(
            step.q_starts,
            q_lens,
            ctx,
            step.block_tables,
            PAGE,
            2,
            2,
            32,
            cache.stride(0),
            step.page_ids,
            step.page_offsets,
        )
        return attention.attend(plan, rows, cache, 0.2)

    # position 29 of a sequence: as a decode row, beside another, and inside a prefill tile
    alone = run([1], [30], q[29:30])
    paired = run([1, 1], [100, 30], torch.cat([q[5:6], q[29:30]]))[1:]
    prefill = run([30], [30], q[:30])[29:30]
    longer = run([40], [40], q[:40])[29:30]  # keys past 29 exist but are masked
    for other in (paired, prefill, longer):
        assert torch.equal(alone, other)


def test_recurrent_ops_match_references_bitwise():
    gen = torch.Generator().manual_seed(2)
    q_lens, slots = [1, 6, 3, 1], [4, 0, 2, 5]
    starts = [0, 1, 7, 10]
    t, c, kw, hk, hv, dk, dv = 11, 24, 4, 2, 4, 8, 8
    plan, _ = recurrent.plan_recurrent(starts, q_lens, slots, [], kw)
    x = torch.randn(t, c, generator=gen)
    w = torch.randn(c, kw, generator=gen)
    conv_states = torch.randn(6, c, kw - 1, generator=gen)
    ref_states = conv_states.clone()
    ours = recurrent.causal_conv1d(plan, x, w, conv_states)
    qsl = torch.tensor(starts + [t])
    # The reference's taps in the same order; its pointwise(F.silu) is swapped for the CPU's
    # silu (kern.kernels.pointwise).
    ref = conv_ref.causal_conv1d(x, w, None, ref_states, torch.tensor(slots), qsl, activation=None)
    assert torch.equal(ours, silu(ref))
    assert torch.equal(conv_states, ref_states)

    q = torch.randn(t, hk, dk, generator=gen)
    k = torch.randn(t, hk, dk, generator=gen)
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, generator=gen)
    beta = torch.rand(t, hv, generator=gen)
    states = torch.randn(6, hv, dk, dv, generator=gen)
    ref_states = states.clone()
    ours = recurrent.gated_delta_rule(plan, q, k, v, g, beta, states, dk**-0.5)
    rep = hv // hk
    ref = gdr_ref.gated_delta_rule_recurrent(
        q.repeat_interleave(rep, 1),
        k.repeat_interleave(rep, 1),
        v,
        g,
        beta,
        ref_states,
        torch.tensor(slots),
        qsl,
        scale=dk**-0.5,
    )
    assert torch.equal(ours, ref)
    assert torch.equal(states, ref_states)
    # and close to the chunked form transformers uses for prefill
    chunk_states = states.clone()
    chunked = gdr_ref.gated_delta_rule(
        q.repeat_interleave(rep, 1),
        k.repeat_interleave(rep, 1),
        v,
        g,
        beta,
        chunk_states,
        torch.tensor(slots),
        qsl,
        scale=dk**-0.5,
    )
    again = recurrent.gated_delta_rule(plan, q, k, v, g, beta, states, dk**-0.5)
    torch.testing.assert_close(again, chunked, atol=1e-5, rtol=1e-5)


class _InterpretedTritonOps(CudaOps):
    """The CUDA backend's code path with its Triton kernels run by the interpreter on CPU
    tensors, in float32: checks the wiring (layouts, strides, plans) the GPU will run."""

    dtype = torch.float32


def _compare_backends(cpu: Runner, other: Runner) -> None:
    """The same steps (chunked prefill, decode beside another sequence, a verify chunk that
    keeps 2 rows) through two runners: logits within float32 rounding."""
    prompt = list(range(3, 23))
    steps = [
        [SeqChunk(prompt[:13], 0, [1, 2], slot=0, logits="all")],
        [SeqChunk(prompt[13:], 13, [1, 2], slot=0, logits="all"), SeqChunk([7, 8], 0, [4], 1)],
        [SeqChunk([5], 20, [1, 2], slot=0), SeqChunk([4], 2, [4], slot=1)],
        [SeqChunk([5, 6, 7], 21, [1, 2], slot=0, logits="all")],  # verify, keep 2 rows
        [SeqChunk([9], 23, [1, 2], slot=0)],
    ]
    for i, batch in enumerate(steps):
        a, b = cpu.forward(batch), other.forward(batch)
        torch.testing.assert_close(b, a, atol=1e-4, rtol=0)
        if i == 3 and cpu.stateful:
            cpu.keep_rows(0, 2)
            other.keep_rows(0, 2)


FAMILIES = [
    "qwen3",
    "qwen3_moe",
    "qwen3_5",
    "qwen3_next",
    "qwen3_5_moe",
    "gpt_oss",
    "deepseek_v3",
    "kimi_linear",
    "deepseek_v4",
]
# The interpreter is slow: qwen3_next runs qwen3_5_moe's kernels (its grouped in-projection
# is reordered at load, before any kernel), so it is checked on the reference backend only.
TRITON_FAMILIES = [f for f in FAMILIES if f != "qwen3_next"]


@pytest.mark.parametrize("family", TRITON_FAMILIES)
def test_triton_backend_matches_cpu(family, tmp_path, monkeypatch):
    # Read when triton and a kernel module are first imported: set before either.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    ckpt = load_checkpoint(make_tiny(family, tmp_path / family))
    cpu = Runner.with_pages(ckpt, num_pages=8, page_tokens=PAGE, num_slots=2)
    triton = _InterpretedTritonOps(torch.device("cpu"))
    other = Runner.with_pages(ckpt, num_pages=8, page_tokens=PAGE, num_slots=2, ops=triton)
    _compare_backends(cpu, other)


@pytest.mark.parametrize("family", FAMILIES)
def test_reference_backend_matches_cpu(family, tmp_path):
    ckpt = load_checkpoint(make_tiny(family, tmp_path / family))
    cpu = Runner.with_pages(ckpt, num_pages=8, page_tokens=PAGE, num_slots=2)
    ops = make_ops("cpu", reference=True)
    ref = Runner.with_pages(ckpt, num_pages=8, page_tokens=PAGE, num_slots=2, ops=ops)
    assert isinstance(ref.ops, ReferenceOps) and ref.dtype == torch.float32
    _compare_backends(cpu, ref)
    with pytest.raises(ValueError, match="CPU only"):
        make_ops("cuda", reference=True)


def test_onednn_row_counts_are_few() -> None:
    # Each distinct row count is a primitive oneDNN keeps: prefill chunks of every length from
    # 1 to 2,048 come to 64 + 28 + 24 row counts, each at least the rows asked for.
    counts = {cpu.onednn_rows(m) for m in range(1, 2049)}
    assert len(counts) == 64 - 1 + 28 + 24
    assert all(m <= cpu.onednn_rows(m) < m + 64 for m in range(1, 2049))
    assert cpu.onednn_rows(1) == cpu.ONEDNN_MIN_ROWS and cpu.onednn_rows(64) == 64
