import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, causal_conv1d_update

from kern.kernels.causal_conv1d import causal_conv1d, reference


def ragged(lens):
    return F.pad(torch.tensor(lens).cumsum(0), (1, 0)).to(torch.int32)


@pytest.mark.parametrize(
    ("lens", "channels", "width", "has_bias", "activation", "dtype"),
    [
        pytest.param(
            [1, 7, 63, 130], 40, 4, False, "silu", torch.float32, id="B4-T201-C40-K4-fp32"
        ),
        pytest.param([2, 0, 5], 300, 4, True, None, torch.float32, id="B3-T7-C300-K4-bias-fp32"),
        pytest.param([1, 1, 9], 64, 3, True, "silu", torch.bfloat16, id="B3-T11-C64-K3-bf16"),
        pytest.param([6], 16, 1, False, "silu", torch.float32, id="B1-T6-C16-K1-fp32"),
    ],
)
def test_causal_conv1d_kernel(
    lens, channels, width, has_bias, activation, dtype, assert_close, tol
):
    x = torch.randn(sum(lens), channels).to(dtype)
    weight = torch.randn(channels, width).to(dtype)
    bias = torch.randn(channels).to(dtype) if has_bias else None
    states = torch.randn(5, channels, width - 1).to(dtype)
    slot_ids = torch.randperm(5)[: len(lens)]
    ref_states, got_states = states.clone(), states.clone()
    qsl = ragged(lens)
    kw = {"activation": activation}
    ref = reference.causal_conv1d(x, weight, bias, ref_states, slot_ids, qsl, **kw)
    got = causal_conv1d.causal_conv1d(x, weight, bias, got_states, slot_ids, qsl, **kw)
    assert got.dtype == dtype
    assert_close("y", ref, got, tol(dtype))
    assert torch.equal(got_states, ref_states)  # copies of inputs: exact


@pytest.mark.parametrize("module", ["reference", "kernel"])
def test_chunked_equals_one_shot(module):
    """Bitwise: any split of a sequence into calls (down to token by token), in any batch,
    gives the one-shot outputs and final state."""
    fn = (reference if module == "reference" else causal_conv1d).causal_conv1d
    length, channels, width = 23, 24, 4
    x = torch.randn(length, channels)
    weight, bias = torch.randn(channels, width), torch.randn(channels)
    states = torch.zeros(3, channels, width - 1)
    slot = torch.tensor([1])
    one_shot = fn(x, weight, bias, states, slot, ragged([length]))
    want_state = states[1].clone()
    for cuts in ([1, 2, 3, 10], list(range(1, length))):
        states.zero_()
        outs = []
        bounds = [0, *cuts, length]
        for s, e in zip(bounds[:-1], bounds[1:], strict=True):
            other = torch.randn(4, channels)  # a neighbour sequence in slot 2
            y = fn(torch.cat([other, x[s:e]]), weight, bias, states, torch.tensor([2, 1]),
                   ragged([4, e - s]))  # fmt: skip
            outs.append(y[4:])
        assert torch.equal(torch.cat(outs), one_shot), cuts
        assert torch.equal(states[1], want_state), cuts


def test_reference_matches_transformers(assert_close):
    """Prefill by causal_conv1d_fn, then decode steps by causal_conv1d_update with its K-wide
    state; ours keeps K-1 columns and gives the same outputs."""
    channels, width, prefill, steps = 32, 4, 9, 3
    x = torch.randn(1, channels, prefill + steps)  # transformers' [B, C, T]
    weight = torch.randn(channels, width)
    want = [causal_conv1d_fn(x[:, :, :prefill], weight, None, activation="silu")]
    hf_state = F.pad(x[:, :, :prefill], (width, 0))[:, :, -width:].clone()
    for t in range(prefill, prefill + steps):
        want.append(causal_conv1d_update(x[:, :, t : t + 1], hf_state, weight, None, "silu"))
    want = torch.cat(want, dim=-1)[0].T

    states = torch.zeros(1, channels, width - 1)
    slot = torch.tensor([0])
    xt = x[0].T.contiguous()
    got = [reference.causal_conv1d(xt[:prefill], weight, None, states, slot, ragged([prefill]))]
    for t in range(prefill, prefill + steps):
        got.append(reference.causal_conv1d(xt[t : t + 1], weight, None, states, slot, ragged([1])))
    assert_close("y", want, torch.cat(got), 1e-6)
    assert torch.equal(states[0], hf_state[0, :, 1:])
