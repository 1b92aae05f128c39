"""A request's tokens as a growing int64 tensor, for the penalties' per-row counts: owned by
the request's ``Context`` (kern.engine.params), kept by the sampler across steps."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["TokenLog"]


class TokenLog:
    """A request's tokens as an int64 tensor that grows with them: each step converts only
    the tokens appended since the last. Owned by the request; ``tokens`` lists only grow (a
    new list, a shorter one or a changed last token starts over)."""

    def __init__(self) -> None:
        self._buf = torch.zeros(0, dtype=torch.long)
        self._n = 0
        self._last = -1  # tokens[n - 1] when last seen
        self._source: list[int] | None = None

    def view(self, tokens: list[int]) -> Tensor:
        n, size = self._n, len(tokens)
        if tokens is not self._source or size < n or (n and tokens[n - 1] != self._last):
            self._source, n = tokens, 0
        if size > self._buf.shape[0]:
            grown = torch.zeros(max(2 * self._buf.shape[0], size, 64), dtype=torch.long)
            grown[:n] = self._buf[:n]
            self._buf = grown
        if size == n + 1:
            self._buf[n] = tokens[n]
        elif size > n:
            self._buf[n:size] = torch.as_tensor(tokens[n:], dtype=torch.long)
        self._n = size
        self._last = tokens[size - 1] if size else -1
        return self._buf[:size]
