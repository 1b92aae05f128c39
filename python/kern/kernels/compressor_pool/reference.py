"""Torch reference for DeepSeek-V4's compressor pooling: a softmax pooling over each
window's tokens, fed one token at a time.

Design notes:
- The accumulator is (max, sum of weights, weighted sum) per dim, in float32. A token
  enters as ``top = max(m, g); (top, s * e^(m - top) + e^(g - top), a * e^(m - top) +
  v * e^(g - top))``: the same update whatever chunk brings the token, so an entry's bits
  do not depend on how the prompt was chunked or where a prefix hit ended.
- Windows are fed in parallel, one offset at a time (every window's k-th row in one op):
  a window's bits depend on its own rows only, not on the other windows or the batch.
"""

import torch
from torch import Tensor


def empty(n: int, dim: int, device=None) -> Tensor:
    """n fresh accumulators [n, 3, dim]: max -inf, sums 0."""
    acc = torch.zeros(n, 3, dim, device=device)
    acc[:, 0] = float("-inf")
    return acc


def update(acc: Tensor, v: Tensor, g: Tensor) -> Tensor:
    """One token (values v, logits g, [n, dim]) into accumulators acc [n, 3, dim]."""
    top = torch.maximum(acc[:, 0], g)
    old = torch.exp(acc[:, 0] - top)
    new = torch.exp(g - top)
    return torch.stack([top, acc[:, 1] * old + new, acc[:, 2] * old + v * new], dim=1)


def check_shapes(values: Tensor, gate: Tensor, starts: Tensor, lens: Tensor, init: Tensor):
    if values.dim() != 2 or gate.shape != values.shape:
        raise ValueError(
            f"values {tuple(values.shape)} and gate {tuple(gate.shape)}: want [R, dim]"
        )
    if starts.dim() != 1 or lens.shape != starts.shape:
        raise ValueError(f"starts {tuple(starts.shape)} and lens {tuple(lens.shape)}: want [G]")
    g = starts.shape[0]
    if init.shape != (g, 3, values.shape[1]):
        raise ValueError(f"init {tuple(init.shape)}: want [{g}, 3, {values.shape[1]}]")


def compressor_pool(
    values: Tensor, gate: Tensor, starts: Tensor, lens: Tensor, init: Tensor
) -> Tensor:
    """Feed windows of rows into softmax poolings; the accumulator after every row.

    values, gate: [R, dim] float32 (a token's values and its pooling logits); window g is
    rows ``starts[g] .. starts[g] + lens[g] - 1`` (disjoint runs, int64 [G]), fed in row
    order from ``init[g]`` [G, 3, dim] float32. Returns hist [R, 3, dim] float32: hist[r]
    is r's window's accumulator after row r. Rows in no window are left zero. A pooled
    value is ``hist[r, 2] / hist[r, 1]``.
    """
    check_shapes(values, gate, starts, lens, init)
    hist = torch.zeros(values.shape[0], 3, values.shape[1], device=values.device)
    if starts.shape[0] == 0:
        return hist
    acc = init.float().clone()
    longest = int(lens.max())
    for k in range(longest):
        g = torch.nonzero(lens > k).flatten()
        rows = starts[g] + k
        acc[g] = update(acc[g], values[rows].float(), gate[rows].float())
        hist[rows] = acc[g]
    return hist
