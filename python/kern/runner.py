"""The model runner: one forward pass over a ragged batch, KV in pages, states in slots.

Design notes
------------
* Memory the pool hands out by id lives here as two arenas, allocated once:
  - KV pages: ``kv_arena[num_pages, num_attention_layers, 2, Hk, page_tokens, D]``. A page is
    ``page_tokens`` positions of every attention layer's K and V, contiguous, so copying,
    parking or waking a page is one index copy of one row of the arena. Layer ``l`` reads and
    writes the strided view ``kv_arena[:, l]``; how K and V sit inside a page is the
    backend's choice (the CPU stores K transposed, see ``kern.models.attention``), so read
    positions through :meth:`Runner.kv_at`, not by indexing the arena.
  - State slots (stateful models): ``conv_states[num_slots, L_lin, C, K-1]`` (model dtype)
    and ``delta_states[num_slots, L_lin, Hv, Dk, Dv]`` (float32, as the delta rule keeps
    it), one row per slot across all linear layers for the same reason.
  Both are zero-filled: never-written rows are read (masked) by batched attention, and zeros
  cannot turn into NaN the way ``torch.empty``'s garbage can.
* ``forward`` builds the step's index tensors once (``kern.batch.build_step`` plus the
  backend's attention / recurrent plans) and every layer reads them. Logits are computed
  only for the rows that need them: the final norm and LM head run on those rows alone.
* A chunk at ``start_pos == 0`` starts a sequence: its slot is cleared first, so the
  scheduler never has to.
* Verify chunks of stateful models (``logits="all"``, see ``SeqChunk``) also record the state
  after each row; ``keep_rows(slot, n)`` rewinds the slot to the state after its first ``n``
  rows of the last forward. Attention KV needs no rewind: rejected positions are simply
  overwritten when the sequence gets there again.
* The backend (CPU torch float32 / CUDA Triton bf16) is chosen once, in ``kern.models.ops``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from kern.batch import SeqChunk, build_step, validate
from kern.checkpoint import Checkpoint
from kern.models import Caches, build_model
from kern.models.ops import make_ops

__all__ = ["Runner", "SeqChunk"]


class Runner:
    """Runs a checkpoint's model over paged KV and state slots on one device.

    ``num_pages`` KV pages of ``page_tokens`` positions each, and ``num_slots`` recurrent
    state slots (needed by stateful families, i.e. qwen3_5; ignored by others). ``dtype``
    defaults to the backend's (float32 on the CPU, bfloat16 on CUDA). ``reference=True``
    runs the kernels' torch references instead (CPU, float32; slow, for checking).
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        *,
        num_pages: int,
        page_tokens: int,
        num_slots: int = 0,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        reference: bool = False,
    ) -> None:
        if num_pages < 1 or page_tokens < 1:
            raise ValueError("num_pages and page_tokens must be positive")
        self.ops = make_ops(device, reference=reference)
        if dtype is not None and dtype != self.ops.dtype:
            raise ValueError(f"the {self.ops.device.type} backend runs {self.ops.dtype}")
        self.config = c = checkpoint.config
        self.model = build_model(self.ops, c, checkpoint.tensors)
        self.device = self.ops.device
        self.dtype = self.ops.dtype
        self.page_tokens = page_tokens
        self.num_pages = num_pages
        self.stateful = self.model.stateful
        self.num_slots = num_slots if self.stateful else 0
        if self.stateful and num_slots < 1:
            raise ValueError(f"{c.model_type} keeps a recurrent state: num_slots must be >= 1")
        self.kv_arena = torch.zeros(
            num_pages,
            self.model.num_attention_layers,
            2,
            c.num_key_value_heads,
            page_tokens,
            c.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self._kv = [self.kv_arena[:, i] for i in range(self.model.num_attention_layers)]
        self.conv_states: Tensor | None = None
        self.delta_states: Tensor | None = None
        num_linear = self.model.num_linear_layers
        if self.stateful and num_linear:
            conv_dim = (
                2 * c.linear_num_key_heads * c.linear_key_head_dim
                + c.linear_num_value_heads * c.linear_value_head_dim
            )
            self.conv_states = torch.zeros(
                num_slots,
                num_linear,
                conv_dim,
                c.linear_conv_kernel_dim - 1,
                dtype=self.dtype,
                device=self.device,
            )
            self.delta_states = torch.zeros(
                num_slots,
                num_linear,
                c.linear_num_value_heads,
                c.linear_key_head_dim,
                c.linear_value_head_dim,
                dtype=torch.float32,
                device=self.device,
            )
        self._row_states: dict[int, tuple[int, int]] = {}  # slot -> (first row, num rows)
        self._row_conv: Tensor | None = None
        self._row_delta: Tensor | None = None

    @property
    def page_bytes(self) -> int:
        """Bytes of one KV page (every attention layer's K and V)."""
        return self.kv_arena[0].numel() * self.kv_arena.element_size()

    @property
    def slot_bytes(self) -> int:
        """Bytes of one state slot (0 for a stateless model)."""
        if self.conv_states is None or self.delta_states is None:
            return 0
        return (
            self.conv_states[0].numel() * self.conv_states.element_size()
            + self.delta_states[0].numel() * self.delta_states.element_size()
        )

    @torch.inference_mode()
    def forward(self, batch: Sequence[SeqChunk]) -> Tensor:
        """Run one step; returns float32 logits [num_logit_rows, vocab], rows in batch order
        (per chunk: its last row for ``"last"``, every row for ``"all"``, none for
        ``"none"``).

        Mutates: writes each chunk's K/V at its positions through its block table and, for
        stateful models, replaces each chunk's slot state with the state after its rows.
        Raises ``ValueError`` for a malformed batch (before touching any memory).
        """
        validate(batch, self.page_tokens, self.num_pages, self.stateful, self.num_slots)
        step = build_step(batch, self.page_tokens, self.device)
        c = self.config
        attention = None
        if self.model.num_attention_layers:
            attention = self.ops.plan_attention(
                step, self.kv_arena, c.num_attention_heads // c.num_key_value_heads
            )
        caches = Caches(self._kv, [], [])
        recurrent = None
        self._row_states = {}
        if self.conv_states is not None and self.delta_states is not None:
            slots = [ch.slot for ch in batch]
            fresh = [ch.slot for ch in batch if ch.start_pos == 0]
            if fresh:
                idx = torch.tensor(fresh, device=self.device)
                self.conv_states[idx] = 0
                self.delta_states[idx] = 0
            verify = [b for b, ch in enumerate(batch) if ch.logits == "all"]
            recurrent, first = self.ops.plan_recurrent(
                step, slots, verify, c.linear_conv_kernel_dim
            )
            num_linear = self.model.num_linear_layers
            caches.conv = [self.conv_states[:, i] for i in range(num_linear)]
            caches.delta = [self.delta_states[:, i] for i in range(num_linear)]
            if verify:
                num_rows = sum(step.q_lens[b] for b in verify)
                self._row_conv = self.conv_states.new_empty(num_rows, *self.conv_states.shape[1:])
                self._row_delta = self.delta_states.new_empty(
                    num_rows, *self.delta_states.shape[1:]
                )
                caches.conv_snap = [self._row_conv[:, i] for i in range(num_linear)]
                caches.delta_snap = [self._row_delta[:, i] for i in range(num_linear)]
                self._row_states = {slots[b]: (first[b], step.q_lens[b]) for b in verify}
        rope = self.ops.plan_rope(step.positions, c.rope_theta, c.rotary_dim)
        step = replace(step, rope=rope, attention=attention, recurrent=recurrent)
        hidden = self.model.forward(step, caches)
        return self.model.logits(hidden[step.logit_rows])

    def keep_rows(self, slot: int, num_rows: int) -> None:
        """After a forward in which ``slot``'s chunk verified R rows (``logits="all"``), set
        its state to the state after its first ``num_rows`` rows (1 <= num_rows <= R).

        Mutates the slot. Valid only until the next ``forward``; raises ``KeyError`` when the
        last forward kept no row states for ``slot``, ``ValueError`` for a bad count.
        """
        if slot not in self._row_states:
            raise KeyError(f"the last forward kept no row states for slot {slot}")
        first, rows = self._row_states[slot]
        if not 1 <= num_rows <= rows:
            raise ValueError(f"num_rows must be in [1, {rows}], got {num_rows}")
        assert self._row_conv is not None and self._row_delta is not None
        assert self.conv_states is not None and self.delta_states is not None
        self.conv_states[slot] = self._row_conv[first + num_rows - 1]
        self.delta_states[slot] = self._row_delta[first + num_rows - 1]

    def copy_pages(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy whole KV pages ``src[i] -> dst[i]`` (every layer), as one index copy.

        For copy-on-write of a partly filled prefix page. Mutates ``dst`` pages; ``dst`` must
        not repeat and must not overlap ``src``.
        """
        if len(src) != len(dst):
            raise ValueError("src and dst differ in length")
        if not src:
            return
        s = torch.tensor(list(src), device=self.device)
        d = torch.tensor(list(dst), device=self.device)
        self.kv_arena[d] = self.kv_arena[s]

    def copy_slots(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy recurrent states ``src[i] -> dst[i]`` (state snapshots). Mutates ``dst``
        slots; a no-op for stateless models."""
        if len(src) != len(dst):
            raise ValueError("src and dst differ in length")
        if not src or self.conv_states is None or self.delta_states is None:
            return
        s = torch.tensor(list(src), device=self.device)
        d = torch.tensor(list(dst), device=self.device)
        self.conv_states[d] = self.conv_states[s]
        self.delta_states[d] = self.delta_states[s]

    def kv_at(self, block_table: Sequence[int], positions: Sequence[int]) -> Tensor:
        """A copy of the K/V at ``positions`` of a sequence: [n, layers, 2, Hk, D]."""
        pos = torch.tensor(list(positions), device=self.device)
        pages = torch.tensor(list(block_table), device=self.device)[pos // self.page_tokens]
        offsets = pos % self.page_tokens
        out = []
        for layer in self._kv:
            k, v = self.ops.kv_views(layer)
            out.append(torch.stack([k[pages, offsets], v[pages, offsets]], dim=1))
        return torch.stack(out, dim=1)

    def read_pages(self, pages: Sequence[int]) -> Tensor:
        """A copy of KV pages ``pages`` ([n, layers, 2, page_tokens, Hk, D]); for parking."""
        return self.kv_arena[torch.tensor(list(pages), device=self.device)].clone()

    def write_pages(self, pages: Sequence[int], data: Tensor) -> None:
        """Land ``data`` (as from :meth:`read_pages`) in KV pages ``pages``; for waking."""
        self.kv_arena[torch.tensor(list(pages), device=self.device)] = data.to(self.kv_arena)
