import os

import pytest
import torch
import torch.nn.functional as F
from transformers.models.kimi_linear.modeling_kimi_linear import (
    chunk_kimi_delta_attention,
    recurrent_kimi_delta_attention,
)
from transformers.models.kimi_linear.modeling_kimi_linear import l2norm as kda_l2norm
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from kern.kernels.gated_delta_rule import gated_delta_rule, reference

FORMS = {
    "chunk": (reference.gated_delta_rule, gated_delta_rule.gated_delta_rule),
    "recurrent": (
        reference.gated_delta_rule_recurrent,
        gated_delta_rule.gated_delta_rule_recurrent,
    ),
}
ON_CPU = os.environ.get("KERN_KERNEL_DEVICE", "cpu") == "cpu"


def make_inputs(lens, num_heads, k_dim, v_dim, dtype=torch.float32, num_slots=6, gate="head"):
    """Ragged inputs shaped as Qwen3.5's layer makes them: g = -exp(A) softplus(a + dt), a
    [T, H]; gate="channel": as Kimi-Linear's, a [T, H, Dk] (A still per head)."""
    num_tokens = sum(lens)
    q = torch.randn(num_tokens, num_heads, k_dim).to(dtype)
    k = torch.randn(num_tokens, num_heads, k_dim).to(dtype)
    v = torch.randn(num_tokens, num_heads, v_dim).to(dtype)
    channels = [k_dim] if gate == "channel" else []
    a = torch.randn(num_tokens, num_heads, *channels)
    decay_rate = torch.rand(num_heads).mul(4).exp().view(num_heads, *[1 for _ in channels])
    g = -decay_rate * F.softplus(a - 4)
    beta = torch.randn(num_tokens, num_heads).sigmoid().to(dtype)
    states = torch.randn(num_slots, num_heads, k_dim, v_dim) * 0.1
    query_start_loc = F.pad(torch.tensor(lens).cumsum(0), (1, 0)).to(torch.int32)
    slot_ids = torch.randperm(num_slots)[: len(lens)]
    return q, k, v, g, beta, states, slot_ids, query_start_loc


def harsh_gates(num_tokens, num_heads, k_dim):
    """KDA's extremes: on half the channels, tokens 2..31 decay by exp(-40..-50) (a chunk's
    cumulative sum near -1400), the rest stay mild, so decays from one mild token to the
    next sit beside cumulative sums far below -1000."""
    g = -0.3 * torch.rand(num_tokens, num_heads, k_dim)
    heavy = torch.rand(num_heads, k_dim) < 0.5
    rows = g[2:32]
    rows.copy_(torch.where(heavy, -40 - 10 * torch.rand(rows.shape), rows))
    return g


def call(fn, inputs, states, **kw):
    q, k, v, g, beta, _, slot_ids, query_start_loc = inputs
    return fn(q, k, v, g, beta, states, slot_ids, query_start_loc, scale=q.shape[-1] ** -0.5, **kw)


@pytest.mark.parametrize("gate", ["head", "channel"])
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize(
    ("lens", "num_heads", "k_dim", "v_dim", "dtype", "chunk_size"),
    [
        pytest.param([1, 7, 63, 130], 1, 32, 40, torch.float32, 64, id="B4-T201-H1-K32-V40-fp32"),
        pytest.param([5, 0, 40], 1, 64, 64, torch.float32, 16, id="B3-T45-H1-K64-V64-C16-fp32"),
        pytest.param([33, 1], 2, 32, 32, torch.bfloat16, 32, id="B2-T34-H2-K32-V32-C32-bf16"),
        pytest.param([16, 17, 2], 2, 24, 20, torch.float32, 16, id="B3-T35-H2-K24-V20-C16-fp32"),
    ],
)
def test_gated_delta_rule_kernel(
    gate, form, lens, num_heads, k_dim, v_dim, dtype, chunk_size, assert_close, tol
):
    ref_fn, kernel_fn = FORMS[form]
    kw = {"chunk_size": chunk_size} if form == "chunk" else {}
    inputs = make_inputs(lens, num_heads, k_dim, v_dim, dtype, gate=gate)
    states = inputs[5]
    ref_states, got_states = states.clone(), states.clone()
    ref = call(ref_fn, inputs, ref_states, **kw)
    got = call(kernel_fn, inputs, got_states, **kw)
    assert got.dtype == dtype
    assert_close("o", ref, got, tol(dtype))
    assert_close("states", ref_states, got_states, tol(torch.float32))
    # only the slots of sequences with rows change
    slot_ids, qsl = inputs[6], inputs[7]
    written = {s for s, n in zip(slot_ids.tolist(), qsl.diff().tolist(), strict=True) if n}
    for slot in set(range(states.shape[0])) - written:
        assert torch.equal(got_states[slot], states[slot])


