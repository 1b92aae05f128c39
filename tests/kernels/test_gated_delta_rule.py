import os

import pytest
import torch
import torch.nn.functional as F
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


def make_inputs(lens, num_heads, k_dim, v_dim, dtype=torch.float32, num_slots=6):
    """Ragged inputs shaped as Qwen3.5's layer makes them: g = -exp(A) softplus(a + dt)."""
    num_tokens = sum(lens)
    q = torch.randn(num_tokens, num_heads, k_dim).to(dtype)
    k = torch.randn(num_tokens, num_heads, k_dim).to(dtype)
    v = torch.randn(num_tokens, num_heads, v_dim).to(dtype)
    a = torch.randn(num_tokens, num_heads)
    g = -torch.rand(num_heads).mul(4).exp() * F.softplus(a - 4)
    beta = torch.randn(num_tokens, num_heads).sigmoid().to(dtype)
    states = torch.randn(num_slots, num_heads, k_dim, v_dim) * 0.1
    query_start_loc = F.pad(torch.tensor(lens).cumsum(0), (1, 0)).to(torch.int32)
    slot_ids = torch.randperm(num_slots)[: len(lens)]
    return q, k, v, g, beta, states, slot_ids, query_start_loc


def call(fn, inputs, states, **kw):
    q, k, v, g, beta, _, slot_ids, query_start_loc = inputs
    return fn(q, k, v, g, beta, states, slot_ids, query_start_loc, scale=q.shape[-1] ** -0.5, **kw)


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize(
    ("lens", "num_heads", "k_dim", "v_dim", "dtype", "chunk_size"),
    [
        pytest.param([1, 7, 63, 130], 1, 32, 40, torch.float32, 64, id="B4-T201-H1-K32-V40-fp32"),
        pytest.param([5, 0, 40], 1, 64, 64, torch.float32, 16, id="B3-T45-H1-K64-V64-C16-fp32"),
        pytest.param([33, 1], 2, 32, 32, torch.bfloat16, 32, id="B2-T34-H2-K32-V32-C32-bf16"),
    ],
)
def test_gated_delta_rule_kernel(
    form, lens, num_heads, k_dim, v_dim, dtype, chunk_size, assert_close, tol
):
    ref_fn, kernel_fn = FORMS[form]
    kw = {"chunk_size": chunk_size} if form == "chunk" else {}
    inputs = make_inputs(lens, num_heads, k_dim, v_dim, dtype)
    states = inputs[5]
    ref_states, got_states = states.clone(), states.clone()
    ref = call(ref_fn, inputs, ref_states, **kw)
    got = call(kernel_fn, inputs, got_states, **kw)
    assert got.dtype == dtype
    assert_close("o", ref, got, tol(dtype))
    assert_close("states", ref_states, got_states, tol(torch.float32))


def test_reference_forms_agree(assert_close):
    inputs = make_inputs([1, 7, 63, 130], 2, 32, 48)
    rec_states, chunk_states = inputs[5].clone(), inputs[5].clone()
    rec = call(reference.gated_delta_rule_recurrent, inputs, rec_states)
    chunk = call(reference.gated_delta_rule, inputs, chunk_states)
    assert_close("o", rec, chunk, 1e-5)
    assert_close("states", rec_states, chunk_states, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_matches_transformers(dtype, assert_close):
    """Against transformers' own torch functions, given q/k with fewer heads (Hk = 2, Hv = 4):
    the caller repeats them as transformers does."""
    if os.environ.get("KERN_KERNEL_DEVICE", "cpu") != "cpu":
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


def split_call(fn, inputs, cuts, **kw):
    """Run one sequence (inputs of B = 1) as several calls cut at `cuts`, state carried,
    each call sharing the batch with another sequence; return (o, final state)."""
    q, k, v, g, beta, states, slot_ids, _ = inputs
    states = states.clone()
    bounds = [0, *cuts, q.shape[0]]
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        other = make_inputs([e - s + 3], q.shape[1], q.shape[2], v.shape[2])
        batch = [torch.cat([x[s:e], y]) for x, y in zip((q, k, v, g, beta), other[:5], strict=True)]
        query_start_loc = torch.tensor([0, e - s, 2 * (e - s) + 3], dtype=torch.int32)
        slots = torch.tensor([slot_ids[0].item(), (slot_ids[0].item() + 1) % states.shape[0]])
        o = fn(*batch, states, slots, query_start_loc, scale=q.shape[-1] ** -0.5, **kw)
        outs.append(o[: e - s])
    return torch.cat(outs), states[slot_ids[0]]


@pytest.mark.parametrize(
    ("form", "cuts"),
    [
        pytest.param("recurrent", [1, 2, 17, 40], id="recurrent-any-split"),
        pytest.param("chunk", [16, 32, 64], id="chunk-split-at-multiples"),
    ],
)
def test_reference_batch_and_split_invariant(form, cuts):
    """Bitwise: a sequence's rows and final state do not depend on its batch, nor (recurrent:
    any; chunked: at multiples of chunk_size) on how it was split into calls."""
    fn = FORMS[form][0]
    kw = {"chunk_size": 16} if form == "chunk" else {}
    inputs = make_inputs([70], 2, 64, 64)
    states = inputs[5].clone()
    alone = call(fn, inputs, states, **kw)
    got, got_state = split_call(fn, inputs, cuts, **kw)
    assert torch.equal(got, alone)
    assert torch.equal(got_state, states[inputs[6][0]])
