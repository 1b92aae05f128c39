"""kern's backends, and the one place where the runner's backend is chosen.

Design notes
------------
* ``make_ops(device)`` returns :class:`CpuOps` (float32, torch, batch invariant; ``cpu.py``)
  or :class:`CudaOps` (bf16, Triton, ``kern.kernels.<op>.<op>``; ``cuda.py``);
  ``make_ops("cpu", reference=True)`` returns :class:`ReferenceOps` (``reference.py``), the
  CUDA wiring over the kernels' torch references, which ``kern test`` checks both fast paths
  against. Models call only ``ops.<name>``; nothing else in the runner looks at the device.
* A backend is the object handed to ``Runner(ops=...)``: the reference path and the Triton
  interpreter of the tests are other objects (so would be a backend with an injected fault),
  not flags threaded through the layers.
"""

from __future__ import annotations

import torch

from kern.backend.cpu import CpuOps
from kern.backend.cuda import CudaOps
from kern.backend.reference import ReferenceOps

__all__ = ["CpuOps", "CudaOps", "Ops", "ReferenceOps", "make_ops"]

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