@pytest.mark.parametrize(
    ("form", "impl"),
    [("chunk", 0), ("chunk", 1), ("recurrent", 1)],
    ids=["chunk-reference", "chunk-triton", "recurrent-triton"],
)
def test_very_negative_channel_gates(form, impl, assert_close):
    """Gates down to -50 a token and chunk cumulative sums near -1400, against the
    recurrent reference: finite, and within 3e-6 (measured 1.5e-7 on the CPU; decays taken
    as exp(G_i - G_j) from the chunk's cumulative sums, as transformers' chunked form takes
    them, are off by ~2e-5 here)."""
    lens = [3, 100, 40]
    inputs = list(make_inputs(lens, 2, 32, 16, gate="channel"))
    inputs[3] = torch.cat([harsh_gates(n, 2, 32) for n in lens])
    want_states, got_states = inputs[5].clone(), inputs[5].clone()
    want = call(reference.gated_delta_rule_recurrent, inputs, want_states)
    kw = {"chunk_size": 64} if form == "chunk" else {}
    got = call(FORMS[form][impl], inputs, got_states, **kw)
    assert_close("o", want, got, 3e-6)
    assert_close("states", want_states, got_states, 3e-6)


def test_reference_forms_agree(assert_close):
    for gate in ("head", "channel"):
        inputs = make_inputs([1, 7, 63, 130], 2, 32, 48, gate=gate)
        rec_states, chunk_states = inputs[5].clone(), inputs[5].clone()
        rec = call(reference.gated_delta_rule_recurrent, inputs, rec_states)
        chunk = call(reference.gated_delta_rule, inputs, chunk_states)
        assert_close(f"o[{gate}]", rec, chunk, 1e-5)
        assert_close(f"states[{gate}]", rec_states, chunk_states, 1e-5)


