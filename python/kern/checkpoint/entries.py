"""Where a checkpoint's tensor is stored and how it is decoded: the header facts of one
stored tensor (:class:`Entry`), the pairing of quantised weights with their block scales,
and their dequantisation.

Design notes
------------
* Block-scaled FP8 (DeepSeek's release): ``F8_E4M3`` weights with a ``weight_scale_inv``
  of one scale per ``weight_block_size`` block (ceil-divided at the edges), float32 or e8m0
  (``F8_E8M0``, or ``U8`` bytes meaning ``2 ** (b - 127)``, as transformers reads them).
* DeepSeek-V4's FP4 routed experts: ``I8`` [out, in / 2], byte j holding inputs 2j (low
  nibble) and 2j + 1 (high nibble) as e2m1 values, with one scale per 32 inputs of a row,
  as transformers' ``Fp8Dequantize`` unpacks them. Their entry's ``shape`` is the unpacked
  one, so the shape checks compare it with the model's.
* gpt-oss's MXFP4 experts: the same e2m1 pairs and e8m0 scales, stored ``U8`` and fused
  ([experts, out, in / 32, 16] blocks, [experts, out, in / 32] scales); each expert is a
  piece of both (``Entry.piece``), read and dequantised on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open

from kern.checkpoint.errors import TensorError, TensorShapeError
from kern.checkpoint.names import fp4_weight

if TYPE_CHECKING:
    from kern.models.config import ModelConfig

__all__ = [
    "FLOAT_DTYPES",
    "FP4",
    "FP8",
    "INT_DTYPES",
    "Entry",
    "TensorError",
    "TensorShapeError",
    "dequantize",
    "num_bytes",
    "pair_scales",
    "read_stored",
]


# safetensors header dtypes that hold weights kern can cast; integer tensors are quantized
# formats kern does not read.
FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
# Block-scaled FP8 (DeepSeek's release): read only with a ``weight_scale_inv`` beside it.
FP8 = "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"
# Scales: float, or e8m0 exponents (F8_E8M0, or U8 bytes meaning 2 ** (b - 127)).
SCALE_DTYPES = {**FLOAT_DTYPES, "F8_E8M0": 1, "U8": 1}
# DeepSeek-V4's FP4 experts: int8 bytes, each two e2m1 values (low nibble first), with one
# scale per FP4_GROUP inputs.
FP4 = "I8"
FP4_BYTES = (FP4, "U8")  # gpt-oss's MXFP4 blocks are U8
FP4_GROUP = 32
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES += tuple(-v for v in FP4_VALUES)  # the nibble's high bit is the sign
INT_DTYPES = {"I8": 1, "I16": 2, "I32": 4, "I64": 8, "U8": 1}


@dataclass(frozen=True)
class Entry:
    file: Path
    stored_name: str
    shape: tuple[int, ...]
    dtype: str
    scale: Entry | None = None  # an FP8 / FP4 weight's block scales (weight_scale_inv)
    block: tuple[int, ...] = ()  # and the block they scale (FP4: shape is the unpacked one)
    # A piece of a fused stored tensor: (index on dim 0, first row, end row); shape is the
    # piece's (its trailing dims flattened to one; reversed when ``transposed``).
    piece: tuple[int, int, int] | None = None
    transposed: bool = False  # the piece is stored [in, out] (gpt-oss's fused experts)


def read_stored(f: Any, entry: Entry) -> torch.Tensor:
    """``entry``'s stored tensor from the open file ``f``: whole, or only its piece's rows
    (as ``entry.shape`` says: trailing dims flattened, transposed if stored so)."""
    if entry.piece is None:
        return f.get_tensor(entry.stored_name)
    index, start, stop = entry.piece
    t = f.get_slice(entry.stored_name)[index : index + 1, start:stop][0]
    if t.dim() > 2:
        t = t.reshape(t.shape[0], -1)
    return t.t().contiguous() if entry.transposed else t


def dequantize(weight: torch.Tensor, entry: Entry, f: Any = None) -> torch.Tensor:
    """A block-scaled FP8 (or FP4) weight in float32: each (b0 x b1) block times its scale.
    ``f``: the weight's file, open, read for the scales when they are stored beside it."""
    assert entry.scale is not None
    if f is not None and entry.scale.file == entry.file:
        s = read_stored(f, entry.scale)
    else:
        with safe_open(str(entry.scale.file), framework="pt", device=str(weight.device)) as g:
            s = read_stored(g, entry.scale)
    s = (s.float() - 127.0).exp2() if s.dtype == torch.uint8 else s.float()
    if entry.dtype in FP4_BYTES:
        values = torch.tensor(FP4_VALUES, dtype=torch.float32, device=weight.device)
        u8 = weight.contiguous().view(torch.uint8).long()
        # Byte j holds inputs 2j (low nibble) and 2j + 1 (high nibble).
        weight = torch.stack([values[u8 & 0xF], values[u8 >> 4]], dim=-1).flatten(-2)
    rows, cols = weight.shape
    b0, b1 = entry.block
    s = s.repeat_interleave(b0, dim=0)[:rows].repeat_interleave(b1, dim=1)[:, :cols]
    return weight.float() * s


