"""Torch reference for DeepSeek-V4's shared-KV attention with per-head sinks over gathered
entries (the window's entries, then the compressed or selected ones).

Design notes (the numerics of ``kern.models.deepseek_v4.attention.attend``, reimplemented
here because kernels do not import upward):
- Dot products are an elementwise product and a sum over D, never a matmul whose blocking
  follows the batch, so a row's scores do not depend on the other rows.
- Sums over keys are ``_tree_sum`` over a zero-padded power-of-two length: invalid keys and
  padding add exact zeros (p = 0), so a row's bits do not depend on J (the batch's widest
  row) or on where invalid keys sit. The softmax max is exact in any order.
- Invalid keys are never read: their row index is replaced by 0 before the gather (it may
  be anything, -1 included) and the gathered value zeroed, so no 0 * NaN leaks in.
- Rows go in tiles under ``_TILE_ELEMENTS`` products; every op is per row, so a row's bits
  do not depend on its tile.
"""

import torch
from torch import Tensor

# Elements of a tile's largest product ([rows, heads, keys, D]): 16M floats, 64 MB.
_TILE_ELEMENTS = 1 << 24


def sparse_attention(
    q: Tensor, keys: Tensor, key_rows: Tensor, valid: Tensor, sinks: Tensor, scale: float
) -> Tensor:
    """For each row r and head h, softmax attention of q[r, h] over the entries
    ``keys[key_rows[r, j]]`` with ``valid[r, j]``, K = V, one sink logit per head in the
    denominator:

        s_j = scale * q[r, h] . keys[key_rows[r, j]]      (valid j only)
        top = max(max_j s_j, sinks[h])
        o[r, h] = sum_j exp(s_j - top) keys[key_rows[r, j]]
                  / (sum_j exp(s_j - top) + exp(sinks[h] - top))

    q: [R, H, D] (float32 or bf16); keys: [N_total, D] (any strides); key_rows: [R, J]
    int64 (or int32) rows of ``keys``, read only where valid; valid: [R, J] bool; sinks: [H];
    scale: float. Returns [R, H, D] in q's dtype, computed in float32. A row with no valid
    key gets zeros.
    """
    check_shapes(q, keys, key_rows, valid, sinks)
    rows, heads, dim = q.shape
    num_keys = key_rows.shape[1]
    if num_keys == 0:
        return torch.zeros_like(q)
    out = torch.empty_like(q)
    if keys.shape[0] == 0:  # every key is invalid: gather from a zero row instead
        keys = keys.new_zeros(1, dim)
    sinks = sinks.float()[None, :]
    idx = key_rows.long().masked_fill(~valid, 0)
    for a, b in _tiles(rows, heads * num_keys * dim):
        ok = valid[a:b]
        k = keys[idx[a:b]].float()  # [r, J, D]
        k = torch.where(ok[..., None], k, 0.0)
        s = (q[a:b].float()[:, :, None, :] * k[:, None, :, :]).sum(-1) * scale  # [r, H, J]
        s = s.masked_fill(~ok[:, None, :], float("-inf"))
        top = torch.maximum(s.amax(-1), sinks)  # [r, H]
        e = torch.exp(s - top[..., None])
        denom = _tree_sum(e, 2) + torch.exp(sinks - top)
        o = _tree_sum(e[..., None] * k[:, None, :, :], 2) / denom[..., None]
        out[a:b] = o.to(q.dtype)
    return out


def check_shapes(q: Tensor, keys: Tensor, key_rows: Tensor, valid: Tensor, sinks: Tensor) -> None:
    """Raise ValueError naming the argument whose shape or dtype does not fit."""
    if q.dim() != 3:
        raise ValueError(f"q must be [R, H, D], got shape {tuple(q.shape)}")
    rows, heads, dim = q.shape
    if keys.dim() != 2 or keys.shape[1] != dim:
        raise ValueError(f"keys must be [N_total, D = {dim}], got shape {tuple(keys.shape)}")
    if key_rows.dim() != 2 or key_rows.shape[0] != rows:
        raise ValueError(f"key_rows must be [R = {rows}, J], got shape {tuple(key_rows.shape)}")
    if key_rows.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"key_rows must be int64 or int32, got {key_rows.dtype}")
    if valid.shape != key_rows.shape:
        raise ValueError(
            f"valid must have key_rows' shape {tuple(key_rows.shape)}, got {tuple(valid.shape)}"
        )
    if valid.dtype != torch.bool:
        raise ValueError(f"valid must be bool, got {valid.dtype}")
    if sinks.shape != (heads,):
        raise ValueError(f"sinks must be [H = {heads}], got shape {tuple(sinks.shape)}")


def _tree_sum(x: Tensor, dim: int) -> Tensor:
    """Sum over ``dim`` by halving a zero-padded power-of-two length (see design notes)."""
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


def _tiles(rows: int, per_row: int) -> list[tuple[int, int]]:
    """Row ranges whose products stay under ``_TILE_ELEMENTS``."""
    step = max(1, _TILE_ELEMENTS // max(1, per_row))
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]
