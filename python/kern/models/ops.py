"""The one place where the runner's backend is chosen: CPU torch ops or CUDA Triton kernels.

Design notes
------------
* ``make_ops(device)`` returns :class:`CpuOps` (float32, torch) or :class:`CudaOps` (bf16,
  Triton, ``kern.kernels.<op>.<op>``); ``make_ops("cpu", reference=True)`` returns
  :class:`ReferenceOps`, the CUDA wiring over the kernels' torch references, which ``kern
  test`` checks both fast paths against. Models call only ``ops.<name>``; nothing else in
  the runner looks at the device.
* CPU numerics are chosen for batch invariance (DESIGN.md), measured on torch 2.13 / MKL, 2
  threads (see docs/invariance.md):
  - Linears go through oneDNN with the weight reordered once at load
    (``torch.ops.mkldnn._linear_pointwise``, what inductor's frozen CPU graphs call): a row's
    bits were the same for every M from 2 to 8192 at every shape tried (K x N from 64 x 256
    to 2048 x 11008 and 1024 x 151936, 1 and 2 threads, on an AMD EPYC host), and it ran
    1.3-2.3x faster than MKL at M = 32 on AMD EPYC (where MKL takes its AVX2 path). M = 1
    differs (at K = 2048), so one row is padded to 2. MKL's ``x @ w`` is not a safe
    default: on an AMD EPYC host at 2 threads its rows changed for M in 5-7 and 9-11 (it
    splits M across threads), though on the earlier host of FACTS.md they held for
    4 <= M <= 128. It stays only as the fallback for a torch without the oneDNN op: ``w``
    transposed ([in, out]), tiles of at most ``ROW_TILE`` rows, each padded to ``MIN_ROWS``
    (12: no M from 12 to 128 changed a row's bits on either host).
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

import importlib
from dataclasses import dataclass

import torch
from torch import Tensor

from kern.batch import Step
from kern.kernels.rotary import reference as _rotary_ref
from kern.models import attention as _cpu_attn
from kern.models import recurrent as _cpu_rec
from kern.models.pointwise import sigmoid, silu, softplus

# The fallback ``x @ w`` path (see the notes above): tiles of at most ROW_TILE rows (rows
# kept their bits up to 128 on the earlier host, not always past 160), padded to MIN_ROWS.
ROW_TILE = 128
MIN_ROWS = 12
# oneDNN's rows differ between M = 1 and M >= 2, so a single row is padded to this many.
ONEDNN_MIN_ROWS = 2


def _has_onednn_linear() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(
            torch.ops.mkldnn, "_linear_pointwise"
        )
    except (AttributeError, RuntimeError):
        return False


@dataclass(frozen=True, slots=True)
class CpuLinear:
    """A linear's weight as :meth:`CpuOps.linear` runs it: a oneDNN-reordered [out, in]
    weight (``onednn``) or a plain [in, out] one."""

    weight: Tensor
    out_features: int
    onednn: bool


class CpuOps:
    """float32 torch ops on the CPU, arranged so a row's bits do not depend on its batch."""

    device = torch.device("cpu")
    dtype = torch.float32
    is_cpu = True

    def __init__(self) -> None:
        self.onednn = _has_onednn_linear()

    def prepare_linear(self, w: Tensor) -> CpuLinear:
        """A checkpoint's [out, in] weight in the layout :meth:`linear` runs (see the notes)."""
        w = w.to(device=self.device, dtype=self.dtype)
        if self.onednn:
            # The batch-size hint only tunes the blocked layout; bits matched for 1, 32, 1024.
            packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), 32)
            return CpuLinear(packed, w.shape[0], True)
        return CpuLinear(w.t().contiguous(), w.shape[0], False)

    def linear(self, x: Tensor, w: CpuLinear, bias: Tensor | None = None) -> Tensor:
        """x [M, in] through w; a row's bits do not depend on M (see the notes)."""
        m = x.shape[0]
        if m == 0:
            out = x.new_empty(0, w.out_features)
        elif w.onednn:
            out = _pad_rows(x, ONEDNN_MIN_ROWS, lambda a: _onednn(a, w.weight))
        elif m <= ROW_TILE:
            out = _pad_rows(x, MIN_ROWS, lambda a: a @ w.weight)
        else:
            out = x.new_empty(m, w.out_features)
            for i in range(0, m, ROW_TILE):
                j = min(i + ROW_TILE, m)
                if j - i >= MIN_ROWS:
                    torch.mm(x[i:j], w.weight, out=out[i:j])
                else:
                    out[i:j] = _pad_rows(x[i:j], MIN_ROWS, lambda a: a @ w.weight)
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


