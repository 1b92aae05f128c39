"""Which slice of each weight a rank holds, how a rank reads only that slice, and the model
around it: the collectives that join the ranks' partial results.

Design notes
------------
* What a parallel mode splits is the family's registry row (``Family.parallel``: ``HEADS``,
  ``EXPERTS``, ``EXPERTS_ONLY``); the families named below are today's rows.
* ``tp`` (tensor parallel; ``qwen3``, ``qwen3_moe``, ``qwen3_5``): rank r of N holds
  attention heads ``[r * H / N, (r + 1) * H / N)`` (q, k, v rows and the matching ``o_proj``
  columns; the KV heads likewise, so each rank's KV pages hold Hk / N heads) and MLP columns
  ``[r * I / N, (r + 1) * I / N)`` (gate and up rows, ``down_proj`` columns); a
  ``qwen3_moe`` expert's columns are split the same way. ``qwen3_5``'s DeltaNet layers split
  by key and value heads (q, k and v of ``in_proj_qkv`` and of the conv each by heads; z, a,
  b, ``dt_bias`` and ``A_log`` by value heads; ``out_proj`` columns), so each rank's state
  slots hold its own heads' states. ``o_proj``, ``out_proj`` and ``down_proj`` then give each
  rank a partial sum; one collective per mixer and one per MLP joins them.
* ``ep`` (expert parallel; ``qwen3_moe``): attention and any dense MLP as in ``tp``; rank r
  holds experts ``e`` with ``e % N == r``, whole. Every rank holds every token (attention
  leaves the hidden states the same on all ranks), so nothing is dispatched: each rank runs
  its experts on the tokens routed to them and leaves zeros in the other top-k slots; an
  all-reduce of those [T, k, hidden] slot outputs is exact (every element is one rank's value
  plus zeros), and each rank then adds a token's slots in slot order, as one rank does. The
  expert layers of ``ep`` therefore give the bits a single rank gives; only attention and
  dense layers change the order of additions.
* ``ep`` for ``deepseek_v3``: latent attention, the dense MLPs and the shared experts are
  replicated, whole, on every rank (each rank computes them on every token and caches the
  same latents: the latent is one vector a token, so splitting heads would save no cache),
  and only the routed experts are split as above. No partial sum is left anywhere but in
  the experts' disjoint slots, so every layer gives exactly the bits one rank gives.
  ``kimi_linear`` likewise: its delta attention is replicated too, every rank keeping every
  sequence's whole state in its own slots (the same slot ids on every rank); and
  ``deepseek_v4``, whose compressed pages every rank holds whole.
* Partial sums are joined by an all-gather and a sum in rank order, ``((p0 + p1) + p2) + ...``,
  not by an all-reduce: an all-reduce's order of additions is the library's choice and may
  depend on the message size (so on the batch) beyond 2 ranks; a fixed order keeps a row's
  bits independent of its batch within one rank count. At 2 ranks both move the same bytes.
* The embedding and the norms are replicated; only rank 0 computes logits, so the LM head
  (when not tied to the embedding) is read by rank 0 alone, and the other ranks' models have
  no head (:class:`Headless`).
* Each rank reads its slices with safetensors' ``get_slice``: no rank materialises a weight
  it does not hold.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from kern.checkpoint.config import load_config
from kern.checkpoint.errors import MissingFileError
from kern.checkpoint.load import (
    Checkpoint,
    Part,
    eos_token_ids,
    index_tensors,
    parse_dtype,
    read_tensors,
    validate,
)
from kern.models import registry
from kern.models.config import ModelConfig
from kern.models.layers.moe import SparseMoE
from kern.tokenizer import Tokenizer

__all__ = [
    "Comm",
    "Headless",
    "Shard",
    "ShardError",
    "check_shard",
    "load_shard",
    "shard_model",
]

# The parallel modes kern implements (what each splits is the family's registry row).
MODES = ("tp", "ep")


def _experts_only(c: ModelConfig, parallel: str) -> bool:
    """Whether ``c``'s ``parallel`` shards split only the routed experts (everything else
    replicated)."""
    return registry.of(c).parallel.get(parallel) == registry.EXPERTS_ONLY


class ShardError(ValueError):
    """A model cannot be split as asked (a family or a size that does not divide)."""


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank ``rank`` of ``num_ranks``, split as ``parallel`` says ("tp" or "ep")."""

    rank: int
    num_ranks: int
    parallel: str

    def check(self, c: ModelConfig) -> None:
        """Raise :class:`ShardError` naming what does not split (see the notes)."""
        n = self.num_ranks
        if self.parallel not in MODES:
            raise ShardError(f"parallel = {self.parallel!r}: kern implements 'tp' and 'ep'")
        if self.parallel not in registry.of(c).parallel:
            families = registry.splitting(self.parallel)
            raise ShardError(
                f"parallel = {self.parallel!r} is implemented for {', '.join(families)}, "
                f"not {c.model_type}"
            )
        experts = c.experts.num_experts if c.experts is not None else 0
        if _experts_only(c, self.parallel):
            if experts % n:
                raise ShardError(
                    f"ranks = {n} does not divide the model's n_routed_experts ({experts})"
                )
            return
        sizes = {
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
        }
        if any(not c.is_sparse_layer(i) for i in range(c.num_hidden_layers)):
            sizes["intermediate_size"] = c.intermediate_size
        if c.experts is not None and self.parallel == "tp":
            sizes["moe_intermediate_size"] = c.experts.moe_intermediate_size
        if c.experts is not None and self.parallel == "ep":
            sizes["num_experts"] = c.experts.num_experts
        if c.delta is not None:
            sizes["linear_num_key_heads"] = c.delta.num_key_heads
            sizes["linear_num_value_heads"] = c.delta.num_value_heads
        for key, value in sizes.items():
            if value % n:
                raise ShardError(f"ranks = {n} does not divide the model's {key} ({value})")

    def config(self, c: ModelConfig) -> ModelConfig:
        """This rank's view of the model: heads and MLP widths divided by the rank count."""
        n = self.num_ranks
        if _experts_only(c, self.parallel):
            return c
        changes: dict[str, Any] = {
            "num_attention_heads": c.num_attention_heads // n,
            "num_key_value_heads": c.num_key_value_heads // n,
            "intermediate_size": c.intermediate_size // n,
        }
        if self.parallel == "tp" and c.experts is not None:
            inner = c.experts.moe_intermediate_size // n
            changes["experts"] = dataclasses.replace(c.experts, moe_intermediate_size=inner)
        if c.delta is not None:
            changes["delta"] = dataclasses.replace(
                c.delta,
                num_key_heads=c.delta.num_key_heads // n,
                num_value_heads=c.delta.num_value_heads // n,
            )
        return dataclasses.replace(c, **changes)

    def owns_expert(self, expert: int) -> bool:
        return self.parallel != "ep" or expert % self.num_ranks == self.rank

    def part(self, c: ModelConfig, name: str, shape: tuple[int, ...]) -> list[Part] | None:
        """The slices of tensor ``name`` this rank reads, each (dim, start, stop), to be
        concatenated along that dim; None for the whole tensor. Raises ``KeyError`` for a
        tensor it does not read at all."""
        n, r = self.num_ranks, self.rank
        if name == registry.of(c).head and r != 0:
            raise KeyError(name)
        parts = name.split(".")
        if "experts" in parts:
            expert = int(parts[parts.index("experts") + 1])
            if not self.owns_expert(expert):
                raise KeyError(name)
            if self.parallel == "ep":
                return None
        if _experts_only(c, self.parallel):
            return None
        leaf = ".".join(parts[-2:])
        if leaf in _ROWS or leaf in _LINEAR_ROWS:
            # Rows: whole heads (a q row block of a head is contiguous, its gate included),
            # MLP columns, or DeltaNet value heads (one row or value each).
            rows = shape[0] // n
            return [(0, r * rows, (r + 1) * rows)]
        if leaf in ("in_proj_qkv.weight", "conv1d.weight"):
            # q, k (key heads) then v (value heads), each split by heads.
            assert c.delta is not None
            key_dim = c.delta.num_key_heads * c.delta.key_head_dim
            value_dim = c.delta.num_value_heads * c.delta.value_head_dim
            out = []
            for start, width in ((0, key_dim), (key_dim, key_dim), (2 * key_dim, value_dim)):
                w = width // n
                out.append((0, start + r * w, start + (r + 1) * w))
            return out
        if leaf in _COLUMNS:
            cols = shape[1] // n
            return [(1, r * cols, (r + 1) * cols)]
        return None


