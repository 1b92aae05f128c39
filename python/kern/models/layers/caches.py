"""What a model's layers read and write besides their weights, and the tensors they are
built from: the per-step :class:`Caches` and the checkpoint's named tensors.

A model is plain tensors and functions of (step, caches): no ``nn.Module``, no autograd, no
per-call state. Weights are prepared once by the backend (``ops.prepare_linear``: reordered
for the CPU's batch-invariant matmul) and projections that read the same input are fused into
one matmul (q/k/v; gate/up), which splits its output columns exactly as separate matmuls would
be laid out.
"""

from __future__ import annotations

from torch import Tensor

from kern.backend import Ops

__all__ = ["Caches", "Tensors", "param"]

Tensors = dict[str, Tensor]


class Caches:
    """Per-layer views the layers read and write, for one forward: each attention layer's
    pages (``kv``: the page kind's view, ``kern.models.pages``), each linear-attention
    layer's conv and delta-rule states and where to put row snapshots, and ``taps``: the
    layers whose outputs the runner keeps (layer index -> its output, filled by the
    forward)."""

    def __init__(
        self,
        kv: list,
        conv: list[Tensor],
        delta: list[Tensor],
        conv_snap: list[Tensor] | None = None,
        delta_snap: list[Tensor] | None = None,
        taps: dict[int, Tensor | None] | None = None,
    ) -> None:
        self.kv = kv
        self.conv = conv
        self.delta = delta
        self.conv_snap = conv_snap
        self.delta_snap = delta_snap
        self.taps = taps or {}


def param(ops: Ops, t: Tensor) -> Tensor:
    """A tensor in ``ops``' dtype on its device, contiguous."""
    return t.to(device=ops.device, dtype=ops.dtype).contiguous()
