"""DeepSeek-V4's release format for tiny checkpoints: FP8 projections with e8m0 block
scales and FP4 routed experts, in the layout ``kern.checkpoint_entries`` (and transformers'
FP8 loader) reads.

Every scale is a power of two, so a dequantised weight (value x scale) is exact in float32:
a folder and its dequantised twin load to the same tensors.
"""

from __future__ import annotations

import torch

from kern.checkpoint_entries import FP4_GROUP, FP4_VALUES
from kern.deepseek_v4_tensors import is_routed_expert

__all__ = ["quantize_v4", "v4_fp8_weight"]

_FP8_MAX = 448.0
_FP4_MAX = 6.0


def v4_fp8_weight(name: str) -> bool:
    """Whether the release stores ``name`` as FP8: the attention's and the indexer's query
    projections and the shared expert. The compressors, the indexer's weights_proj,
    embeddings, head, routers, norms and hyper-connections stay float."""
    if ".attn.compressor." in name or ".indexer.compressor." in name:
        return False
    leaves = (".wq_a.weight", ".wq_b.weight", ".wkv.weight", ".wo_a.weight", ".wo_b.weight")
    return (".attn." in name and name.endswith(leaves)) or ".shared_experts." in name


def quantize_v4(
    tensors: dict[str, torch.Tensor], block: tuple[int, int]
) -> dict[str, torch.Tensor]:
    """kern-named tensors to the release's quantised ones: FP8 (``block`` blocks) and FP4
    (one scale per 32 inputs) weights, each with ``<name minus .weight>.weight_scale_inv``
    holding e8m0 scales; other tensors unchanged."""
    out = {}
    for name, t in tensors.items():
        if is_routed_expert(name):
            out[name], out[name + "_scale_inv"] = _fp4(t.float())
        elif v4_fp8_weight(name):
            out[name], out[name + "_scale_inv"] = _fp8(t.float(), block)
        else:
            out[name] = t
    return out


def _pow2_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The smallest power of two that brings ``amax`` within ``top``."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-30) / top)))


def _fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    b0, b1 = block
    nr, nc = -(-rows // b0), -(-cols // b1)
    padded = torch.zeros(nr * b0, nc * b1)
    padded[:rows, :cols] = w
    blocks = padded.view(nr, b0, nc, b1)
    scale = _pow2_scale(blocks.abs().amax(dim=(1, 3)), _FP8_MAX)
    q = (blocks / scale[:, None, :, None]).view(nr * b0, nc * b1)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.to(torch.float8_e8m0fnu).contiguous()


def _fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    groups = w.view(rows, cols // FP4_GROUP, FP4_GROUP)
    scale = _pow2_scale(groups.abs().amax(dim=2), _FP4_MAX)
    v = (groups / scale[:, :, None]).view(rows, cols)
    # The nearest e2m1 magnitude (codes 0-7), with the sign as the nibble's high bit.
    magnitudes = torch.tensor(FP4_VALUES[:8])
    code = (v.abs()[..., None] - magnitudes).abs().argmin(dim=-1)
    code = code + 8 * (v < 0).long()
    packed = code[:, 0::2] | (code[:, 1::2] << 4)  # input 2j in the low nibble
    return (
        packed.to(torch.uint8).view(torch.int8).contiguous(),
        scale.to(torch.float8_e8m0fnu).contiguous(),
    )
