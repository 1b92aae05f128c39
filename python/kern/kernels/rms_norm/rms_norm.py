"""Triton RMSNorm and gated RMSNorm; same signatures and casts as `reference.py`.

Design notes: one program normalises BT whole rows (BD >= D covers a row, so the mean is one
tl.sum in float32). A row's reduction never mixes with another row's, so results do not
depend on T or on a row's place. Autotuned over warps and rows per program only, keyed on D.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._triton import autotune_configs, check_device

RMS_NORM_CONFIGS = [
    triton.Config({"BT": bt}, num_warps=w) for bt, w in ((1, 4), (1, 8), (4, 4), (8, 8))
]


@triton.autotune(configs=autotune_configs(RMS_NORM_CONFIGS), key=["D", "GATED", "SIGMOID", "ADD"])
@triton.jit(do_not_specialize=["T"])
def rms_norm_kernel(
    x,
    z,
    w,
    y,
    s,
    T,
    D: tl.constexpr,
    stride_x,
    stride_z,
    stride_y,
    eps,
    offset,
    GATED: tl.constexpr,
    SIGMOID: tl.constexpr,
    ROUND_MID: tl.constexpr,
    ADD: tl.constexpr,
    BD: tl.constexpr,
    BT: tl.constexpr,
):
    i_t = tl.program_id(0)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = tl.arange(0, BD)
    m_t = o_t < T
    m_d = o_d < D
    m_td = m_t[:, None] & m_d[None, :]
    b_x = tl.load(x + o_t[:, None] * stride_x + o_d[None, :], mask=m_td, other=0.0)
    b_x = b_x.to(tl.float32)
    if ADD:
        # the residual add first, rounded to the output dtype as a separate add stores it
        # (z is the residual here, s receives the sum); the norm reads the rounded sum
        b_r = tl.load(z + o_t[:, None] * stride_z + o_d[None, :], mask=m_td, other=0.0)
        b_x = (b_x + b_r.to(tl.float32)).to(y.dtype.element_ty)
        tl.store(s + o_t[:, None] * stride_y + o_d[None, :], b_x, mask=m_td)
        b_x = b_x.to(tl.float32)
    b_var = tl.sum(b_x * b_x, axis=1) / D
    b_n = b_x * tl.rsqrt(b_var + eps)[:, None]
    b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
    if GATED and SIGMOID:
        # Kimi's output norm: all float32, the weight then sigmoid(z).
        b_z = tl.load(z + o_t[:, None] * stride_z + o_d[None, :], mask=m_td, other=0.0)
        b_y = b_w[None, :] * b_n * tl.sigmoid(b_z.to(tl.float32))
    elif GATED:
        # transformers rounds the normalised x to x.dtype, multiplies by the weight in the
        # promoted dtype (rounded again when that is x.dtype), then by silu(z) in float32.
        b_n = b_n.to(y.dtype.element_ty).to(tl.float32)
        b_y = b_w[None, :] * b_n
        if ROUND_MID:
            b_y = b_y.to(y.dtype.element_ty).to(tl.float32)
        b_z = tl.load(z + o_t[:, None] * stride_z + o_d[None, :], mask=m_td, other=0.0)
        b_z = b_z.to(tl.float32)
        b_y = b_y * (b_z * tl.sigmoid(b_z))
    else:
        b_y = b_n * (offset + b_w)[None, :]
    tl.store(y + o_t[:, None] * stride_y + o_d[None, :], b_y.to(y.dtype.element_ty), mask=m_td)


def _launch(
    x: Tensor,
    z: Tensor | None,
    weight: Tensor,
    eps: float,
    offset: float,
    sigmoid: bool = False,
    add: bool = False,
) -> tuple[Tensor, Tensor]:
    check_device(x, weight)
    shape = x.shape
    num_cols = shape[-1]
    x2 = x.reshape(-1, num_cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    z2 = x2
    if z is not None:
        z2 = z.reshape(-1, num_cols)
        if z2.stride(-1) != 1:
            z2 = z2.contiguous()
    num_rows = x2.shape[0]
    y = torch.empty((num_rows, num_cols), dtype=x.dtype, device=x.device)
    total = torch.empty_like(y) if add else y
    round_mid = torch.promote_types(weight.dtype, x.dtype) == x.dtype and x.dtype != torch.float32
    grid = lambda meta: (triton.cdiv(num_rows, meta["BT"]),)  # noqa: E731
    rms_norm_kernel[grid](
        x2,
        z2,
        weight.contiguous(),
        y,
        total,
        num_rows,
        num_cols,
        x2.stride(0),
        z2.stride(0),
        y.stride(0),
        eps,
        offset,
        GATED=z is not None and not add,
        SIGMOID=sigmoid,
        ROUND_MID=round_mid,
        ADD=add,
        BD=triton.next_power_of_2(num_cols),
    )
    return y.reshape(shape), total.reshape(shape)


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, offset: float = 0.0) -> Tensor:
    """See `reference.rms_norm`. Pure: returns a new tensor."""
    return _launch(x, None, weight, eps, offset)[0]


def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, *, offset: float = 0.0
) -> tuple[Tensor, Tensor]:
    """See `reference.add_rms_norm`. Pure: returns (x + residual, its rms_norm)."""
    if residual.shape != x.shape:
        raise ValueError(f"residual {list(residual.shape)} and x {list(x.shape)} differ")
    y, total = _launch(x, residual, weight, eps, offset, add=True)
    return total, y


def gated_rms_norm(
    x: Tensor, z: Tensor, weight: Tensor, eps: float, *, gate: str = "silu"
) -> Tensor:
    """See `reference.gated_rms_norm`. Pure: returns a new tensor."""
    if gate not in ("silu", "sigmoid"):
        raise ValueError(f"gate must be 'silu' or 'sigmoid', got {gate!r}")
    return _launch(x, z, weight, eps, 0.0, sigmoid=gate == "sigmoid")[0]
