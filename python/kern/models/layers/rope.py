"""RoPE frequencies of a model: plain, or YaRN-scaled as DeepSeek-V3's configs ask.

Matches transformers 5.23 (``_compute_yarn_parameters``): YaRN blends interpolated
(``1 / (factor * base^(2i/d))``) and extrapolated frequencies with a linear ramp between the
correction dims of ``beta_fast`` and ``beta_slow`` rotations, and scales cos and sin by an
attention factor (given, or mscale(factor, mscale) / mscale(factor, mscale_all_dim)). The
softmax scale's own mscale is ``kern.models.layers.mla.softmax_scale``'s.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kern.models.config import ModelConfig, yarn_mscale

__all__ = ["rope_frequencies", "scaled_frequencies"]


def rope_frequencies(c: ModelConfig) -> tuple[Tensor | None, float]:
    """(inv_freq [rotary_dim / 2] float32, cos/sin scale) for ``c``'s RoPE; (None, 1.0) for
    plain RoPE, which the backends build from ``rope_theta`` themselves."""
    return scaled_frequencies(c.rope_theta, c.rotary_dim, c.rope_type, c.rope_yarn)


def scaled_frequencies(
    base: float, dim: int, rope_type: str, yarn: tuple[float, ...]
) -> tuple[Tensor | None, float]:
    """:func:`rope_frequencies` of one RoPE set: ``base`` (theta) over ``dim`` rotary dims,
    scaled as ``rope_type`` and ``yarn`` (``kern.models.config.yarn``'s tuple) say."""
    if rope_type != "yarn":
        return None, 1.0
    factor, original, beta_fast, beta_slow, mscale, mscale_all_dim, attn_factor, trunc = yarn
    if not attn_factor:
        if mscale and mscale_all_dim:
            attn_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attn_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if trunc:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attn_factor)
