"""Pointwise activations composed from ops whose bits agree in torch's vectorized and
scalar loops (exp, log1p, add, division), so an element's result does not depend on where it
falls in a tensor, and so on the batch. ``torch.sigmoid``, ``F.silu`` and ``F.softplus``
differ between those loops on torch 2.13 CPU (see ``ops.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def sigmoid(x: Tensor) -> Tensor:
    """1 / (1 + exp(-x)) from exp and division only (see the design notes)."""
    return torch.reciprocal(torch.exp(-x).add_(1.0))


def silu(x: Tensor) -> Tensor:
    """x * sigmoid(x), batch invariant on the CPU (``F.silu`` is not)."""
    return x / torch.exp(-x).add_(1.0)


def softplus(x: Tensor) -> Tensor:
    """log(1 + exp(x)), linear past 20 as ``F.softplus`` (beta 1, threshold 20) is."""
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x)))
