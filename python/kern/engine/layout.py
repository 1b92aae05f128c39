"""What one KV page and one recurrent-state slot hold, in bytes: computed once, here, from the
model's config and the backend, and read by both the cache's books and the runner.

Design notes
------------
* A page is ``page_tokens`` positions of every attention layer, in one of two page classes,
  in the backend's dtype, contiguous, so parking or waking a page is one row of bytes:
  - ``kv`` (GQA): each layer's K and V per head, ``[attention layers, 2, Hk, page_tokens,
    D]``. How K and V sit inside a page is the backend's choice (the CPU stores K
    transposed; ``ops.kv_views``), not the layout's.
  - ``latent`` (multi-head latent attention): each layer's one cached vector per token, the
    normalised latent then the rotated RoPE key, ``[attention layers, page_tokens,
    kv_lora_rank + qk_rope_head_dim]``: 576 values a token a layer at DeepSeek-V3's dims,
    where K and V per head would be 128 x (192 + 128).
  - ``compressed`` (DeepSeek-V4): one flat row of the parts ``kern.engine.compressed_layout``
    lays out (window entries, compressed entries, indexer keys, pooling accumulators).
* A slot is every linear-attention layer's state: the delta-rule state first
  (``[linear layers, Hv, Dk, Dv]``, float32, as the delta rule keeps it), then the conv state
  (``[linear layers, C, K - 1]`` in the backend's dtype). Float32 first keeps both parts
  aligned at any slot stride the pool picks (a multiple of 16 bytes).
* The pool places page ``p`` at byte ``p * page_bytes`` and slot ``s`` at ``s * slot_stride``
  of the same arena (``kern.pool.Geometry``), so these byte counts are the whole contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kern.engine.compressed_layout import CompressedPage
from kern.model_config import ModelConfig

__all__ = ["Layout"]


@dataclass(frozen=True, slots=True)
class Layout:
    """Shapes and byte sizes of one page and one slot. Build with :meth:`of`."""

    page_tokens: int
    dtype: torch.dtype  # K/V and conv state
    # kv: [attention layers, 2, Hk, page_tokens, D]; latent: [attention layers, page_tokens, C]
    page_shape: tuple[int, ...]
    delta_shape: tuple[int, ...]  # [linear layers, Hv, Dk, Dv], float32; () when stateless
    conv_shape: tuple[int, ...]  # [linear layers, C, K - 1]; () when stateless

    @classmethod
    def of(cls, config: ModelConfig, dtype: torch.dtype, page_tokens: int) -> Layout:
        """The layout of ``config``'s model on a backend computing in ``dtype``."""
        if page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
        c = config
        num_linear = sum(c.is_linear_layer(i) for i in range(c.num_hidden_layers))
        num_attention = c.num_hidden_layers - num_linear
        page_shape = (num_attention, 2, c.num_key_value_heads, page_tokens, c.head_dim)
        delta_shape: tuple[int, ...] = ()
        conv_shape: tuple[int, ...] = ()
        if num_linear:
            conv_dim = (
                2 * c.linear_num_key_heads * c.linear_key_head_dim
                + c.linear_num_value_heads * c.linear_value_head_dim
            )
            delta_shape = (
                num_linear,
                c.linear_num_value_heads,
                c.linear_key_head_dim,
                c.linear_value_head_dim,
            )
            conv_shape = (num_linear, conv_dim, c.linear_conv_kernel_dim - 1)
        if c.latent_attention:
            page_shape = (num_attention, page_tokens, c.kv_lora_rank + c.qk_rope_head_dim)
        if c.model_type == "deepseek_v4":
            page = CompressedPage.of(c, dtype, page_tokens)
            page_shape = (page.nbytes // _itemsize(dtype),)
        return cls(page_tokens, dtype, page_shape, delta_shape, conv_shape)

    @property
    def page_class(self) -> str:
        """``kv`` (K and V per head), ``latent`` (one latent vector per token) or
        ``compressed`` (DeepSeek-V4's parts, ``kern.engine.compressed_layout``)."""
        return {1: "compressed", 3: "latent"}.get(len(self.page_shape), "kv")

    @property
    def num_attention_layers(self) -> int:
        return 0 if self.page_class == "compressed" else self.page_shape[0]

    @property
    def num_linear_layers(self) -> int:
        return self.delta_shape[0] if self.delta_shape else 0

    @property
    def stateful(self) -> bool:
        """Whether a sequence keeps a recurrent state (and so needs a slot)."""
        return bool(self.delta_shape)

    @property
    def page_bytes(self) -> int:
        return _numel(self.page_shape) * _itemsize(self.dtype)

    @property
    def delta_bytes(self) -> int:
        return _numel(self.delta_shape) * 4 if self.delta_shape else 0

    @property
    def conv_bytes(self) -> int:
        return _numel(self.conv_shape) * _itemsize(self.dtype) if self.conv_shape else 0

    @property
    def state_bytes(self) -> int:
        """Bytes of one slot's state (0 for a stateless model)."""
        return self.delta_bytes + self.conv_bytes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
