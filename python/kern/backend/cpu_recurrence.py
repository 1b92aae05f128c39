"""The recurrent mixers (Qwen3.5's gated DeltaNet, Kimi's delta attention) on the CPU: the
causal conv1d and the gated delta rule, batched across the sequences of a step, with states
in slots.

Design notes
------------
* Same maths and op order as ``kern.kernels.causal_conv1d.reference`` and
  ``kern.kernels.gated_delta_rule.reference.gated_delta_rule_recurrent`` (tests compare the
  bits; ``l2norm`` is the reference's own), but one set of ops per step for all sequences
  instead of a Python loop per sequence: a decode step of 32 sequences is ~10 ops per layer,
  not ~300.
* The delta rule runs token by token everywhere on the CPU, prefill included. The chunked
  form (the reference's ``gated_delta_rule``, transformers' prefill) rounds differently for
  each way a prompt is split into chunks and differs from the decode step, so a state written
  by a chunked prefill, by a split prefill and by decoding would all differ in their last
  bits; with one form a state's bits depend only on its tokens (a next turn reads a state
  that decoding wrote, ``kern run`` recomputes it by prefill). The cost is a Python
  loop over the longest chunk's rows (~8 ops per row per linear layer) in prefill.
* Every op is elementwise or a reduction over a fixed-length dim (``sum(-2)`` over the key
  dim), whose bits did not change with the batch size on torch 2.13; the conv sums its K taps
  in a fixed order from the same gathered inputs whatever the chunking.
* Row snapshots: a verify chunk (several rows whose logits are all wanted) may keep only a
  prefix of its rows; the state after each of its rows is copied out so that the runner can
  rewind to any of them without recomputing (``Runner.keep_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kern.kernels.gated_delta_rule.reference import l2norm
from kern.kernels.pointwise import silu


@dataclass(frozen=True, slots=True)
class CpuRecurrentPlan:
    """Index tensors for one forward, shared by every linear-attention layer."""

    slot_ids: Tensor  # [B] int64, batch order
    conv_taps: Tensor  # [T, K] rows of [states; x] that each output row's taps read
    conv_next: Tensor  # [B, K-1] rows of [states; x] that become each sequence's state
    order: Tensor  # [B] batch indices by decreasing row count (active ones are a prefix)
    steps: tuple[tuple[int, Tensor | slice], ...]  # per row index: (#active, their q rows)
    # Row snapshots (verify chunks): per step, (positions in `order`, snapshot rows).
    snap_steps: tuple[tuple[Tensor, Tensor] | None, ...]
    conv_snap: Tensor  # [N, K-1] rows of [states; x] forming the conv state after each row
    num_snapshots: int


def plan_recurrent(
    q_starts: list[int],
    q_lens: list[int],
    slots: list[int],
    snapshot_seqs: list[int],
    conv_width: int,
) -> tuple[CpuRecurrentPlan, dict[int, int]]:
    """Plan a step; returns the plan and, per snapshot sequence, its first snapshot row."""
    num_seqs = len(q_lens)
    taps_before = conv_width - 1
    state_rows = num_seqs * taps_before
    starts = torch.tensor(q_starts)
    lens = torch.tensor(q_lens)
    num_tokens = int(lens.sum())
    seq_of_row = torch.repeat_interleave(torch.arange(num_seqs), lens)
    local = torch.arange(num_tokens) - starts[seq_of_row]

    def ext_rows(seq: Tensor, ext: Tensor) -> Tensor:
        # Row e of a sequence's [its K-1 state columns; its rows] in the stacked [states; x].
        s = seq.unsqueeze(-1) if ext.dim() > seq.dim() else seq
        in_state = ext < taps_before
        return torch.where(
            in_state, s * taps_before + ext, state_rows + starts[s] + ext - taps_before
        )

    conv_taps = ext_rows(seq_of_row, local[:, None] + torch.arange(conv_width)[None, :])
    conv_next = ext_rows(torch.arange(num_seqs), lens[:, None] + torch.arange(taps_before)[None, :])

    order = sorted(range(num_seqs), key=lambda b: -q_lens[b])
    position = {b: i for i, b in enumerate(order)}
    snap_first: dict[int, int] = {}
    n_snap = 0
    snap_conv = []
    for b in snapshot_seqs:
        snap_first[b] = n_snap
        n_snap += q_lens[b]
        bt = torch.full((q_lens[b],), b)
        ext = torch.arange(q_lens[b])[:, None] + 1 + torch.arange(taps_before)[None, :]
        snap_conv.append(ext_rows(bt, ext))
    steps = []
    snap_steps = []
    for i in range(max(q_lens)):
        active = [b for b in order if q_lens[b] > i]
        if len(active) == 1:
            r = q_starts[active[0]] + i
            rows: Tensor | slice = slice(r, r + 1)
        else:
            rows = torch.tensor([q_starts[b] + i for b in active])
        steps.append((len(active), rows))
        here = [b for b in snapshot_seqs if q_lens[b] > i]
        snap_steps.append(
            (
                torch.tensor([position[b] for b in here]),
                torch.tensor([snap_first[b] + i for b in here]),
            )
            if here
            else None
        )
    plan = CpuRecurrentPlan(
        slot_ids=torch.tensor(slots),
        conv_taps=conv_taps,
        conv_next=conv_next,
        order=torch.tensor(order),
        steps=tuple(steps),
        snap_steps=tuple(snap_steps),
        conv_snap=torch.cat(snap_conv)
        if snap_conv
        else torch.empty(0, taps_before, dtype=torch.long),
        num_snapshots=n_snap,
    )
    return plan, snap_first


def causal_conv1d(
    plan: CpuRecurrentPlan,
    x: Tensor,
    weight: Tensor,
    conv_states: Tensor,
    snapshots: Tensor | None = None,
) -> Tensor:
    """silu(causal depthwise conv) of x [T, C] with weight [C, K]; conv_states [S, C, K-1]
    is read at the step's slots and overwritten with each sequence's last K-1 inputs.
    ``snapshots`` ([N, C, K-1]), when given, receives the state after each snapshot row."""
    num_channels = x.shape[1]
    taps = weight.shape[1]
    before = conv_states[plan.slot_ids].transpose(1, 2).reshape(-1, num_channels)
    stacked = torch.cat([before, x])
    acc = stacked[plan.conv_taps[:, 0]] * weight[:, 0]
    for j in range(1, taps):
        acc = acc + stacked[plan.conv_taps[:, j]] * weight[:, j]
    conv_states[plan.slot_ids] = stacked[plan.conv_next].transpose(1, 2)
    if snapshots is not None and plan.num_snapshots:
        snapshots.copy_(stacked[plan.conv_snap].transpose(1, 2))
    return silu(acc)


def gated_delta_rule(
    plan: CpuRecurrentPlan,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    states: Tensor,
    scale: float,
    snapshots: Tensor | None = None,
) -> Tensor:
    """Token-by-token gated delta rule with l2-normalised q, k.

    q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; beta: [T, Hv]; g: [T, Hv] (a decay per head,
    Qwen3.5) or [T, Hv, Dk] (per key channel, Kimi's delta attention: row d of a head's
    state decays by exp(g[d])); states [S, Hv, Dk, Dv] float32 read
    and overwritten at the step's slots. Value head h reads key head h // (Hv // Hk).
    ``snapshots`` ([N, Hv, Dk, Dv]) receives the state after each snapshot row. Returns
    [T, Hv, Dv].
    """
    rep = v.shape[1] // k.shape[1]
    q = l2norm(q) * scale
    k = l2norm(k)
    if rep > 1:
        q = q.repeat_interleave(rep, dim=1)
        k = k.repeat_interleave(rep, dim=1)
    # Per head: [T, Hv, 1, 1]; per channel: [T, Hv, Dk, 1].
    decay = g.exp()[..., None] if g.dim() == 3 else g.exp()[..., None, None]
    slots = plan.slot_ids[plan.order]
    state = states[slots]  # [B, Hv, Dk, Dv], a copy, in `order`
    out = v.new_empty(v.shape)
    for (active, rows), snap in zip(plan.steps, plan.snap_steps, strict=True):
        s = state[:active]
        s.mul_(decay[rows])
        k_t = k[rows][:, :, :, None]
        kv_mem = (s * k_t).sum(dim=-2)
        delta = (v[rows] - kv_mem) * beta[rows][:, :, None]
        s.add_(k_t * delta[:, :, None, :])
        out[rows] = (s * q[rows][:, :, :, None]).sum(dim=-2)
        if snap is not None and snapshots is not None:
            snapshots[snap[1]] = state[snap[0]]
    states[slots] = state
    return out
