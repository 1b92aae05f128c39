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
* Logits processing, per row, before greedy or random choice (vLLM's meanings): ``logit_bias``
  added; every id outside ``allowed_token_ids`` (when set) to -inf; ``repetition_penalty``
  over the prompt and output tokens (a positive logit divided by it, a negative one
  multiplied); ``frequency_penalty`` times each output token's count and ``presence_penalty``
  once per output token seen, subtracted (OpenAI's); tokens ``banned`` (end of sequence and
  stop ids before ``min_tokens``) set to -inf; then a structured-output grammar's mask
  (kern.engine.structured). Each touches its own row only, so a request's answer does not
  depend on its batch.
* Filtering is the usual order: temperature, then top-k, then top-p (the smallest set of
  most likely tokens whose probability reaches top_p; ties in rank are broken by token id),
  then min-p (tokens below ``min_p`` times the top probability), then inverse-CDF sampling in
  float64 over what is left.
* Logprobs are the model's, before any processing (vLLM's default, "raw").
* Both functions take the runner's logits as they come and return plain Python values.
  :class:`Sampler` runs a forward and applies them to its logits on the runner side, so the
  scheduler hands it values (chunks and :class:`kern.engine.params.Pick`) and gets ids and
  logprob entries back: it never holds a tensor nor imports torch. The per-request tensors
  (the penalties' :class:`TokenLog`) live here too, keyed weakly by their request.
"""

from __future__ import annotations

import functools
import hashlib
import secrets
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from kern.chunk import SeqChunk
from kern.engine.params import GREEDY, Context, LogprobEntry, Pick, SamplingParams
from kern.engine.token_log import TokenLog

if TYPE_CHECKING:
    from kern.engine.runner import Runner

__all__ = ["Sampler", "TokenLog", "logprobs", "sample"]


class Sampler:
    """The runner side of a step's choice: runs ``runner``'s forward and turns its logits into
    Python values. Holds each request's token log (made when its penalties first need it,
    dropped with the request). The runner is looked up at each call, not bound once."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self._logs: weakref.WeakKeyDictionary[object, TokenLog] = weakref.WeakKeyDictionary()

    def forward(
        self, batch: Sequence[SeqChunk], picks: Sequence[Pick]
    ) -> list[tuple[int, LogprobEntry | None]]:
        """Run ``batch`` and pick a token for each logits row (``picks``, one per row, in
        order): (token id, logprob entry or None). Mutates what ``Runner.forward`` does."""
        logits = self.runner.forward(batch)
        if not picks:
            return []
        contexts: list[Context | None] = []
        for p in picks:
            ctx = p.context
            if ctx is not None and p.owner is not None and p.params.processes:
                log = self._logs.get(p.owner)
                if log is None:
                    log = self._logs[p.owner] = TokenLog()
                ctx = replace(ctx, log=log)
            contexts.append(ctx)
        picked = sample(
            logits,
            [p.params for p in picks],
            [p.draw_id for p in picks],
            contexts if any(c is not None for c in contexts) else None,
        )
        return [
            (tok, None if p.num_logprobs is None else logprobs(logits, i, tok, p.num_logprobs))
            for i, (tok, p) in enumerate(zip(picked, picks, strict=True))
        ]

    def greedy(self, batch: Sequence[SeqChunk]) -> list[int]:
        """Run ``batch`` and return the greedy token of each logits row, as :func:`sample`
        picks it (its tie-break included): a draft model's drafts."""
        logits = self.runner.forward(batch)
        n = logits.shape[0]
        return sample(logits, [GREEDY] * n, [0] * n) if n else []


# Requests share their banned sets and biases (the same stop ids, the same client settings):
# their tensors are made once.
@functools.lru_cache(maxsize=256)
def _banned(ids: frozenset[int]) -> Tensor:
    return torch.tensor(sorted(ids), dtype=torch.long)


@functools.lru_cache(maxsize=256)
def _bias(bias: tuple[tuple[int, float], ...]) -> tuple[Tensor, Tensor]:
    return (
        torch.tensor([t for t, _ in bias], dtype=torch.long),
        torch.tensor([b for _, b in bias], dtype=torch.float32),
    )


_NO_IDS = torch.zeros(0, dtype=torch.long)


