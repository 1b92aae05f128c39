"""The one place where the runner's backend is chosen: CPU torch ops or CUDA Triton kernels.

Design notes
------------
* ``make_ops(device)`` returns :class:`CpuOps` (float32, torch) or :class:`CudaOps` (bf16,
  Triton, ``kern.kernels.<op>.<op>``). Models call only ``ops.<name>``; nothing else in the
  runner looks at the device.
* CPU numerics are chosen for batch invariance (DESIGN.md), measured on torch 2.13 / MKL, 2
  threads (see docs/invariance.md):
  - ``x @ w`` with ``w`` stored transposed ([in, out], contiguous) gives each row bits that do
    not depend on the row count for 2 <= M <= 128 at every shape tried (K x N up to
    2048 x 11008, 1024 x 151936); ``F.linear`` on the [out, in] weight does not (its rows
    changed between M = 13 and M = 16 at 512 x 2048), and neither path is stable past ~160
    rows at 1024 x 3072. So weights are transposed once at load, and every matmul runs in
    tiles of at most ``ROW_TILE`` rows, each padded to at least ``MIN_ROWS``.
  - ``torch.sigmoid``, ``F.silu`` and ``F.softplus`` give different bits in their scalar
    tail loop than in their vectorized body (278 of 7000 sigmoid values differed by 1 ulp),
    and which elements land in the tail depends on the tensor's size, i.e. on the batch.
    ``exp``, ``log1p``, ``rsqrt`` and the IEEE ops agree in both paths, so sigmoid, silu and
    softplus are composed from those here.
  - Row reductions (``mean(-1)``, ``sum(-1)`` over a fixed length) did not change with the
    row count, so RMSNorm and RoPE are the references' ops in the references' order (bit
    for bit), with the norm's ``offset + w`` folded once at load and RoPE's cos/sin tables
    built once per step instead of in every layer.
  - Attention and the recurrent mixers are batched CPU implementations of the references
    (``attention.py``, ``recurrent.py``): the references loop over sequences in Python.
* The CUDA path is written to the kernels' documented signatures; no GPU has run it, but
  ``tests/test_runner.py`` runs it with the Triton interpreter on CPU tensors (float32)
  against the CPU backend. It makes no invariance promise beyond what the kernels document.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kern.batch import Step
from kern.kernels.rotary import reference as _rotary_ref
from kern.models import attention as _cpu_attn
from kern.models import recurrent as _cpu_rec
from kern.models.pointwise import sigmoid, silu, softplus

# Rows per matmul tile on the CPU: rows kept their bits for every M in [2, 128] at every
# shape measured, not always past 160 (see the notes above).
ROW_TILE = 128
# Fewer rows than this take a different MKL kernel (M = 1 differs from M >= 2 everywhere;
# FACTS.md measured M = 2, 3 differing for F.linear), so short tiles are zero padded.
MIN_ROWS = 4


class CpuOps:
    """float32 torch ops on the CPU, arranged so a row's bits do not depend on its batch."""

    device = torch.device("cpu")
    dtype = torch.float32
    is_cpu = True

    def prepare_linear(self, w: Tensor) -> Tensor:
        """A checkpoint's [out, in] weight in the layout :meth:`linear` wants ([in, out])."""
        return w.to(device=self.device, dtype=self.dtype).t().contiguous()

    def linear(self, x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
        """x [M, in] @ w [in, out] in row tiles of at most ROW_TILE, each >= MIN_ROWS rows."""
        m = x.shape[0]
        if m == 0:
            return x.new_empty(0, w.shape[1])
        if m <= ROW_TILE:
            out = _mm_padded(x, w)
        else:
            out = x.new_empty(m, w.shape[1])
            for i in range(0, m, ROW_TILE):
                j = min(i + ROW_TILE, m)
                if j - i >= MIN_ROWS:
                    torch.mm(x[i:j], w, out=out[i:j])
                else:
                    out[i:j] = _mm_padded(x[i:j], w)
        if bias is not None:
            out += bias
        return out

    def prepare_norm(self, w: Tensor, offset: float = 0.0) -> Tensor:
        """An RMSNorm weight with its offset folded in: ``offset + w``, the very tensor the
        reference multiplies by, computed once instead of per call."""
        return offset + w.to(device=self.device, dtype=self.dtype)

    def rms_norm(self, x: Tensor, w: Tensor, eps: float) -> Tensor:
        """The reference's ``rms_norm`` (same ops, same order) with ``w`` from
        :meth:`prepare_norm`; ``w`` may be [D] or broadcast over heads ([H, D])."""
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * variance.add_(eps).rsqrt_() * w

    def gated_rms_norm(self, x: Tensor, z: Tensor, w: Tensor, eps: float) -> Tensor:
        # The reference's op order, with a batch-invariant silu.
        variance = x.pow(2).mean(-1, keepdim=True)
        return (w * (x * variance.add_(eps).rsqrt_())) * silu(z)

    def plan_rope(self, positions: Tensor, theta: float, rotary_dim: int):
        """cos and sin [T, 1, rotary_dim / 2] for the step, shared by every layer: the
        reference's tables, built once per step instead of twice per layer."""
        freqs = positions[:, None].float() * _rotary_ref.inv_freq(theta, rotary_dim)
        return freqs.cos()[:, None, :], freqs.sin()[:, None, :]

    def rotary(self, x: Tensor, rope, rotary_dim: int) -> Tensor:
        """The reference's ``apply_rotary`` on x [T, H, D] with the step's tables. Its
        ``x1 * cos + (-x2) * sin`` is ``x1 * cos - x2 * sin`` bit for bit (negation is exact)."""
        cos, sin = rope
        half = rotary_dim // 2
        x1 = x[..., :half]
        x2 = x[..., half:rotary_dim]
        parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        if rotary_dim < x.shape[-1]:
            parts.append(x[..., rotary_dim:])
        return torch.cat(parts, dim=-1)

    def silu_and_mul(self, x: Tensor) -> Tensor:
        """silu(gate) * up as ``pointwise.silu`` computes it, in one new buffer."""
        inter = x.shape[-1] // 2
        gate = x[:, :inter]
        out = torch.neg(gate).exp_().add_(1.0)
        torch.div(gate, out, out=out)
        return out.mul_(x[:, inter:])

    sigmoid = staticmethod(sigmoid)
    silu = staticmethod(silu)
    softplus = staticmethod(softplus)

    def write_kv(self, step: Step, k: Tensor, v: Tensor, kv_cache: Tensor) -> None:
        """k, v [T, Hk, D] into a layer's cache [P, 2, page_tokens, Hk, D] (the reference's
        write, as row copies planned once per step)."""
        _cpu_attn.write_kv(step.attention, k, v, kv_cache)

    def plan_attention(self, step: Step, kv_arena: Tensor, group: int):
        """kv_arena: the runner's [P, layers, 2, Hk, page_tokens, D] arena."""
        _, _, _, hk, page_tokens, head_dim = kv_arena.shape
        return _cpu_attn.plan_attention(
            step.q_starts,
            step.q_lens,
            step.ctx_lens,
            step.block_tables,
            page_tokens,
            hk,
            group,
            head_dim,
            kv_arena.stride(0),
            step.page_ids,
            step.page_offsets,
        )

    def kv_views(self, kv_cache: Tensor) -> tuple[Tensor, Tensor]:
        """A layer's K and V as [P, page_tokens, Hk, D] views (how this backend lays them
        out inside a page is its own business)."""
        return _cpu_attn.kv_views(kv_cache)

    def attention(self, step: Step, q: Tensor, kv_cache: Tensor, scale: float) -> Tensor:
        return _cpu_attn.attend(step.attention, q, kv_cache, scale)

    def plan_recurrent(
        self, step: Step, slots: list[int], snapshot_seqs: list[int], conv_width: int
    ):
        """The plan and, per snapshot sequence (batch index), its first snapshot row."""
        return _cpu_rec.plan_recurrent(step.q_starts, step.q_lens, slots, snapshot_seqs, conv_width)

    def causal_conv1d(self, step: Step, x, weight, conv_states, snapshots=None) -> Tensor:
        return _cpu_rec.causal_conv1d(step.recurrent, x, weight, conv_states, snapshots)

    def gated_delta_rule(self, step: Step, q, k, v, g, beta, states, scale, snapshots=None):
        return _cpu_rec.gated_delta_rule(step.recurrent, q, k, v, g, beta, states, scale, snapshots)


def _mm_padded(x: Tensor, w: Tensor) -> Tensor:
    m = x.shape[0]
    if m >= MIN_ROWS:
        return x @ w
    padded = x.new_zeros(MIN_ROWS, x.shape[1])
    padded[:m] = x
    return (padded @ w)[:m]


class CudaOps:
    """bf16 Triton kernels (``kern.kernels.<op>.<op>``) and cuBLAS matmuls on a CUDA device."""

    dtype = torch.bfloat16
    is_cpu = False

    def __init__(self, device: torch.device) -> None:
        # Imported here: triton is only needed (and only importable) where there is a GPU.
        from kern.kernels.paged_attention import paged_attention as attn
        from kern.kernels.rms_norm import rms_norm as norm
        from kern.kernels.rotary import rotary
        from kern.kernels.silu_and_mul import silu_and_mul as act

        self.device = device
        self._attn, self._norm, self._rotary, self._act = attn, norm, rotary, act

    def prepare_linear(self, w: Tensor) -> Tensor:
        return w.to(device=self.device, dtype=self.dtype).contiguous()

    def linear(self, x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
        return torch.nn.functional.linear(x, w, bias)

    def prepare_norm(self, w: Tensor, offset: float = 0.0):
        # The kernel takes the stored weight and the offset; a [H, D] stacked weight (fused
        # q/k norms) is not a kernel shape, so it is kept as rows and applied per head group.
        weight = w.to(device=self.device, dtype=self.dtype).contiguous()
        runs = _runs(w) if w.dim() == 2 else None
        return (weight, offset, runs)

    def rms_norm(self, x: Tensor, w, eps: float) -> Tensor:
        weight, offset, runs = w
        if runs is None:
            return self._norm.rms_norm(x, weight, eps, offset=offset)
        # [T, H, D] with a per-head weight [H, D]: heads sharing a weight run together.
        out = torch.empty_like(x)
        for lo, hi in runs:
            part = x[:, lo:hi].contiguous()
            out[:, lo:hi] = self._norm.rms_norm(part, weight[lo], eps, offset=offset)
        return out

    def gated_rms_norm(self, x: Tensor, z: Tensor, w: Tensor, eps: float) -> Tensor:
        return self._norm.gated_rms_norm(x, z, w, eps)

    def plan_rope(self, positions: Tensor, theta: float, rotary_dim: int):
        return (positions, theta)

    def rotary(self, x: Tensor, rope, rotary_dim: int) -> Tensor:
        positions, theta = rope
        return self._rotary.apply_rotary(x, positions, theta, rotary_dim)

    def silu_and_mul(self, x: Tensor) -> Tensor:
        return self._act.silu_and_mul(x)

    sigmoid = staticmethod(torch.sigmoid)
    silu = staticmethod(torch.nn.functional.silu)
    softplus = staticmethod(torch.nn.functional.softplus)

    def kv_views(self, kv_cache: Tensor) -> tuple[Tensor, Tensor]:
        # [P, 2, Hk, page_tokens, D] -> K, V as [P, page_tokens, Hk, D] strided views, the
        # kernels' layout (any strides, head_dim contiguous).
        return kv_cache[:, 0].transpose(1, 2), kv_cache[:, 1].transpose(1, 2)

    def write_kv(self, step: Step, k: Tensor, v: Tensor, kv_cache: Tensor) -> None:
        k_cache, v_cache = self.kv_views(kv_cache)
        self._attn.write_kv(k, v, k_cache, v_cache, step.slot_mapping)

    def plan_attention(self, step: Step, kv_arena: Tensor, group: int):
        dev = self.device
        return _CudaAttentionPlan(
            block_tables=step.block_tables.to(device=dev, dtype=torch.int32),
            seq_lens=torch.tensor(step.ctx_lens, dtype=torch.int32, device=dev),
            query_start_loc=_query_start_loc(step, dev),
        )

    def attention(self, step: Step, q: Tensor, kv_cache: Tensor, scale: float) -> Tensor:
        p = step.attention
        k_cache, v_cache = self.kv_views(kv_cache)
        return self._attn.paged_attention(
            q, k_cache, v_cache, p.block_tables, p.seq_lens, p.query_start_loc, scale
        )

    def plan_recurrent(
        self, step: Step, slots: list[int], snapshot_seqs: list[int], conv_width: int
    ):
        dev = self.device
        first, n = {}, 0
        for b in snapshot_seqs:
            first[b] = n
            n += step.q_lens[b]
        plan = _CudaRecurrentPlan(
            slot_ids=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=_query_start_loc(step, dev),
            decode_only=max(step.q_lens) == 1,
            snapshot_seqs=tuple(snapshot_seqs),
            snapshot_first=first,
        )
        return plan, first

    def causal_conv1d(self, step: Step, x, weight, conv_states, snapshots=None) -> Tensor:
        from kern.kernels.causal_conv1d import causal_conv1d as conv

        p = step.recurrent
        if p.snapshot_seqs and snapshots is not None:
            # The state after each row of a verify chunk is the K-1 inputs ending there:
            # taken from the inputs before the call and the chunk's own rows.
            before = conv_states[p.slot_ids].clone()
            for b in p.snapshot_seqs:
                s, n = step.q_starts[b], step.q_lens[b]
                ext = torch.cat([before[b], x[s : s + n].t()], dim=1)  # [C, K-1 + n]
                taps = before.shape[2]
                for i in range(n):
                    snapshots[p.snapshot_first[b] + i] = ext[:, i + 1 : i + 1 + taps]
        return conv.causal_conv1d(
            x.contiguous(),
            weight,
            None,
            conv_states,
            p.slot_ids,
            p.query_start_loc,
            activation="silu",
        )

    def gated_delta_rule(self, step: Step, q, k, v, g, beta, states, scale, snapshots=None):
        from kern.kernels.gated_delta_rule import gated_delta_rule as gdr

        p = step.recurrent
        rep = v.shape[1] // k.shape[1]
        # The kernels take value heads for q and k too (see their README), contiguous.
        q, k = (t.repeat_interleave(rep, dim=1) if rep > 1 else t.contiguous() for t in (q, k))
        v = v.contiguous()
        if p.snapshot_seqs and snapshots is not None:
            return self._delta_rule_rows(step, q, k, v, g, beta, states, scale, snapshots)
        fn = gdr.gated_delta_rule_recurrent if p.decode_only else gdr.gated_delta_rule
        return fn(q, k, v, g, beta, states, p.slot_ids, p.query_start_loc, scale=scale)

    def _delta_rule_rows(self, step, q, k, v, g, beta, states, scale, snapshots):
        """A step with verify chunks: one recurrent call per row index, so the state after
        every row of a verify chunk can be copied out."""
        from kern.kernels.gated_delta_rule import gated_delta_rule as gdr

        p = step.recurrent
        out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
        for i in range(max(step.q_lens)):
            seqs = [b for b, n in enumerate(step.q_lens) if n > i]
            rows = torch.tensor([step.q_starts[b] + i for b in seqs], device=v.device)
            slots = p.slot_ids[torch.tensor(seqs, device=v.device)]
            qsl = torch.arange(len(seqs) + 1, dtype=torch.int32, device=v.device)
            out[rows] = gdr.gated_delta_rule_recurrent(
                q[rows], k[rows], v[rows], g[rows], beta[rows], states, slots, qsl, scale=scale
            )
            for b in p.snapshot_seqs:
                if step.q_lens[b] > i:
                    snapshots[p.snapshot_first[b] + i] = states[p.slot_ids[b]]
        return out


@dataclass(frozen=True, slots=True)
class _CudaAttentionPlan:
    block_tables: Tensor
    seq_lens: Tensor
    query_start_loc: Tensor


@dataclass(frozen=True, slots=True)
class _CudaRecurrentPlan:
    slot_ids: Tensor
    query_start_loc: Tensor
    decode_only: bool
    snapshot_seqs: tuple[int, ...]
    snapshot_first: dict[int, int]


def _runs(weight: Tensor) -> list[tuple[int, int]]:
    """Maximal ranges of equal rows of a per-head weight [H, D]."""
    runs, lo = [], 0
    for h in range(1, weight.shape[0] + 1):
        if h == weight.shape[0] or not torch.equal(weight[h], weight[lo]):
            runs.append((lo, h))
            lo = h
    return runs


def _query_start_loc(step: Step, device: torch.device) -> Tensor:
    return torch.tensor(
        step.q_starts + [step.q_starts[-1] + step.q_lens[-1]], dtype=torch.int32, device=device
    )


Ops = CpuOps | CudaOps


def make_ops(device: str | torch.device) -> Ops:
    """The backend for ``device``: ``cpu`` or a CUDA device."""
    device = torch.device(device)
    if device.type == "cpu":
        return CpuOps()
    if device.type == "cuda":
        return CudaOps(device)
    raise ValueError(f"device {device} is not supported (cpu or cuda)")
