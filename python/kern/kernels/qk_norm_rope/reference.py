"""Torch reference for the q/k heads' RMSNorm followed by RoPE, in one call: exactly
`rms_norm.reference.rms_norm` with a weight per head, its output (in x.dtype), then
`rotary.reference.apply_rotary` on it."""

from torch import Tensor

from ..paged_attention.reference import write_kv
from ..rms_norm.reference import rms_norm
from ..rotary.reference import apply_rotary


def qk_norm_rope(
    x: Tensor,
    weight: Tensor,
    eps: float,
    offset: float,
    positions: Tensor,
    theta: float,
    rotary_dim: int,
    freqs: Tensor | None = None,
    *,
    kv: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
) -> Tensor:
    """x: [T, H, D] (q heads then k heads), weight: [H, D] (each head's norm weight),
    positions: [T] -> [T, H, D] in x.dtype: each head RMS-normalised with its row of
    ``weight`` (times ``offset + w``), rounded to x.dtype, then its first ``rotary_dim``
    dims rotated (neox halves) by position * inv_freq (``freqs``, or theta's). Pure, but
    with ``kv`` = (v [T, Hk, D], k_cache, v_cache, slot_mapping): the last Hk heads of the
    result (the keys) and v are also written to the caches, as ``paged_attention.write_kv``
    writes them."""
    normed = rms_norm(x, weight, eps, offset=offset)
    out = apply_rotary(normed, positions, theta, rotary_dim, freqs)
    if kv is not None:
        v, k_cache, v_cache, slot_mapping = kv
        write_kv(out[:, out.shape[1] - v.shape[1] :], v, k_cache, v_cache, slot_mapping)
    return out