def sample(
    logits: Tensor,
    params: Sequence[SamplingParams],
    draw_ids: Sequence[int],
    contexts: Sequence[Context | None] | None = None,
) -> list[int]:
    """One token per row of ``logits`` [N, vocab] (float32): row i with ``params[i]``, as the
    ``draw_ids[i]``-th token its request produces, its logits processed with ``contexts[i]``
    (needed where ``params[i].processes`` or tokens are banned). Pure."""
    if len(params) != logits.shape[0] or len(draw_ids) != logits.shape[0]:
        raise ValueError("need one SamplingParams and one draw index per row")
    if contexts is not None and len(contexts) != logits.shape[0]:
        raise ValueError("need one context (or None) per row")
    out = logits.argmax(dim=-1).tolist()
    rows = []
    for i, p in enumerate(params):
        ctx = contexts[i] if contexts is not None else None
        if ctx is not None and (p.processes or ctx.masks):
            rows.append(i)
        elif p.processes:
            raise ValueError(f"row {i}: penalties or a logit bias need the row's context")
    processed: dict[int, Tensor] = {}
    if rows:
        assert contexts is not None
        x = _process(logits, rows, [params[i] for i in rows], [contexts[i] for i in rows])
        best = x.argmax(dim=-1).tolist()
        for k, i in enumerate(rows):
            processed[i] = x[k]
            if params[i].greedy:
                out[i] = best[k]
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = _sample_row(processed.get(i, logits[i]), p, draw_ids[i])
    return out


def _process(
    logits: Tensor, rows: list[int], params: list[SamplingParams], contexts: list[Context]
) -> Tensor:
    """The processed logits of ``rows`` [R, vocab]: a few batched ops, each elementwise
    within a row (no sum or max across tokens or rows), so a row's result does not depend on
    which rows share its batch."""
    x = logits[rows].detach().to("cpu", torch.float32).clone()
    vocab = x.shape[1]
    n = len(rows)

    def pairs(per_row: list[Tensor], values: Tensor | None = None) -> tuple[Tensor, ...]:
        """(row, token) index pairs of each row's ids (and ``values``, one per id), ids
        outside the vocabulary left out."""
        t = torch.cat(per_row) if per_row else _NO_IDS
        # numpy's repeat: torch.repeat_interleave took ~1 ms here at 32 rows.
        r = torch.from_numpy(np.repeat(np.arange(len(per_row)), [i.shape[0] for i in per_row]))
        keep = (t >= 0) & (t < vocab)
        if values is None:
            return r[keep], t[keep]
        return r[keep], t[keep], values[keep]

    def ids(values: Sequence[int]) -> Tensor:
        return torch.as_tensor(values, dtype=torch.long) if len(values) else _NO_IDS

    if any(p.logit_bias for p in params):
        biases = [_bias(p.logit_bias) for p in params]
        r, t, v = pairs([b[0] for b in biases], torch.cat([b[1] for b in biases]))
        x.index_put_((r, t), v, accumulate=True)
    if any(p.allowed_token_ids is not None for p in params):
        keep = torch.ones_like(x, dtype=torch.bool)
        limited = [k for k, p in enumerate(params) if p.allowed_token_ids is not None]
        keep[limited] = False
        allowed = [
            _banned(p.allowed_token_ids) if p.allowed_token_ids is not None else _NO_IDS
            for p in params
        ]
        keep[pairs(allowed)] = True
        x = x.masked_fill(~keep, -torch.inf)
    rep = [p.repetition_penalty for p in params]
    pen = [bool(p.presence_penalty or p.frequency_penalty) for p in params]
    tokens = [
        _NO_IDS
        if rep[k] == 1.0 and not pen[k]
        else c.log.view(c.tokens)  # type: ignore[arg-type]
        if c.log is not None
        else ids(c.tokens)
        for k, c in enumerate(contexts)
    ]
    if any(v != 1.0 for v in rep):
        seen = torch.zeros_like(x, dtype=torch.bool)
        seen[pairs([t if rep[k] != 1.0 else _NO_IDS for k, t in enumerate(tokens)])] = True
        penalty = torch.tensor(rep, dtype=torch.float32).unsqueeze(1)
        x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    if any(pen):
        counts = torch.zeros_like(x)
        r, t = pairs([t[c.num_prompt :] for t, c in zip(tokens, contexts, strict=True)])
        counts.index_put_((r, t), torch.ones(len(t), dtype=torch.float32), accumulate=True)
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
        pres = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)
        x = x - (freq.unsqueeze(1) * counts + pres.unsqueeze(1) * (counts > 0).to(x.dtype))
    if any(c.banned for c in contexts):
        x[pairs([_banned(c.banned) for c in contexts])] = -torch.inf
    assert x.shape[0] == n
    grammars = [(k, c.grammar) for k, c in enumerate(contexts) if c.grammar is not None]
    if grammars:
        from kern.engine.masks import Matcher, apply_all

        # kern's matchers fill one bitmask for the step; any other masks its own row.
        apply_all(x, [(k, g) for k, g in grammars if isinstance(g, Matcher)])
        for k, g in grammars:
            if not isinstance(g, Matcher):
                g.apply(x[k : k + 1])
    return x


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
    if p.min_p > 0.0:
        # Sorted descending: the tokens at or above min_p times the top are a prefix.
        keep = int((probs >= p.min_p * probs[0]).sum())
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