def _onednn(x: Tensor, packed: Tensor) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")


def _pad_rows(x: Tensor, min_rows: int, fn) -> Tensor:
    """fn(x), run on x zero padded to at least min_rows rows."""
    m = x.shape[0]
    if m >= min_rows:
        return fn(x)
    padded = x.new_zeros(min_rows, x.shape[1])
    padded[:m] = x
    return fn(padded)[:m]


class CudaOps:
    """bf16 Triton kernels (``kern.kernels.<op>.<op>``) and cuBLAS matmuls on a CUDA device."""

    dtype = torch.bfloat16
    is_cpu = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._attn = self._kernel("paged_attention")
        self._norm = self._kernel("rms_norm")
        self._rotary = self._kernel("rotary")
        self._act = self._kernel("silu_and_mul")
        self._conv = self._kernel("causal_conv1d")
        self._gdr = self._kernel("gated_delta_rule")

    def _kernel(self, op: str):
        """The Triton wrapper of ``kern.kernels.<op>``; ReferenceOps takes the torch reference
        (same signatures, so the wiring below serves both). Imported here: triton is only
        needed (and only importable) where there is a GPU."""
        return importlib.import_module(f"kern.kernels.{op}.{op}")

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
        return self._conv.causal_conv1d(
            x.contiguous(),
            weight,
            None,
            conv_states,
            p.slot_ids,
            p.query_start_loc,
            activation="silu",
        )

    def gated_delta_rule(self, step: Step, q, k, v, g, beta, states, scale, snapshots=None):
        p = step.recurrent
        rep = v.shape[1] // k.shape[1]
        # The kernels take value heads for q and k too (see their README), contiguous.
        q, k = (t.repeat_interleave(rep, dim=1) if rep > 1 else t.contiguous() for t in (q, k))
        v = v.contiguous()
        if p.snapshot_seqs and snapshots is not None:
            return self._delta_rule_rows(step, q, k, v, g, beta, states, scale, snapshots)
        gdr = self._gdr
        fn = gdr.gated_delta_rule_recurrent if p.decode_only else gdr.gated_delta_rule
        return fn(q, k, v, g, beta, states, p.slot_ids, p.query_start_loc, scale=scale)

    def _delta_rule_rows(self, step, q, k, v, g, beta, states, scale, snapshots):
        """A step with verify chunks: one recurrent call per row index, so the state after
        every row of a verify chunk can be copied out."""
        gdr = self._gdr
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


class ReferenceOps(CudaOps):
    """The torch reference path: the CUDA backend's wiring with every kernel replaced by its
    torch reference (``kern.kernels.<op>.reference``) and ``F.linear``, float32 on the CPU.

    Slow (the references loop over sequences in Python) and makes no invariance promise; it
    is what ``kern test`` checks a target's backend against, since it shares no attention,
    recurrence or matmul code with either fast path.
    """

    dtype = torch.float32

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))

    def _kernel(self, op: str):
        return importlib.import_module(f"kern.kernels.{op}.reference")


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


def make_ops(device: str | torch.device, *, reference: bool = False) -> Ops:
    """The backend for ``device``: ``cpu`` or a CUDA device; ``reference=True`` gives the
    torch reference path (:class:`ReferenceOps`, CPU only)."""
    if reference:
        if torch.device(device).type != "cpu":
            raise ValueError("the torch reference path runs on the CPU only")
        return ReferenceOps()
    device = torch.device(device)
    if device.type == "cpu":
        return CpuOps()
    if device.type == "cuda":
        return CudaOps(device)
    raise ValueError(f"device {device} is not supported (cpu or cuda)")
