"""The CUDA backend: bf16 Triton kernels (``kern.kernels.<op>.<op>``), matmuls included.

Design notes
------------
* Written to the kernels' documented signatures; ``tests/test_runner.py`` runs it with the
  Triton interpreter on CPU tensors (float32) against the CPU backend, and
  ``tools/gpu/check.sh`` on a GPU (first run on an H200: docs/performance.md). It makes
  no invariance promise beyond what the kernels document.
* Linears go through ``kern.kernels.matmul`` (tile fixed by the weight's shape), not cuBLAS,
  whose kernel and split-K depend on the row count: a row's bits must not depend on its
  batch (the identity promise).
* Decode steps can be captured as CUDA graphs (kern.engine.cuda_graphs): their attention
  plan (:meth:`CudaOps.plan_decode_attention`) reads static buffers, and nothing in a
  dense layer reads a device value back to the host.
* Each kernel module is looked up by :meth:`CudaOps._kernel`, so the same wiring serves the
  torch reference path (:class:`kern.backend.reference.ReferenceOps`), whose kernels have
  the same signatures.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch
from torch import Tensor

from kern.batch import Step
from kern.kernels.rotary import reference as _rotary_ref


class CudaOps:
    """bf16 Triton kernels (``kern.kernels.<op>.<op>``) on a CUDA device."""

    dtype = torch.bfloat16
    is_cpu = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._attn = self._kernel("paged_attention")
        self._sparse = self._kernel("sparse_attention")
        self._norm = self._kernel("rms_norm")
        self._rotary = self._kernel("rotary")
        self._qk_norm_rope = self._kernel("qk_norm_rope")
        self._act = self._kernel("silu_and_mul")
        self._conv = self._kernel("causal_conv1d")
        self._gdr = self._kernel("gated_delta_rule")
        self._matmul = self._kernel("matmul")
        self._mla = self._kernel("mla_attention")
        self._pool = self._kernel("compressor_pool")
        self._topk = self._kernel("index_topk")
        # (theta, rotary_dim, id of a model's own table) -> (that table, its device copy)
        self._freqs: dict[tuple, tuple[Tensor | None, Tensor]] = {}

    def _kernel(self, op: str):
        """The Triton wrapper of ``kern.kernels.<op>``; ReferenceOps takes the torch reference
        (same signatures, so the wiring below serves both). Imported here: triton is only
        needed (and only importable) where there is a GPU."""
        return importlib.import_module(f"kern.kernels.{op}.{op}")

    def prepare_linear(self, w: Tensor) -> Tensor:
        return w.to(device=self.device, dtype=self.dtype).contiguous()

    def linear(self, x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
        return self._matmul.linear(x, w, bias)

    def linear_silu_and_mul(self, x: Tensor, w: Tensor) -> Tensor:
        """silu_and_mul(linear(x, w)) for a gate-then-up weight, in one launch (the bits of
        the two: ``kern.kernels.matmul``)."""
        return self._matmul.linear_silu_and_mul(x, w)

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

    def add_rms_norm(self, x: Tensor, h: Tensor, w, eps: float) -> tuple[Tensor, Tensor]:
        """(x + h, its rms_norm) in one kernel (``rms_norm.add_rms_norm``)."""
        weight, offset, runs = w
        if runs is not None:
            total = x + h
            return total, self.rms_norm(total, w, eps)
        return self._norm.add_rms_norm(x, h, weight, eps, offset=offset)

    def gated_rms_norm(
        self, x: Tensor, z: Tensor, w: Tensor, eps: float, gate: str = "silu"
    ) -> Tensor:
        return self._norm.gated_rms_norm(x, z, w, eps, gate=gate)

    def plan_rope(
        self,
        positions: Tensor,
        theta: float,
        rotary_dim: int,
        inv_freq: Tensor | None = None,
        scaling: float = 1.0,
    ):
        if inv_freq is None and scaling == 1.0:
            return _Rope(positions, theta, self._device_freqs(theta, rotary_dim, None))
        # YaRN (deepseek_v3): its own frequencies and scaled tables, which the rotary kernel
        # does not take; built once per step in float32 and applied by torch ops.
        freqs = self._device_freqs(theta, rotary_dim, inv_freq)
        angles = positions.to(self.device)[:, None].float() * freqs
        return _ScaledRope(angles.cos()[:, None, :] * scaling, angles.sin()[:, None, :] * scaling)

    def _device_freqs(self, theta: float, rotary_dim: int, inv_freq: Tensor | None) -> Tensor:
        """The frequencies on the device, copied there once per (theta, dims, table): a copy
        per step (or per layer) is a host sync a CUDA graph cannot capture."""
        key = (theta, rotary_dim, None if inv_freq is None else id(inv_freq))
        kept = self._freqs.get(key)
        if kept is None or (inv_freq is not None and kept[0] is not inv_freq):
            host = inv_freq if inv_freq is not None else _rotary_ref.inv_freq(theta, rotary_dim)
            kept = (inv_freq, host.to(device=self.device, dtype=torch.float32))
            self._freqs[key] = kept
        return kept[1]

    def rotary(self, x: Tensor, rope, rotary_dim: int) -> Tensor:
        if isinstance(rope, _ScaledRope):
            half = rotary_dim // 2
            x32 = x.float()
            x1, x2 = x32[..., :half], x32[..., half:rotary_dim]
            parts = [
                x1 * rope.cos - x2 * rope.sin,
                x2 * rope.cos + x1 * rope.sin,
                x32[..., rotary_dim:],
            ]
            return torch.cat(parts, dim=-1).to(x.dtype)
        return self._rotary.apply_rotary(
            x, rope.positions, rope.theta, rotary_dim, freqs=rope.freqs
        )

    def qk_norm_rope(self, qk: Tensor, w, eps: float, rope, rotary_dim: int) -> Tensor:
        """The attention layers' per-head q/k norm (``w`` from :meth:`prepare_norm`, a row per
        head) and RoPE in one kernel (``kern.kernels.qk_norm_rope``: the same bits as the
        two in sequence); YaRN's tables go the two-op way."""
        if isinstance(rope, _ScaledRope) or w[2] is None:
            return self.rotary(self.rms_norm(qk, w, eps), rope, rotary_dim)
        weight, offset, _ = w
        return self._qk_norm_rope.qk_norm_rope(
            qk, weight, eps, offset, rope.positions, rope.theta, rotary_dim, rope.freqs
        )

    def qk_norm_rope_kv(
        self, step: Step, qk: Tensor, v: Tensor, w, eps: float, rope, rotary_dim: int, kv_cache
    ) -> Tensor:
        """:meth:`qk_norm_rope`, then the keys (its last Hk heads) and ``v`` written into the
        layer's cache at the step's slots, in the same kernel (the bits write_kv stores)."""
        if isinstance(rope, _ScaledRope) or w[2] is None:
            qk = self.qk_norm_rope(qk, w, eps, rope, rotary_dim)
            self.write_kv(step, qk[:, qk.shape[1] - v.shape[1] :], v, kv_cache)
            return qk
        weight, offset, _ = w
        k_cache, v_cache = self.kv_views(kv_cache)
        return self._qk_norm_rope.qk_norm_rope(
            qk,
            weight,
            eps,
            offset,
            rope.positions,
            rope.theta,
            rotary_dim,
            rope.freqs,
            kv=(v, k_cache, v_cache, step.slot_mapping),
        )

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

    def plan_attention(self, step: Step, kv_arena: Tensor, group: int, window: int = 0):
        # ``window``: the kernels take it per call and read only the pages a row's window
        # reaches, so the plan is the same.
        dev = self.device
        # The Triton kernel's tiles, once per step from host values: per layer they would
        # cost a device synchronisation each (the reference takes none).
        tiles = getattr(self._attn, "attention_tiles", None)
        return _CudaAttentionPlan(
            block_tables=step.block_tables.to(device=dev, dtype=torch.int32),
            seq_lens=torch.tensor(step.ctx_lens, dtype=torch.int32, device=dev),
            query_start_loc=_query_start_loc(step, dev),
            tiles=tiles(_starts(step), group, dev) if tiles is not None else None,
        )

    def plan_decode_attention(
        self, block_tables: Tensor, seq_lens: Tensor, num_seqs: int, group: int
    ):
        """:meth:`plan_attention` for a captured decode step (kern.engine.cuda_graphs): one
        row per sequence, ``block_tables`` [B, W] and ``seq_lens`` [B] int32 static device
        buffers the graph reads at replay; what is made here (the tiles) is fixed by B, and
        is made before the capture (a host-to-device copy cannot be captured)."""
        dev = self.device
        starts = list(range(num_seqs + 1))
        tiles = getattr(self._attn, "attention_tiles", None)
        return _CudaAttentionPlan(
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            tiles=tiles(starts, group, dev) if tiles is not None else None,
        )

    def attention(
        self,
        step: Step,
        q: Tensor,
        kv_cache: Tensor,
        scale: float,
        sinks: Tensor | None = None,
        window: int = 0,
    ) -> Tensor:
        p = step.attention
        k_cache, v_cache = self.kv_views(kv_cache)
        args = (q, k_cache, v_cache, p.block_tables, p.seq_lens, p.query_start_loc, scale)
        extra: dict = {} if sinks is None and not window else {"sinks": sinks, "window": window}
        if p.tiles is None:
            return self._attn.paged_attention(*args, **extra)
        return self._attn.paged_attention(*args, tiles=p.tiles, **extra)

    def plan_latent_attention(self, step: Step, kv_arena: Tensor, num_heads: int):
        dev = self.device
        return _CudaAttentionPlan(
            block_tables=step.block_tables.to(device=dev, dtype=torch.int32),
            seq_lens=torch.tensor(step.ctx_lens, dtype=torch.int32, device=dev),
            query_start_loc=_query_start_loc(step, dev),
            tiles=None,
        )

    def write_latent(self, step: Step, entry: Tensor, cache: Tensor) -> None:
        self._mla.write_latent(entry, cache, step.slot_mapping)

    def latent_attention(
        self, step: Step, q: Tensor, cache: Tensor, scale: float, v_dim: int
    ) -> Tensor:
        p = step.attention
        return self._mla.mla_attention(
            q.contiguous(), cache, p.block_tables, p.seq_lens, p.query_start_loc, scale, v_dim
        )

    def sparse_attention(
        self, q: Tensor, keys: Tensor, key_rows: Tensor, valid: Tensor, sinks: Tensor, scale: float
    ) -> Tensor:
        """DeepSeek-V4's attention with sinks over rows of ``keys`` (a table over the arena,
        ``kern.models.deepseek_v4.attention.key_rows``)."""
        return self._sparse.sparse_attention(q.contiguous(), keys, key_rows, valid, sinks, scale)

    def compressor_pool(
        self, values: Tensor, gate: Tensor, starts: Tensor, lens: Tensor, init: Tensor
    ) -> Tensor:
        """DeepSeek-V4's compressor pooling: the accumulator after every row of each window."""
        return self._pool.compressor_pool(values, gate, starts, lens, init)

    def index_topk(self, q, weights, keys, key_rows, valid, k: int, scale: float):
        """DeepSeek-V4's indexer: each row's k best entries (ties: the lower slot)."""
        return self._topk.index_topk(q.contiguous(), weights, keys, key_rows, valid, k, scale)

    def prepare_head_linear(self, w: Tensor) -> Tensor:
        """Per-head weights [H, out, in], stored [H, in, out] for one batched matmul."""
        return w.to(device=self.device, dtype=self.dtype).transpose(1, 2).contiguous()

    def head_linear(self, x: Tensor, w: Tensor) -> Tensor:
        """x [T, H, in] -> [T, H, out]: one batched matmul over the heads."""
        return torch.bmm(x.transpose(0, 1), w).transpose(0, 1)

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
        """g: [T, Hv] per head (Qwen3.5) or [T, Hv, Dk] per key channel (Kimi-Linear); the
        kernels take either, and the per-row path below indexes it by row alike."""
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


@dataclass(frozen=True, slots=True)
class _Rope:
    """A step's RoPE for the rotary kernel: positions and the device-resident frequencies."""

    positions: Tensor
    theta: float
    freqs: Tensor


@dataclass(frozen=True, slots=True)
class _ScaledRope:
    """A step's YaRN tables (cos and sin scaled), applied by torch ops."""

    cos: Tensor
    sin: Tensor


@dataclass(frozen=True, slots=True)
class _CudaAttentionPlan:
    block_tables: Tensor
    seq_lens: Tensor
    query_start_loc: Tensor
    tiles: tuple[Tensor, Tensor] | None


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


def _starts(step: Step) -> list[int]:
    return step.q_starts + [step.q_starts[-1] + step.q_lens[-1]]


def _query_start_loc(step: Step, device: torch.device) -> Tensor:
    return torch.tensor(_starts(step), dtype=torch.int32, device=device)
