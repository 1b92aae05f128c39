"""What every Triton wrapper here shares. Imports triton: only the <op>.py modules use it."""

import torch
import triton
import triton.language as tl
from triton import knobs


def autotune_configs(configs: list[triton.Config]) -> list[triton.Config]:
    """The one config every kernel runs: the first, on a GPU and under the interpreter alike.

    Timed autotuning picks by measurements that differ between processes, and a config
    decides the warp layout of a kernel's reductions (``tl.sum``, ``tl.dot``), so ``kern
    run`` and the server could round the same row differently: kern's identity promise
    needs the config to be a function of the shapes alone. The other configs stay listed
    as candidates for a better first one, measured on a device; none of them runs.
    """
    return configs[:1]


def block(n: int, floor: int = 16) -> int:
    """A power-of-two block size covering n, at least `floor` (tl.dot wants dims >= 16)."""
    return max(triton.next_power_of_2(n), floor)


def check_device(*tensors: torch.Tensor) -> None:
    """Compiled kernels need device tensors; the interpreter needs CPU ones."""
    for t in tensors:
        if knobs.runtime.interpret != (t.device.type == "cpu"):
            raise ValueError(
                f"tensor on {t.device} with TRITON_INTERPRET={int(knobs.runtime.interpret)}: "
                "the interpreter runs on CPU tensors, compiled kernels on GPU tensors"
            )


# The interpreter's tl.dot (triton 3.7) multiplies bf16 operands as their uint16 storage
# (measured: garbage of order 1e10). Under the interpreter, bf16 operands are widened to
# float32 first: exact, and the same products a bf16 MMA accumulates in float32.
_WIDEN_BF16_DOT = tl.constexpr(knobs.runtime.interpret)


@triton.jit
def dot(a, b):
    """tl.dot accumulating in float32; float32 operands in full IEEE precision (no TF32)."""
    if _WIDEN_BF16_DOT:
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)
