"""Torch reference for the depthwise causal conv1d in front of Qwen3.5's gated DeltaNet.

Ragged and slot addressed. A sequence's conv state is the last K-1 inputs before this call
(zeros for a new sequence). transformers keeps K columns, but its decode step
(`causal_conv1d_update`) never reads the oldest one, so K-1 columns give the same outputs.
Each output sums its K taps in a fixed order with elementwise float32 ops (silu through
`pointwise`), so its bits depend only on its own K inputs: one-shot, chunked and decode
calls agree bitwise.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from ..pointwise import pointwise


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_states: Tensor,
    slot_ids: Tensor,
    query_start_loc: Tensor,
    *,
    activation: str | None = "silu",
) -> Tensor:
    """out[t, c] = act(bias[c] + sum_j weight[c, j] * xs[t - (K-1) + j, c]), per sequence.

    x: [T, C]; weight: [C, K] (nn.Conv1d's [C, 1, K] squeezed); bias: [C] or None;
    conv_states: [S, C, K-1], mutated: conv_states[slot_ids[b]] is read as the inputs
    before sequence b's rows (xs at negative t) and overwritten with the last K-1 inputs
    after them (a sequence with no rows leaves its slot untouched); slot_ids: [B] int64;
    query_start_loc: [B+1]. activation: "silu" or None. Float32, returns x.dtype.
    """
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    width = weight.shape[1]
    w = weight.float()
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    starts = query_start_loc.tolist()
    for b, slot in enumerate(slot_ids.tolist()):
        s, e = starts[b], starts[b + 1]
        n = e - s
        if n == 0:
            continue
        # [K-1 + n, C]: the previous inputs, then this call's
        ext = torch.cat([conv_states[slot].float().transpose(0, 1), x[s:e].float()], dim=0)
        acc = torch.zeros(n, x.shape[1], device=x.device)
        if bias is not None:
            acc = acc + bias.float()
        for j in range(width):
            acc = acc + w[:, j] * ext[j : j + n]
        out[s:e] = pointwise(F.silu, acc) if activation == "silu" else acc
        conv_states[slot] = ext[n:].transpose(0, 1).to(conv_states.dtype)
    return out.to(x.dtype)
