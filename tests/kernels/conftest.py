"""Kernel tests: every Triton kernel against its torch reference, on the CPU.

Triton reads TRITON_INTERPRET when a kernel module is imported, so it is set here, before
any test module imports one: the kernels then run on CPU torch tensors.

``KERN_KERNEL_DEVICE=cuda`` runs the same tests compiled on a GPU instead (what
``tools/gpu/check.sh`` does): no interpreter, and torch's default device is the GPU, so
every tensor a test makes lands there.
"""

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

DEVICE = os.environ.get("KERN_KERNEL_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
elif DEVICE.startswith("cuda"):
    torch.set_default_device(DEVICE)
else:
    raise pytest.UsageError(f"KERN_KERNEL_DEVICE={DEVICE!r}: cpu or cuda[:N]")

try:
    import kern.kernels  # noqa: F401
except ImportError:
    # Not installed yet: use the source tree (python/kern/kernels links to kernels/).
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))


def _rows_alike_dot() -> None:
    """Make the interpreter's ``tl.dot`` compute each row of its result the same way, as a
    GPU's matrix units do. It calls ``np.matmul`` on the whole tile, and numpy's BLAS on some
    CPUs (measured: an AVX-512 AMD EPYC) gives a row different bits depending on its position
    in the tile, which no Triton program on a GPU sees; the invariance tests would then test
    the CPU's BLAS, not the kernel. Row by row, each row's bits depend only on its values."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    whole = builder.create_dot
    if getattr(whole, "_rows_alike", False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        rows = a.data.shape[-2]

        def part(h, i):
            return interpreter.TensorHandle(h.data[..., i : i + 1, :], h.dtype.scalar)

        out = [
            whole(self, part(a, i), b, part(d, i), input_precision, max_num_imprecise_acc)
            for i in range(rows)
        ]
        data = np.concatenate([o.data for o in out], axis=-2)
        return interpreter.TensorHandle(data, out[0].dtype)

    create_dot._rows_alike = True
    builder.create_dot = create_dot


if DEVICE == "cpu":
    _rows_alike_dot()

# Relative error allowed between a kernel and its reference: float32 rounding in fp32;
# in bf16/fp16 the output rounding (and bf16 operands in tl.dot) dominate.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def relative_error(ref: torch.Tensor, got: torch.Tensor) -> float:
    """||got - ref|| / ||ref||, in float64."""
    ref64, got64 = ref.double(), got.double()
    return ((got64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def _assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, tol: float) -> None:
    assert ref.shape == got.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    err = relative_error(ref, got)
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g}"


@pytest.fixture
def tol():
    """tol(dtype): the relative error a kernel may have against its reference."""
    return TOLERANCE.__getitem__


@pytest.fixture
def assert_close():
    """assert_close(name, ref, got, tol): relative error of one named tensor."""
    return _assert_close


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
