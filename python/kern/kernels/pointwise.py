"""Batch-invariant elementwise functions on the CPU: torch only, for the kernels' references
and the CPU backend (``kern.backend.cpu``).

Why: torch's CPU elementwise kernels run SIMD (Sleef) over the bulk of a contiguous tensor
and a scalar libm loop over the last numel % step elements (step = 2 vectors: 32 floats on
AVX-512) of each thread's chunk, and the two can differ by an ulp. So an element's bits
depend on where it lands in the tensor, i.e. on the batch. Measured on torch 2.13 (AVX-512,
2 threads): F.silu of a row of 24, 48 or 100 columns changed bits with the row count (from 2
or 3 rows up), while rows of 64 columns never did (1 to 1400 rows). Also on torch 2.13 at 2
threads (docs/invariance.md): ``torch.sigmoid``, ``F.silu`` and ``F.softplus`` differed
between the two loops (278 of 7000 sigmoid values by 1 ulp), while ``exp``, ``log1p``,
``rsqrt`` and the IEEE ops agreed in both.

Two ways around it, both here:

* ``sigmoid``, ``silu``, ``softplus``: composed from exp, log1p, addition and division,
  whose bits agree in both loops, so no element depends on where it falls. No padded
  copies; what the CPU backend runs.
* ``pointwise(fn, x)``, for any elementwise fn (cos, sin, ``F.silu`` in the references): every
  element takes the SIMD path whatever the batch. Columns are zero padded to a multiple of
  ALIGN, and the rows go through fn in blocks of at most GRAIN elements (ATen's grain size,
  below which a kernel runs on one thread, in one loop), so no element ever falls in a tail.
  A row longer than GRAIN goes alone, with one fixed shape.

The two give different bits for the same function: ``silu(x)`` and ``pointwise(F.silu, x)``
differed in 29129 of 700000 elements of ``randn * 4`` (sigmoid: 28204; torch 2.13, AMD EPYC,
2 threads). So neither replaces the other: the references keep torch's own functions through
``pointwise``, and the CPU backend keeps the composed ones its results were measured with.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from kern.arith import cdiv

ALIGN = 64  # floats; a multiple of ATen's SIMD step on AVX2 (16) and AVX-512 (32)
GRAIN = 32768  # at::internal::GRAIN_SIZE, elements


def pointwise(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """fn(x) for an elementwise fn, each element's bits independent of x's other rows.

    x: [..., C]; returns fn's output, same shape. Pure. fn must be elementwise (it is
    called on blocks of rows, with padded columns that are then dropped).
    """
    cols = x.shape[-1]
    rows = x.reshape(-1, cols)
    padded = cdiv(cols, ALIGN) * ALIGN
    # contiguous rows: a strided view would give each row its own SIMD loop and tail
    rows = F.pad(rows, (0, padded - cols)) if padded != cols else rows.contiguous()
    step = max(1, GRAIN // padded)
    parts = [fn(rows[i : i + step]) for i in range(0, rows.shape[0], step)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out[:, :cols].reshape(x.shape)


def sigmoid(x: Tensor) -> Tensor:
    """1 / (1 + exp(-x)) from exp and division only (``torch.sigmoid`` is not invariant)."""
    return torch.reciprocal(torch.exp(-x).add_(1.0))


def silu(x: Tensor) -> Tensor:
    """x * sigmoid(x) as x / (1 + exp(-x)) (``F.silu`` is not invariant)."""
    return x / torch.exp(-x).add_(1.0)


def softplus(x: Tensor) -> Tensor:
    """log(1 + exp(x)), linear past 20 as ``F.softplus`` (beta 1, threshold 20) is."""
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x)))
