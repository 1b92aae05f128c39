"""The CPU backend: float32 torch ops arranged so that a row's bits do not depend on its batch.

Design notes
------------
* CPU numerics are chosen for batch invariance (a row's logits depend on its own tokens
  only), measured on torch 2.13 / MKL, 2 threads (see docs/invariance.md):
  - Linears go through oneDNN with the weight reordered once at load
    (``torch.ops.mkldnn._linear_pointwise``, what inductor's frozen CPU graphs call): a row's
    bits were the same for every M from 2 to 8192 at every shape tried (K x N from 64 x 256
    to 2048 x 11008 and 1024 x 151936, 1 and 2 threads, on an AMD EPYC host), and it ran
    1.3-2.3x faster than MKL at M = 32 on AMD EPYC (where MKL takes its AVX2 path). M = 1
    differs (at K = 2048), so one row is padded to 2. torch 2.11's oneDNN is not invariant on
    an AVX2-only EPYC (rows changed for M = 1-3, 7-9, 13-15, ... at every shape), so the op
    is used only when a start-up probe (:func:`onednn_rows_hold`) sees its rows hold. MKL's
    ``x @ w`` is not a safe default: on an AMD EPYC host at 2 threads its rows changed for M
    in 5-7 and 9-11 (it splits M across threads), though on the earlier host they held for
    4 <= M <= 128. It stays only as the fallback where oneDNN's rows do not hold: ``w``
    transposed ([in, out]), tiles of at most ``ROW_TILE`` rows, each padded to ``MIN_ROWS``
    (32: on AMD EPYC hosts no M from 12 to 128 changed a row's bits, but on an Intel Xeon
    host at 2 threads MKL switched kernels between 16 and 17 rows at N = 384-640, K >=
    1536, and held from 17 to 128 at every shape measured).
  - ``torch.sigmoid``, ``F.silu`` and ``F.softplus`` are not batch invariant on the CPU
    (their scalar tail loop and vectorized body differ by an ulp); sigmoid, silu and
    softplus are composed from exp, log1p and division instead (``kern.kernels.pointwise``,
    which holds the measurements).
  - Row reductions (``mean(-1)``, ``sum(-1)`` over a fixed length) did not change with the
    row count, so RMSNorm and RoPE are the references' ops in the references' order (bit
    for bit), with the norm's ``offset + w`` folded once at load and RoPE's cos/sin tables
    built once per step instead of in every layer.
  - Attention and the recurrent mixers are batched CPU implementations of the references
    (``cpu_attention.py``, ``cpu_recurrence.py``): the references loop over sequences in
    Python.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from kern.backend import cpu_attention as _cpu_attn
from kern.backend import cpu_recurrence as _cpu_rec
from kern.batch import Step
from kern.kernels.compressor_pool import reference as _pool_ref
from kern.kernels.index_topk import reference as _topk_ref
from kern.kernels.pointwise import sigmoid, silu, softplus
from kern.kernels.rotary import reference as _rotary_ref

# The fallback ``x @ w`` path (see the notes above): tiles of at most ROW_TILE rows (rows
# kept their bits up to 128 on every host, not always past 160), padded to MIN_ROWS (rows
# changed between 16 and 17 on an Intel Xeon host: see the notes above).
ROW_TILE = 128
MIN_ROWS = 32
# oneDNN's rows differ between M = 1 and M >= 2, so a single row is padded to this many.
ONEDNN_MIN_ROWS = 2


def _has_onednn_linear() -> bool:
    try:
        return torch.backends.mkldnn.is_available() and hasattr(
            torch.ops.mkldnn, "_linear_pointwise"
        )
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def onednn_rows_hold() -> bool:
    """Whether this torch's oneDNN linear gives a row the same bits at every row count the
    probe tries. torch 2.11 on an AVX2-only host failed at M = 1-3, 7-9, 13-15, ... at every
    shape, torch 2.13 on the same host at none; ~0.1 s, once per process. ``kern serve``'s
    start-up line says when it is false."""
    if not _has_onednn_linear():
        return False
    gen = torch.Generator().manual_seed(0)
    for k, n in ((80, 96), (1024, 256)):
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k, generator=gen), 32)
        x = torch.randn(80, k, generator=gen)
        run = functools.partial(
            _pad_rows, min_rows=ONEDNN_MIN_ROWS, fn=functools.partial(_onednn, packed=packed)
        )
        whole = run(x)
        for m in (*range(1, 20), 31, 33, 64):
            # a row count's first rows and last rows, against the same rows of all 80
            if not (torch.equal(run(x[:m]), whole[:m]) and torch.equal(run(x[-m:]), whole[-m:])):
                return False
    return True


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
        self.onednn = onednn_rows_hold()
        # Attention's score and block buffers, kept across steps (a runner runs one forward
        # at a time): fresh multi-MB buffers cost their page faults every layer.
        self.attention_scratch: dict = {}

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
            out = _pad_rows(x, onednn_rows(m), lambda a: _onednn(a, w.weight))
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

    def linear_silu_and_mul(self, x: Tensor, w: CpuLinear) -> Tensor:
        """silu_and_mul(linear(x, w)) for a gate-then-up weight (the CUDA backend fuses them)."""
        return self.silu_and_mul(self.linear(x, w))

    def prepare_norm(self, w: Tensor, offset: float = 0.0) -> Tensor:
        """An RMSNorm weight with its offset folded in: ``offset + w``, the very tensor the
        reference multiplies by, computed once instead of per call."""
        return offset + w.to(device=self.device, dtype=self.dtype)

    def rms_norm(self, x: Tensor, w: Tensor, eps: float) -> Tensor:
        """The reference's ``rms_norm`` (same ops, same order) with ``w`` from
        :meth:`prepare_norm`; ``w`` may be [D] or broadcast over heads ([H, D])."""
        variance = x.pow(2).mean(-1, keepdim=True)
        return x * variance.add_(eps).rsqrt_() * w

    def add_rms_norm(self, x: Tensor, h: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """(x + h, its :meth:`rms_norm`): a decoder layer's residual add and the next norm
        (the CUDA backend does both in one kernel)."""
        total = x + h
        return total, self.rms_norm(total, w, eps)

    def gated_rms_norm(
        self, x: Tensor, z: Tensor, w: Tensor, eps: float, gate: str = "silu"
    ) -> Tensor:
        # The reference's op order, with a batch-invariant silu or sigmoid.
        variance = x.pow(2).mean(-1, keepdim=True)
        return (w * (x * variance.add_(eps).rsqrt_())) * (silu(z) if gate == "silu" else sigmoid(z))

    def plan_rope(
        self,
        positions: Tensor,
        theta: float,
        rotary_dim: int,
        inv_freq: Tensor | None = None,
        scaling: float = 1.0,
    ):
        """cos and sin [T, 1, rotary_dim / 2] for the step, shared by every layer: the
        reference's tables, built once per step instead of twice per layer. ``inv_freq``
        (YaRN's, ``kern.models.layers.rope``) replaces theta's; both tables are scaled by
        ``scaling`` (YaRN's attention factor), as transformers scales them."""
        if inv_freq is None:
            inv_freq = _rotary_ref.inv_freq(theta, rotary_dim)
        freqs = positions[:, None].float() * inv_freq
        cos, sin = freqs.cos(), freqs.sin()
        if scaling != 1.0:
            cos, sin = cos * scaling, sin * scaling
        return cos[:, None, :], sin[:, None, :]

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

    def qk_norm_rope(self, qk: Tensor, w: Tensor, eps: float, rope, rotary_dim: int) -> Tensor:
        """The attention layers' per-head q/k norm (``w`` [H, D] from :meth:`prepare_norm`),
        then RoPE: the two ops in sequence (the CUDA backend fuses them)."""
        return self.rotary(self.rms_norm(qk, w, eps), rope, rotary_dim)

    def qk_norm_rope_kv(
        self, step: Step, qk: Tensor, v: Tensor, w: Tensor, eps: float, rope, rotary_dim: int,
        kv_cache: Tensor,
    ) -> Tensor:  # fmt: skip
        """:meth:`qk_norm_rope`, then the keys (its last Hk heads) and ``v`` into the cache."""
        qk = self.qk_norm_rope(qk, w, eps, rope, rotary_dim)
        self.write_kv(step, qk[:, qk.shape[1] - v.shape[1] :], v, kv_cache)
        return qk

    def silu_and_mul(self, x: Tensor) -> Tensor:
        """silu(gate) * up as ``kern.kernels.pointwise.silu`` computes it, in one new buffer."""
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

    def plan_attention(self, step: Step, kv_arena: Tensor, group: int, window: int = 0):
        """kv_arena: the runner's [P, layers, 2, Hk, page_tokens, D] arena. ``window`` > 0: a
        plan for layers with that sliding window only, reading only the pages a unit's window
        reaches (its table may hold -1 before them)."""
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
            self.attention_scratch,
            window=window,
        )

    def plan_latent_attention(self, step: Step, kv_arena: Tensor, num_heads: int):
        """kv_arena: the runner's latent pages [P, layers, page_tokens, C]; every one of the
        ``num_heads`` query heads reads the one latent "KV head"."""
        _, _, page_tokens, dim = kv_arena.shape
        return _cpu_attn.plan_attention(
            step.q_starts,
            step.q_lens,
            step.ctx_lens,
            step.block_tables,
            page_tokens,
            1,
            num_heads,
            dim,
            kv_arena.stride(0),
            step.page_ids,
            step.page_offsets,
            self.attention_scratch,
        )

    def write_latent(self, step: Step, entry: Tensor, cache: Tensor) -> None:
        """entry [T, C] into a layer's latent pages [P, page_tokens, C]."""
        _cpu_attn.write_latent(step.attention, entry, cache)

    def latent_attention(
        self, step: Step, q: Tensor, cache: Tensor, scale: float, v_dim: int
    ) -> Tensor:
        """q [T, H, C] over a layer's latent pages -> [T, H, v_dim]."""
        return _cpu_attn.attend_latent(step.attention, q, cache, scale, v_dim)

    def prepare_head_linear(self, w: Tensor) -> list[CpuLinear]:
        """Per-head weights [H, out, in] for :meth:`head_linear`."""
        return [self.prepare_linear(w[h]) for h in range(w.shape[0])]

    def head_linear(self, x: Tensor, w: list[CpuLinear]) -> Tensor:
        """x [T, H, in] -> [T, H, out], head h through its own weight: one batch-invariant
        linear per head (a batched matmul's rows are not promised to keep their bits)."""
        return torch.stack([self.linear(x[:, h], wh) for h, wh in enumerate(w)], dim=1)

    def kv_views(self, kv_cache: Tensor) -> tuple[Tensor, Tensor]:
        """A layer's K and V as [P, page_tokens, Hk, D] views (how this backend lays them
        out inside a page is its own business)."""
        return _cpu_attn.kv_views(kv_cache)

    def attention(
        self,
        step: Step,
        q: Tensor,
        kv_cache: Tensor,
        scale: float,
        sinks: Tensor | None = None,
        window: int = 0,
    ) -> Tensor:
        """``sinks`` [Hq] float32 or None, ``window`` 0 or a sliding window (gpt-oss)."""
        return _cpu_attn.attend(step.attention, q, kv_cache, scale, sinks, window)

    def plan_recurrent(
        self, step: Step, slots: list[int], snapshot_seqs: list[int], conv_width: int
    ):
        """The plan and, per snapshot sequence (batch index), its first snapshot row."""
        return _cpu_rec.plan_recurrent(step.q_starts, step.q_lens, slots, snapshot_seqs, conv_width)

    def causal_conv1d(self, step: Step, x, weight, conv_states, snapshots=None) -> Tensor:
        return _cpu_rec.causal_conv1d(step.recurrent, x, weight, conv_states, snapshots)

    def gated_delta_rule(self, step: Step, q, k, v, g, beta, states, scale, snapshots=None):
        return _cpu_rec.gated_delta_rule(step.recurrent, q, k, v, g, beta, states, scale, snapshots)

    # DeepSeek-V4's compressors and indexer: the kernels' torch references are batch
    # invariant as they stand (per-window and per-row ops in a fixed order).
    compressor_pool = staticmethod(_pool_ref.compressor_pool)
    index_topk = staticmethod(_topk_ref.index_topk)


def _onednn(x: Tensor, packed: Tensor) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")


def onednn_rows(m: int) -> int:
    """The rows oneDNN runs ``m`` rows as: ``m`` up to 64 (decode batches; one row padded to
    :data:`ONEDNN_MIN_ROWS`), else ``m`` rounded up to 16 (to 512) or 64. oneDNN caches a
    primitive per row count (up to 1,024): prefill chunks of every length grew a process by
    229 MiB for 400 row counts of one 1024 x 256 weight, 40 MiB when rounded so. A row's bits
    are the same at every row count from 2 (the probe's condition), so rounding moves none."""
    if m <= 64:
        return max(m, ONEDNN_MIN_ROWS)
    step = 16 if m <= 512 else 64
    return -(-m // step) * step


def _pad_rows(x: Tensor, min_rows: int, fn) -> Tensor:
    """fn(x), run on x zero padded to at least min_rows rows."""
    m = x.shape[0]
    if m >= min_rows:
        return fn(x)
    padded = x.new_zeros(min_rows, x.shape[1])
    padded[:m] = x
    return fn(padded)[:m]