_ROWS = {
    f"{proj}.{kind}"
    for proj in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    for kind in ("weight", "bias")
} | {"in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"}
_LINEAR_ROWS = {"linear_attn.dt_bias", "linear_attn.A_log"}
_COLUMNS = {"o_proj.weight", "down_proj.weight", "out_proj.weight"}


def check_shard(path: str | Path, shard: Shard) -> None:
    """What :func:`load_shard` checks before reading any data: the config, that the model
    splits, and every tensor's name and shape (from the safetensors headers)."""
    path = Path(path)
    if not path.is_dir():
        raise MissingFileError(f"{path}: no such checkpoint folder")
    full = load_config(path)
    shard.check(full)
    validate(path, full, index_tensors(path, full))


def load_shard(
    path: str | Path,
    shard: Shard,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    progress: bool = False,
) -> Checkpoint:
    """Read this rank's slices of the checkpoint at ``path`` (validated as
    :func:`kern.checkpoint.load_checkpoint` validates the whole): a :class:`Checkpoint` whose
    config is the rank's (:meth:`Shard.config`) and whose tensors are its slices.

    ``o_proj.bias`` is added once: rank 0 holds it, the others zeros. Raises what
    ``load_checkpoint`` raises, and :class:`ShardError`.
    """
    path = Path(path)
    if not path.is_dir():
        raise MissingFileError(f"{path}: no such checkpoint folder")
    dtype = parse_dtype(dtype)
    full = load_config(path)
    shard.check(full)
    entries = index_tensors(path, full)
    validate(path, full, entries)
    tokenizer = Tokenizer.from_dir(path, extra_eos_token_ids=eos_token_ids(path, full))
    wanted: dict[str, Any] = {}
    parts: dict[str, list[Part] | None] = {}
    for name, entry in entries.items():
        try:
            parts[name] = shard.part(full, name, entry.shape)
        except KeyError:
            continue
        wanted[name] = entry
    tensors = read_tensors(
        wanted,
        device=device,
        dtype=dtype,
        desc=f"loading {path.name} (rank 0 of {shard.num_ranks})",
        progress=progress,
        pick=parts.__getitem__,
    )
    if shard.rank != 0:
        split = not _experts_only(full, shard.parallel)  # else every rank adds its whole bias
        for name in [k for k in tensors if split and k.endswith("o_proj.bias")]:
            tensors[name] = torch.zeros_like(tensors[name])
        if not full.tie_word_embeddings:
            # Only rank 0 computes logits (Headless): the head the model is built with here
            # is one row, never multiplied.
            tensors[registry.of(full).head] = torch.zeros(1, full.hidden_size, dtype=dtype)
    return Checkpoint(path=path, config=shard.config(full), tensors=tensors, tokenizer=tokenizer)


