"""The sampler: greedy, seeded sampling, filters, and independence from the batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kern.engine.params import SamplingParams
from kern.engine.sampler import logprobs, sample


def logits(n: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_first_on_ties():
    x = logits(6)
    x[2, 7] = x[2, 9] = x[2].max() + 1
    out = sample(x, [SamplingParams()] * 6, range(6))
    assert all(type(t) is int for t in out)
    assert out == x.argmax(-1).tolist()
    assert out[2] == 7


def test_seeded_draws_repeat_and_ignore_the_batch():
    x = logits(8)
    p = SamplingParams(temperature=1.0, top_p=0.95, top_k=20, seed=11)
    alone = [int(sample(x[i : i + 1], [p], [i])[0]) for i in range(8)]
    others = [SamplingParams(temperature=0.7, seed=s) for s in range(8)]
    for i in range(8):
        mixed = others[:i] + [p] + others[i + 1 :]
        assert int(sample(x, mixed, list(range(8)))[i]) == alone[i]
    assert sample(x, [p] * 8, range(8)) == alone


def test_draw_index_and_seed_matter():
    x = logits(1, vocab=1000).repeat(64, 1)
    p = SamplingParams(temperature=2.0, seed=5)
    by_draw = sample(x, [p] * 64, range(64))
    assert len(set(by_draw)) > 10
    q = SamplingParams(temperature=2.0, seed=6)
    assert sample(x, [q] * 64, range(64)) != by_draw


@pytest.mark.parametrize(
    "p",
    [
        SamplingParams(temperature=1.0, top_k=1, seed=1),
        SamplingParams(temperature=1.0, top_p=1e-6, seed=1),
    ],
)
def test_narrow_filters_are_greedy(p):
    x = logits(16)
    assert sample(x, [p] * 16, range(16)) == x.argmax(-1).tolist()


@given(st.integers(1, 10), st.floats(0.05, 1.0), st.integers(0, 1000))
@settings(max_examples=60, deadline=None)
def test_filters_keep_tokens_inside_the_allowed_set(top_k, top_p, seed):
    x = logits(1, vocab=30, seed=seed)[0]
    p = SamplingParams(temperature=1.3, top_k=top_k, top_p=top_p, seed=seed)
    token = int(sample(x[None], [p], [seed])[0])
    probs = torch.softmax(x.double() / 1.3, 0)
    ranked = torch.argsort(-probs, stable=True)[:top_k]
    kept = probs[ranked] / probs[ranked].sum()
    before = torch.cumsum(kept, 0) - kept
    allowed = ranked[: max(int((before < top_p).sum()), 1)].tolist()
    assert token in allowed


def test_distribution_follows_the_softmax():
    x = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    p = SamplingParams(temperature=1.0, seed=3)
    n = 4000
    draws = sample(x.repeat(n, 1), [p] * n, range(n))
    freq = torch.bincount(torch.tensor(draws), minlength=4).double() / n
    torch.testing.assert_close(freq, torch.softmax(x[0].double(), 0), atol=0.03, rtol=0)


def test_unseeded_sampling_works():
    x = logits(4)
    out = sample(x, [SamplingParams(temperature=1.0)] * 4, range(4))
    assert len(out) == 4 and all(0 <= t < x.shape[1] for t in out)


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)]
)
def test_bad_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_needs_params_per_row():
    with pytest.raises(ValueError):
        sample(logits(2), [SamplingParams()], [0, 1])


def test_logprobs_are_the_log_softmax():
    x = logits(3, vocab=50)
    chosen, top = logprobs(x, 1, 7, 5)
    lp = torch.log_softmax(x[1], -1)
    assert chosen == float(lp[7])
    assert [t for t, _ in top] == torch.topk(lp, 5).indices.tolist()
    assert [v for _, v in top] == torch.topk(lp, 5).values.tolist()
    assert logprobs(x, 0, 3, 0)[1] == []


@pytest.mark.parametrize("temperature", [1e-310, 5e-324, 1e-30])
def test_a_tiny_temperature_is_greedy_not_nan(temperature):
    x = logits(8) * 50
    p = SamplingParams(temperature=temperature, seed=1)
    assert sample(x, [p] * 8, range(8)) == x.argmax(-1).tolist()


def _reference_process(row, p, tokens, num_prompt, banned):
    """Each processor as its definition says, one token at a time."""
    x = row.clone().tolist()
    for t, b in p.logit_bias:
        x[t] += b
    if p.repetition_penalty != 1.0:
        for t in set(tokens):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    out = list(tokens[num_prompt:])
    for t in set(out):
        x[t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    for t in banned:
        x[t] = float("-inf")
    return torch.tensor(x)


def test_logits_processing_matches_its_definitions_and_the_batch():
    from kern.engine.params import Context
    from kern.engine.sampler import _process

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=gen)
    params = [
        SamplingParams(presence_penalty=0.7, frequency_penalty=-0.3),
        SamplingParams(repetition_penalty=1.7, logit_bias=((3, 5.0), (9, -2.5))),
        SamplingParams(),
        SamplingParams(repetition_penalty=0.5, presence_penalty=2.0, logit_bias=((0, 100.0),)),
    ]
    contexts = [
        Context([1, 2, 3, 3, 7, 7, 7], 2),
        Context([4, 9, 9, 11], 1, frozenset({5, 6})),
        Context([1], 1, frozenset({0})),
        Context([0, 0, 49, 49, 1], 3),
    ]
    got = _process(logits, [0, 1, 2, 3], params, contexts)
    for i in range(4):
        c = contexts[i]
        want = _reference_process(logits[i], params[i], c.tokens, c.num_prompt, c.banned)
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6)
        # The same row alone: the same bits.
        alone = _process(logits, [i], [params[i]], [c])
        assert torch.equal(alone[0], got[i])
    # Greedy with a ban never picks the banned id; a bias of 100 always wins.
    picked = sample(logits, params, [0] * 4, contexts)
    assert picked[2] != 0 and picked[3] == 0
    with pytest.raises(ValueError, match="context"):
        sample(logits, params, [0] * 4)


def test_a_token_log_follows_its_list():
    from kern.engine.params import Context
    from kern.engine.sampler import TokenLog, _process

    p = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2)
    x = logits(1, vocab=40, seed=3)
    log = TokenLog()
    tokens = [1, 2, 3]

    def both() -> None:
        plain = _process(x, [0], [p], [Context(tokens, 2)])
        logged = _process(x, [0], [p], [Context(tokens, 2, log=log)])
        assert torch.equal(plain, logged), tokens

    both()
    for t in (5, 5, 39, 0):  # appended one at a time
        tokens.append(t)
        both()
    tokens += [7] * 100  # many at once, past the buffer
    both()
    del tokens[-50:]  # shorter: starts over
    both()
    tokens[-1] = 11  # the last token changed: starts over
    both()
    tokens = [4, 4]  # a new list
    both()
