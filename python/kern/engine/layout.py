"""What one KV page and one recurrent-state slot hold, in bytes: computed once, here, from the
model's config and the backend, and read by both the cache's books and the runner.

Design notes
------------
* A page is ``page_tokens`` positions of every attention layer, in the backend's dtype,
  contiguous, so parking or waking a page is one row of bytes. What it holds is the family's
  page kind (``kern.models.pages``: K/V per head, a latent per token, or DeepSeek-V4's
  compressed entries), which the registry row names: ``Layout.pages``.
* A slot is every linear-attention layer's state: the delta-rule state first
  (``[linear layers, Hv, Dk, Dv]``, float32, as the delta rule keeps it), then the conv state
  (``[linear layers, C, K - 1]`` in the backend's dtype). Float32 first keeps both parts
  aligned at any slot stride the pool picks (a multiple of 16 bytes).
* A page kind with window pages (DeepSeek-V4's, gpt-oss's; ``PageKind.window_tokens``) keeps
  them in the slots instead: a window page is a slot (``state_bytes`` is its size), and the
  model keeps no recurrent state (``stateful`` is False).
* The pool places page ``p`` at byte ``p * page_bytes`` and slot ``s`` at ``s * slot_stride``
  of the same arena (``kern.pool.Geometry``), so these byte counts are the whole contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kern.models import registry
from kern.models.config import ModelConfig
from kern.models.pages import PageKind

__all__ = ["Layout"]


@dataclass(frozen=True, slots=True)
class Layout:
    """Shapes and byte sizes of one page and one slot. Build with :meth:`of`."""

    page_tokens: int
    dtype: torch.dtype  # K/V and conv state
    pages: PageKind  # what a page holds (its shape: page_shape)
    delta_shape: tuple[int, ...]  # [linear layers, Hv, Dk, Dv], float32; () when stateless
    conv_shape: tuple[int, ...]  # [linear layers, C, K - 1]; () when stateless

    @classmethod
    def of(cls, config: ModelConfig, dtype: torch.dtype, page_tokens: int) -> Layout:
        """The layout of ``config``'s model on a backend computing in ``dtype``."""
        if page_tokens < 1:
            raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
        c = config
        pages = registry.of(c).page_kind().of(c, dtype, page_tokens)
        num_linear = sum(c.is_linear_layer(i) for i in range(c.num_hidden_layers))
        delta_shape: tuple[int, ...] = ()
        conv_shape: tuple[int, ...] = ()
        if num_linear:
            d = c.delta
            assert d is not None
            delta_shape = (num_linear, d.num_value_heads, d.key_head_dim, d.value_head_dim)
            conv_shape = (num_linear, d.conv_dim, d.conv_kernel_dim - 1)
        return cls(page_tokens, dtype, pages, delta_shape, conv_shape)

    @property
    def page_shape(self) -> tuple[int, ...]:
        return self.pages.page_shape

    @property
    def page_class(self) -> str:
        """The page kind's name: ``kv``, ``latent``, ``compressed`` (kern.models.pages)."""
        return self.pages.name

    @property
    def num_attention_layers(self) -> int:
        return self.pages.num_attention_layers

    @property
    def num_linear_layers(self) -> int:
        return self.delta_shape[0] if self.delta_shape else 0

    @property
    def stateful(self) -> bool:
        """Whether a sequence keeps a recurrent state (and so needs a slot)."""
        return bool(self.delta_shape)

    @property
    def windowed(self) -> bool:
        """Whether the page kind keeps window pages (in the slots)."""
        return self.pages.window_tokens > 0

    @property
    def has_slots(self) -> bool:
        """Whether the arena holds slots: recurrent states or window pages."""
        return self.stateful or self.windowed

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
        """Bytes of one slot: a recurrent state, or a window page (0: no slots)."""
        if self.windowed:
            return self.pages.window_bytes
        return self.delta_bytes + self.conv_bytes


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
