"""The SwiGLU MLP."""

from __future__ import annotations

import torch
from torch import Tensor

from kern.backend import Ops
from kern.models.layers.caches import Tensors

__all__ = ["DenseMLP"]


class DenseMLP:
    """down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, ops: Ops, t: Tensors, prefix: str) -> None:
        self.ops = ops
        gate_up = torch.cat([t[f"{prefix}gate_proj.weight"], t[f"{prefix}up_proj.weight"]])
        self.w_gate_up = ops.prepare_linear(gate_up)
        self.w_down = ops.prepare_linear(t[f"{prefix}down_proj.weight"])

    def __call__(self, x: Tensor) -> Tensor:
        ops = self.ops
        return ops.linear(ops.linear_silu_and_mul(x, self.w_gate_up), self.w_down)
