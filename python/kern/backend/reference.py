"""The torch reference backend: the CUDA wiring over the kernels' torch references."""

from __future__ import annotations

import importlib

import torch

from kern.backend.cuda import CudaOps


class ReferenceOps(CudaOps):
    """The torch reference path: the CUDA backend's wiring with every kernel replaced by its
    torch reference (``kern.kernels.<op>.reference``; the linears' is ``x @ w.T``), float32
    on the CPU.

    Slow (the references loop over sequences in Python) and makes no invariance promise; it
    is what ``kern test`` checks a target's backend against, since it shares no attention,
    recurrence or matmul code with either fast path.
    """

    dtype = torch.float32

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))

    def _kernel(self, op: str):
        return importlib.import_module(f"kern.kernels.{op}.reference")