def num_bytes(entry: Entry) -> int:
    scale = num_bytes(entry.scale) if entry.scale else 0
    if entry.dtype in FP4_BYTES and entry.scale is not None:
        return num_bytes_of(1, entry.shape) // 2 + scale
    if entry.dtype == FP8:
        return num_bytes_of(1, entry.shape) + scale
    size = {**FLOAT_DTYPES, **SCALE_DTYPES, **INT_DTYPES}.get(entry.dtype, 1)
    return num_bytes_of(size, entry.shape)


def num_bytes_of(itemsize: int, shape: tuple[int, ...]) -> int:
    n = itemsize
    for d in shape:
        n *= d
    return n


def pair_scales(config: ModelConfig, entries: dict[str, Entry]) -> dict[str, Entry]:
    """Attach each ``weight_scale_inv`` to its FP8 (or FP4) weight (checked: dtype, block
    count)."""
    out: dict[str, Entry] = {}
    for name, entry in entries.items():
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in entries:
            continue
        fp4 = entry.dtype in FP4_BYTES and fp4_weight(config, name)
        if entry.dtype != FP8 and not fp4:
            out[name] = entry
            continue
        where = f"{entry.file}: tensor {entry.stored_name!r}"
        if not config.fp8_block and not fp4:
            raise TensorError(
                f"{where} is {entry.dtype}, but config.json has no fp8 quantization_config "
                "with a weight_block_size"
            )
        scale = entries.get(name + SCALE_SUFFIX)
        if scale is None or len(entry.shape) != 2:
            raise TensorError(f"{where} is {entry.dtype} without a 2-d block scale tensor")
        shape = entry.shape
        if fp4:
            # Two inputs a byte; one scale per FP4_GROUP inputs of each row.
            shape = (shape[0], 2 * shape[1])
            (b0, b1), want = (1, FP4_GROUP), (shape[0], shape[1] // FP4_GROUP)
            exact = shape[1] % FP4_GROUP == 0
        else:
            b0, b1 = config.fp8_block
            want, exact = (-(-shape[0] // b0), -(-shape[1] // b1)), True
        if not exact or scale.shape != want or scale.dtype not in SCALE_DTYPES:
            raise TensorShapeError(
                f"{scale.file}: tensor {scale.stored_name!r} has shape {list(scale.shape)} "
                f"({scale.dtype}), expected float scales of shape {list(want)} (or e8m0) for "
                f"{list(shape)} in {b0} x {b1} blocks"
            )
        out[name] = replace(entry, shape=shape, scale=scale, block=(b0, b1))
    return out
