"""Batch-invariant elementwise transcendentals (exp, silu, sigmoid, softplus, cos, sin) on
the CPU. Torch only; for references and the CPU runner.

Why: torch's CPU elementwise kernels run SIMD (Sleef) over the bulk of a contiguous tensor
and a scalar libm loop over the last numel % step elements (step = 2 vectors: 32 floats on
AVX-512) of each thread's chunk, and the two can differ by an ulp. So an element's bits
depend on where it lands in the tensor: measured on torch 2.13 (AVX-512, 2 threads),
F.silu of a row of 24, 48 or 100 columns changed bits with the row count (from 2 or 3
rows up), while rows of 64 columns never did (1 to 1400 rows).

`pointwise` makes every element take the SIMD path whatever the batch: columns are zero
padded to a multiple of ALIGN, and the rows go through fn in blocks of at most GRAIN
elements (ATen's grain size, below which a kernel runs on one thread, in one loop), so no
element ever falls in a tail. A row longer than GRAIN goes alone, with one fixed shape.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

ALIGN = 64  # floats; a multiple of ATen's SIMD step on AVX2 (16) and AVX-512 (32)
GRAIN = 32768  # at::internal::GRAIN_SIZE, elements


def pointwise(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """fn(x) for an elementwise fn, each element's bits independent of x's other rows.

    x: [..., C]; returns fn's output, same shape. Pure. fn must be elementwise (it is
    called on blocks of rows, with padded columns that are then dropped).
    """
    cols = x.shape[-1]
    rows = x.reshape(-1, cols)
    padded = -(-cols // ALIGN) * ALIGN
    # contiguous rows: a strided view would give each row its own SIMD loop and tail
    rows = F.pad(rows, (0, padded - cols)) if padded != cols else rows.contiguous()
    step = max(1, GRAIN // padded)
    parts = [fn(rows[i : i + step]) for i in range(0, rows.shape[0], step)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out[:, :cols].reshape(x.shape)
