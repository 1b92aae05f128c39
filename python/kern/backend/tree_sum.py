"""Sums over a dimension in a fixed pairwise order, whatever its length: the batch-invariant
CPU attention's sums across key blocks (kern.backend.cpu_attention, the V4 attention).

The length is zero padded to a power of two and halved, element j adding element j + half:
zeros past a row's own blocks fold away exactly (x + 0 = x), so a row gets the bits it would
get with only its own blocks, however many its batch had.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["tree_sum", "tree_sum_"]


def tree_sum(x: Tensor, dim: int) -> Tensor:
    """Sum over ``dim`` by halving a zero-padded power-of-two length (see the module notes)."""
    n = x.shape[dim]
    width = 1 << (n - 1).bit_length()
    if width != n:
        pad = list(x.shape)
        pad[dim] = width - n
        x = torch.cat([x, x.new_zeros(pad)], dim=dim)
    while width > 1:
        width //= 2
        x = x.narrow(dim, 0, width) + x.narrow(dim, width, width)
    return x.squeeze(dim)


def tree_sum_(x: Tensor, dim: int) -> Tensor:
    """``tree_sum(x, dim)``'s bits, adding in place in ``x`` (which it overwrites): at each
    halving an element whose partner would be padding gets + 0.0, as it does there."""
    n = x.shape[dim]
    width = 1 << (n - 1).bit_length()
    while width > 1:
        width //= 2
        paired = n - width  # elements [0, paired) have a partner at + width
        if paired > 0:
            x.narrow(dim, 0, paired).add_(x.narrow(dim, width, paired))
        if paired < width:
            x.narrow(dim, max(paired, 0), width - max(paired, 0)).add_(0.0)
        n = width
    return x.narrow(dim, 0, 1).squeeze(dim)
