"""Torch reference for DeepSeek-V4's lightning indexer: scores of each query row against
its visible compressed keys, and the top k of them.

Design notes:
- A score is ``sum_h w[h] * relu(q_h . key) * scale``: the dot products an elementwise
  product and a sum over D, the heads summed over a contiguous last dim, never a matmul
  whose blocking follows the batch, so a row's scores do not depend on the other rows.
- Top-k ties go to the lower slot, in every path: the selection sorts ``(score, -slot)``
  packed into one int64 key (an order-preserving map of the float32 score above the slot),
  so keys are unique and any top-k algorithm returns the same slots in the same order
  (the Triton path uses ``torch.topk`` on the same keys). Invalid slots score -inf.
- Invalid slots are never read: their row index is replaced by 0 before the gather.
- Rows go in tiles under ``_TILE_ELEMENTS`` products; every op is per row, so a row's bits
  do not depend on its tile.
"""

import torch
from torch import Tensor

# Elements of a tile's largest product ([rows, heads, keys, D]): 16M floats, 64 MB.
_TILE_ELEMENTS = 1 << 24


def check_shapes(q: Tensor, weights: Tensor, keys: Tensor, key_rows: Tensor, valid: Tensor):
    if q.dim() != 3:
        raise ValueError(f"q {tuple(q.shape)}: want [R, H, D]")
    r, h, d = q.shape
    if weights.shape != (r, h):
        raise ValueError(f"weights {tuple(weights.shape)}: want [{r}, {h}]")
    if keys.dim() != 2 or keys.shape[1] != d:
        raise ValueError(f"keys {tuple(keys.shape)}: want [N_total, {d}]")
    if key_rows.dim() != 2 or key_rows.shape[0] != r or valid.shape != key_rows.shape:
        raise ValueError(
            f"key_rows {tuple(key_rows.shape)} and valid {tuple(valid.shape)}: want [{r}, N]"
        )


def pack(score: Tensor) -> Tensor:
    """float32 scores [R, N] -> int64 keys ordered as (score, then the lower slot first)."""
    # + 0.0 turns -0.0 into 0.0: the two compare equal, so they must pack equal.
    bits = (score.float() + 0.0).view(torch.int32).long()
    # Order-preserving: non-negative floats compare as their bits; negative ones reversed.
    ordered = torch.where(bits < 0, -(bits & 0x7FFFFFFF) - 1, bits)  # in [-2^31, 2^31)
    slot = torch.arange(score.shape[1], device=score.device)
    return (ordered << 32) + ((1 << 32) - 1 - slot)


def select(score: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The top ``k`` slots of each row's scores [R, N] (ties: the lower slot), padded to k
    with slot 0 marked not ok -> (slots [R, k] int64, ok [R, k] bool)."""
    rows, n = score.shape
    take = min(k, n)
    slots = torch.topk(pack(score), take, dim=1).indices
    ok = score.gather(1, slots) > float("-inf")
    if take < k:
        slots = torch.cat([slots, slots.new_zeros(rows, k - take)], 1)
        ok = torch.cat([ok, ok.new_zeros(rows, k - take)], 1)
    return slots, ok


def scores(
    q: Tensor, weights: Tensor, keys: Tensor, key_rows: Tensor, valid: Tensor, scale: float
) -> Tensor:
    """[R, N] float32: ``sum_h weights[r, h] * relu(q[r, h] . keys[key_rows[r, n]]) * scale``
    where valid, -inf elsewhere."""
    check_shapes(q, weights, keys, key_rows, valid)
    rows, heads, dim = q.shape
    n = key_rows.shape[1]
    out = torch.full((rows, n), float("-inf"), device=q.device)
    if rows == 0 or n == 0:
        return out
    step = max(1, _TILE_ELEMENTS // (heads * n * dim))
    for a in range(0, rows, step):
        b = min(a + step, rows)
        ok = valid[a:b]
        cand = keys[torch.where(ok, key_rows[a:b], 0)].float()  # [r, N, D]
        cand = torch.where(ok[..., None], cand, 0.0)
        s = (q[a:b].float()[:, :, None, :] * cand[:, None, :, :]).sum(-1)  # [r, H, N]
        s = torch.relu(s) * scale * weights[a:b].float()[:, :, None]
        s = s.transpose(1, 2).contiguous().sum(-1)  # the heads, in order
        out[a:b] = s.masked_fill(~ok, float("-inf"))
    return out


def index_topk(
    q: Tensor,
    weights: Tensor,
    keys: Tensor,
    key_rows: Tensor,
    valid: Tensor,
    k: int,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Each row's ``k`` best visible keys by the indexer's score (see :func:`scores`), ties
    to the lower slot: (slots [R, k] int64 into key_rows' columns, ok [R, k] bool; a slot
    past the row's valid ones is not ok).

    q: [R, H, D] float32 or bf16 (RoPE'd indexer queries); weights: [R, H] float32 (the
    per-head weights, 1 / sqrt(H) applied); keys: [N_total, D], any strides; key_rows: [R, N]
    int64 rows of keys, read only where valid [R, N] bool; scale: 1 / sqrt(D).
    """
    return select(scores(q, weights, keys, key_rows, valid, scale), k)