def test_head_gate_is_a_uniform_channel_gate(assert_close):
    """A per-head g repeated over the channels is the same decay: the same bits in the
    recurrent forms (both scale each state row by exp(g)), float32 rounding in the chunked
    ones (the per-channel decay is summed inside the q.k and k.k products)."""
    inputs = make_inputs([5, 40, 20], 2, 32, 16)
    spread = list(inputs)
    spread[3] = inputs[3][..., None].expand(-1, -1, 32)
    for form, (ref_fn, kernel_fn) in FORMS.items():
        kw = {"chunk_size": 16} if form == "chunk" else {}
        for fn in (ref_fn, kernel_fn):
            head_states, channel_states = inputs[5].clone(), inputs[5].clone()
            head = call(fn, inputs, head_states, **kw)
            channel = call(fn, spread, channel_states, **kw)
            if form == "recurrent":
                assert torch.equal(head, channel) and torch.equal(head_states, channel_states)
            else:
                assert_close(f"o[{form}]", head, channel, 1e-5)
                assert_close(f"states[{form}]", head_states, channel_states, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_matches_transformers(dtype, assert_close):
    """Against transformers' own torch functions, given q/k with fewer heads (Hk = 2, Hv = 4):
    the caller repeats them as transformers does."""
    if not ON_CPU:
        pytest.skip("two torch references against each other: the CPU run covers it")
    num_tokens, num_k_heads, num_v_heads, k_dim, v_dim = 70, 2, 4, 32, 16
    q = torch.randn(1, num_tokens, num_k_heads, k_dim).to(dtype)
    k = torch.randn(1, num_tokens, num_k_heads, k_dim).to(dtype)
    v = torch.randn(1, num_tokens, num_v_heads, v_dim).to(dtype)
    g = -F.softplus(torch.randn(1, num_tokens, num_v_heads))
    beta = torch.rand(1, num_tokens, num_v_heads).to(dtype)
    state = torch.randn(1, num_v_heads, k_dim, v_dim) * 0.1
    rep = num_v_heads // num_k_heads
    ours = (
        q[0].repeat_interleave(rep, dim=1),
        k[0].repeat_interleave(rep, dim=1),
        v[0], g[0], beta[0],
    )  # fmt: skip
    slot_ids, query_start_loc = torch.tensor([0]), torch.tensor([0, num_tokens])
    hf = {"initial_state": state, "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    for name, theirs_fn, ours_fn in [
        ("recurrent", torch_recurrent_gated_delta_rule, reference.gated_delta_rule_recurrent),
        ("chunk", torch_chunk_gated_delta_rule, reference.gated_delta_rule),
    ]:
        want, want_state = theirs_fn(q, k, v, g, beta, **hf)
        states = state.clone()
        got = ours_fn(*ours, states, slot_ids, query_start_loc, scale=k_dim**-0.5)
        assert got.dtype == want.dtype
        assert_close(f"o[{name}]", want[0].float(), got.float(), 1e-5)
        assert_close(f"states[{name}]", want_state, states, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_channel_reference_matches_transformers(dtype, assert_close):
    """Per channel, against transformers' Kimi Delta Attention, one sequence of a ragged batch
    at a time. Its l2norm is x / sqrt(sum x^2 + eps), ours x * rsqrt(...): with q and k
    normalised outside (by theirs), the recurrent form is bitwise transformers'; with each
    side's own, and in the chunked form, float32 rounding apart."""
    if not ON_CPU:
        pytest.skip("two torch references against each other: the CPU run covers it")
    lens, num_heads, k_dim, v_dim = [40, 1, 70], 2, 32, 16
    q, k, v, g, beta, states, slot_ids, qsl = make_inputs(
        lens, num_heads, k_dim, v_dim, dtype, gate="channel"
    )
    qn, kn = kda_l2norm(q.float()).to(dtype), kda_l2norm(k.float()).to(dtype)
    # transformers' scale is 1 / sqrt(Dk), which need not be the same double as Dk ** -0.5
    scale = 1 / k_dim**0.5
    runs = {}
    for name, fn, args in [
        ("recurrent-outside", reference.gated_delta_rule_recurrent, (qn, kn, False)),
        ("recurrent", reference.gated_delta_rule_recurrent, (q, k, True)),
        ("chunk", reference.gated_delta_rule, (q, k, True)),
    ]:
        s = states.clone()
        o = fn(args[0], args[1], v, g, beta, s, slot_ids, qsl, scale=scale, use_qk_l2norm=args[2])
        runs[name] = (o, s)
    for b, slot in enumerate(slot_ids.tolist()):
        rows = slice(qsl[b].item(), qsl[b + 1].item())
        seq = [x[None, rows] for x in (q, k, v, g, beta)]
        init = states[slot : slot + 1]
        for name, (o, s) in runs.items():
            if name == "chunk":
                theirs = chunk_kimi_delta_attention(
                    *seq, initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True
                )
            else:
                normed = name == "recurrent-outside"
                theirs = recurrent_kimi_delta_attention(
                    *([qn[None, rows], kn[None, rows]] if normed else seq[:2]),
                    *seq[2:],
                    initial_state=init,
                    output_final_state=True,
                    use_qk_l2norm_in_kernel=not normed,
                )
            want, want_state = theirs[0][0], theirs[1][0]
            assert o.dtype == want.dtype
            if name == "recurrent-outside":
                assert torch.equal(o[rows], want), f"o[{name}, {b}]"
                assert torch.equal(s[slot], want_state), f"states[{name}, {b}]"
            else:
                assert_close(f"o[{name}, {b}]", want.float(), o[rows].float(), 1e-5)
                assert_close(f"states[{name}, {b}]", want_state, s[slot], 1e-5)


def split_call(fn, inputs, cuts, **kw):
    """Run one sequence (inputs of B = 1) as several calls cut at `cuts`, state carried,
    each call sharing the batch with another sequence; return (o, final state)."""
    q, k, v, g, beta, states, slot_ids, _ = inputs
    gate = "channel" if g.dim() == 3 else "head"
    states = states.clone()
    bounds = [0, *cuts, q.shape[0]]
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        other = make_inputs([e - s + 3], q.shape[1], q.shape[2], v.shape[2], gate=gate)
        batch = [torch.cat([x[s:e], y]) for x, y in zip((q, k, v, g, beta), other[:5], strict=True)]
        query_start_loc = torch.tensor([0, e - s, 2 * (e - s) + 3], dtype=torch.int32)
        slots = torch.tensor([slot_ids[0].item(), (slot_ids[0].item() + 1) % states.shape[0]])
        o = fn(*batch, states, slots, query_start_loc, scale=q.shape[-1] ** -0.5, **kw)
        outs.append(o[: e - s])
    return torch.cat(outs), states[slot_ids[0]]


@pytest.mark.parametrize("gate", ["head", "channel"])
@pytest.mark.parametrize("impl", [0, 1], ids=["reference", "triton"])
@pytest.mark.parametrize(
    ("form", "cuts"),
    [
        pytest.param("recurrent", [1, 2, 17, 40], id="recurrent-any-split"),
        pytest.param("chunk", [16, 32, 64], id="chunk-split-at-multiples"),
    ],
)
def test_batch_and_split_invariant(form, cuts, impl, gate):
    """Bitwise: a sequence's rows and final state do not depend on its batch, nor (recurrent:
    any; chunked: at multiples of chunk_size) on how it was split into calls."""
    fn = FORMS[form][impl]
    kw = {"chunk_size": 16} if form == "chunk" else {}
    inputs = make_inputs([70], 2, 32, 32, gate=gate)
    states = inputs[5].clone()
    alone = call(fn, inputs, states, **kw)
    got, got_state = split_call(fn, inputs, cuts, **kw)
    assert torch.equal(got, alone)
    assert torch.equal(got_state, states[inputs[6][0]])