class Comm:
    """The collectives a sharded model calls, over ``group``, with the time spent in them
    (``seconds``, read by the benchmark; on CUDA it includes waiting for queued kernels)."""

    def __init__(self, group: Any, num_ranks: int) -> None:
        self.group = group
        self.num_ranks = num_ranks
        self.seconds = 0.0
        self.calls = 0

    def sum_partials(self, x: Tensor) -> Tensor:
        """Every rank's ``x`` added in rank order (see the notes); the same bits on every rank."""
        t0 = time.perf_counter()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.num_ranks)]
        dist.all_gather(parts, x, group=self.group)
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return out

    def sum_disjoint(self, y: Tensor) -> Tensor:
        """The sum of tensors in which each element is nonzero on at most one rank: exact in
        any order, so an all-reduce (in place)."""
        t0 = time.perf_counter()
        y = y.contiguous()
        dist.all_reduce(y, group=self.group)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return y


class _Joined:
    """A mixer or MLP whose per-rank partial outputs are summed across ranks."""

    def __init__(self, inner: Any, comm: Comm) -> None:
        self.inner = inner
        self.comm = comm

    def __call__(self, x: Tensor, *args: Any) -> Tensor:
        return self.comm.sum_partials(self.inner(x, *args))


class _ExpertParallel:
    """A sparse MoE layer over this rank's experts (see the notes)."""

    def __init__(self, moe: SparseMoE, comm: Comm) -> None:
        self.moe = moe
        self.comm = comm

    def __call__(self, x: Tensor, *args: Any) -> Tensor:
        weights, experts = self.moe.route(x, *args)  # deepseek_v4's hash layers: token ids
        y = self.comm.sum_disjoint(self.moe.expert_outputs(x, experts))
        out = self.moe.combine(y, weights)
        shared = getattr(self.moe, "shared", None)  # DeepSeek's, replicated on every rank
        return out if shared is None else out + shared(x)


class Headless:
    """A model on a rank other than 0: the layers, no logits (rank 0 computes them)."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def logits(self, hidden: Tensor) -> Tensor:
        return hidden.new_empty(hidden.shape[0], 0, dtype=torch.float32)


def shard_model(model: Any, shard: Shard, comm: Comm) -> Any:
    """Join ``model``'s layers (built from a rank's shard) across the ranks, in place; on
    ranks other than 0 return it :class:`Headless`."""
    replicated = _experts_only(model.config, shard.parallel)
    for layer in model.layers:
        if not replicated:
            layer.mixer = _Joined(layer.mixer, comm)
        if isinstance(layer.mlp, SparseMoE) and shard.parallel == "ep":
            layer.mlp = _ExpertParallel(layer.mlp, comm)
        elif not replicated:
            layer.mlp = _Joined(layer.mlp, comm)
    return model if shard.rank == 0 else Headless(model)
