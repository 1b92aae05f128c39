"""Token sampling and logprobs: pure functions of (logits, params, draw index).

Design notes
------------
* Greedy (``temperature == 0``) is ``argmax``, first index on ties, batched over rows.
* Random sampling draws one uniform per token from a ``torch.Generator`` seeded with a hash
  of (request seed, draw index), where the draw index is how many tokens the request has
  produced before this one. So a seeded request gets the same tokens whatever else shares its
  batch, however its steps were batched, and at any speculative ``rows`` (a verify row drawing
  token i uses draw index i, as plain decoding would), without a generator object per request
  to carry, park or restore. A request without a seed gets a fresh random one per draw.
* Filtering is the usual order: temperature, then top-k, then top-p (the smallest set of
  most likely tokens whose probability reaches top_p; ties in rank are broken by token id),
  then inverse-CDF sampling in float64 over what is left.
* Both functions take the runner's logits as they come and return plain Python values, so
  the scheduler that calls them never handles a tensor.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["LogprobEntry", "SamplingParams", "logprobs", "sample"]

# The chosen token's logprob and the top ones as (token id, logprob), most likely first.
LogprobEntry = tuple[float, list[tuple[int, float]]]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1 disable those filters; seed None draws
    a fresh random seed for every token."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = SamplingParams()


def sample(logits: Tensor, params: Sequence[SamplingParams], draw_ids: Sequence[int]) -> list[int]:
    """One token per row of ``logits`` [N, vocab] (float32): row i with ``params[i]``, as the
    ``draw_ids[i]``-th token its request produces. Pure."""
    if len(params) != logits.shape[0] or len(draw_ids) != logits.shape[0]:
        raise ValueError("need one SamplingParams and one draw index per row")
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = _sample_row(logits[i], p, draw_ids[i])
    return out


def logprobs(logits: Tensor, row: int, token: int, top: int) -> LogprobEntry:
    """Row ``row`` of ``logits``: the log-softmax of ``token`` and of the ``top`` most likely
    tokens (ties by token id, as ``torch.topk`` breaks them). Pure."""
    lp = torch.log_softmax(logits[row].float(), dim=-1)
    best: list[tuple[int, float]] = []
    if top:
        values, ids = torch.topk(lp, min(top, lp.shape[0]))
        best = list(zip(ids.tolist(), values.tolist(), strict=True))
    return float(lp[token]), best


def _sample_row(logits: Tensor, p: SamplingParams, draw_id: int) -> int:
    x = logits.detach().to("cpu", torch.float64)
    # The max first: a tiny temperature (1e-310 is valid) would make x / T overflow to inf
    # and the softmax NaN; (x - max) / T is 0 at the top and at worst -inf elsewhere, so a
    # temperature that underflows samples among the tied top tokens, as greedy would pick.
    x = (x - x.max()) / p.temperature
    vocab = x.shape[0]
    # Descending by logit, ties by token id: a stable sort of the negated values.
    order = torch.argsort(-x, stable=True)
    x = x[order]
    if 0 < p.top_k < vocab:
        x = x[: p.top_k]
    probs = torch.softmax(x, dim=0)
    if p.top_p < 1.0:
        before = torch.cumsum(probs, dim=0) - probs  # mass strictly above each token
        keep = int((before < p.top_p).sum())
        probs = probs[: max(keep, 1)]
    cdf = torch.cumsum(probs, dim=0)
    u = torch.rand((), generator=_generator(p.seed, draw_id), dtype=torch.float64)
    k = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    return int(order[min(k, cdf.shape[0] - 1)])


def _generator(seed: int | None, draw_id: int) -> torch.Generator:
    if seed is None:
        seed = secrets.randbits(63)
    digest = hashlib.blake2b(f"{seed}:{draw_id}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
