"""Torch reference for rotary position embedding (neox / rotate_half layout, partial).

Matches transformers' Qwen3 and Qwen3.5 text RoPE: on the first `rotary_dim` dims of each
head, pairs (i, i + rotary_dim/2) rotate by position * inv_freq[i]; dims past `rotary_dim`
pass through. Qwen3.5's mrope sections all carry the same position for text, so its
recomposition is the identity and plain RoPE is exact.
"""

import torch
from torch import Tensor

from ..pointwise import pointwise


def inv_freq(theta: float, rotary_dim: int) -> Tensor:
    """1 / theta^(arange(0, rotary_dim, 2) / rotary_dim), float32, as transformers builds it."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def apply_rotary(
    x: Tensor, positions: Tensor, theta: float, rotary_dim: int, freqs: Tensor | None = None
) -> Tensor:
    """x: [T, H, D], positions: [T] int64 -> rotated copy, same shape and dtype. Pure.
    ``freqs``: ``inv_freq(theta, rotary_dim)`` already on x's device (a caller that keeps it
    there makes no host-to-device copy, which a CUDA graph could not capture).

    cos/sin and the rotation are float32, rounded once to x.dtype. (transformers rounds
    cos/sin to the model dtype first and rotates in it: identical in float32, within one
    rounding in bf16.)
    """
    half = rotary_dim // 2
    if freqs is None:
        freqs = inv_freq(theta, rotary_dim).to(x.device)
    freqs = positions.to(x.device)[:, None].float() * freqs
    # through `pointwise`, so a position's cos/sin bits never depend on T
    cos = pointwise(torch.cos, freqs)[:, None, :]  # [T, 1, half], broadcast over heads
    sin = pointwise(torch.sin, freqs)[:, None, :]
    x32 = x.float()
    x1 = x32[..., :half]
    x2 = x32[..., half:rotary_dim]
    # rotate_half: out = x * cat(cos, cos) + cat(-x2, x1) * cat(sin, sin), split in halves.
    out1 = x1 * cos + (-x2) * sin
    out2 = x2 * cos + x1 * sin
    return torch.cat([out1, out2, x32[..., rotary_dim:]], dim=-1).to(x.dtype)
