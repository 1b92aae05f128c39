"""Checkpoint loading: a Hugging Face folder to a config, a tokenizer and named tensors.

Design notes
------------
* safetensors only. A pickle (``pytorch_model.bin``, ``*.pt``) runs code when it is loaded, so a
  folder that has only those is refused with an error that says how to convert it.
* Every tensor is checked before any is read: names and shapes come from the safetensors
  headers (``get_slice(...).get_shape()`` reads no data), and are compared with
  :func:`expected_shapes` for the family. A missing, misshapen or unexpected tensor fails the
  load in well under a second even for a 100 GB checkpoint, instead of after the data is read
  or, worse, as a shape error deep inside the first forward pass.
* Names are the ``*ForCausalLM`` names of transformers (``model.layers.0.self_attn.q_proj.weight``,
  ``lm_head.weight``). A multimodal Qwen3.5 checkpoint stores its language model under
  ``model.language_model.``; that prefix is removed, and the vision tower (``model.visual.``)
  and multi-token-prediction head (``mtp.``) are skipped without being read, as transformers'
  ``Qwen3_5ForCausalLM`` skips them. Mixture-of-experts weights are the per-expert tensors of
  the published files (``mlp.experts.3.gate_proj.weight``), not transformers' fused in-memory
  layout; a family whose releases store them fused (Qwen3.5-MoE's ``mlp.experts.gate_up_proj``)
  names the pieces (``Family.split_stored``), and each piece reads only its own rows.
* With tied embeddings there is no ``lm_head.weight`` to require: the runner multiplies by
  ``model.embed_tokens.weight``. A tied file that carries one anyway is checked and loaded.
* Quantised weights are dequantised at load, in float32, then cast: block-scaled FP8
  (DeepSeek's ``weight_scale_inv``, or the V4 release's ``.scale``, float32 or e8m0) and
  DeepSeek-V4's FP4 routed experts (int8 bytes of two e2m1 values, low nibble first, with an
  e8m0 scale per 32 inputs), exactly as transformers' FP8 loader reads them. Integer
  tensors (V4's ``tid2eid``) are read as int64, whatever ``dtype`` says.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from kern.checkpoint.config import load_config
from kern.checkpoint.entries import FLOAT_DTYPES as _FLOAT_DTYPES
from kern.checkpoint.entries import FP4 as _FP4
from kern.checkpoint.entries import FP8 as _FP8
from kern.checkpoint.entries import INT_DTYPES as _INT_DTYPES
from kern.checkpoint.entries import Entry as _Entry
from kern.checkpoint.entries import dequantize as _dequantize
from kern.checkpoint.entries import num_bytes as _num_bytes
from kern.checkpoint.entries import pair_scales as _pair_scales
from kern.checkpoint.entries import read_stored as _read_stored
from kern.checkpoint.errors import (
    CheckpointError,
    MissingFileError,
    MissingShardError,
    MissingTensorError,
    PickleCheckpointError,
    TensorError,
    TensorShapeError,
    UnexpectedTensorError,
)
from kern.checkpoint.names import (
    canonical_name,
    expected_shapes,
    head_name,
    integer_tensor,
    mtp_shapes,
    split_stored,
)
from kern.models import registry
from kern.models.config import ModelConfig
from kern.tokenizer import Tokenizer

__all__ = [
    "DTYPES",
    "Checkpoint",
    "Part",
    "eos_token_ids",
    "index_tensors",
    "load_checkpoint",
    "parse_dtype",
    "read_tensors",
    "sampling_defaults",
    "validate",
]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# (dim, start, stop) of a stored tensor: the rows (dim 0) or columns (dim 1) a reader takes.
Part = tuple[int, int, int]

_INDEX = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True, eq=False)
class Checkpoint:
    """A loaded checkpoint. ``tensors`` maps transformers' ``*ForCausalLM`` names to tensors,
    already cast to the requested dtype and on the requested device. The runner may keep
    references to the tensors; nothing here mutates them after loading."""

    path: Path
    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """``torch.float32`` or one of the names in :data:`DTYPES`; raises ``ValueError``."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported ({', '.join(DTYPES)})")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported ({', '.join(DTYPES)})")
    return DTYPES[dtype]


def load_checkpoint(
    path: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    progress: bool | None = None,
    mtp: bool = False,
) -> Checkpoint:
    """Load a checkpoint folder: ``config.json``, ``*.safetensors``, ``tokenizer.json``.

    Every tensor is validated against :func:`expected_shapes` before any data is read, then
    cast to ``dtype`` and placed on ``device`` (block-scaled FP8 weights are dequantised in
    float32 first). ``progress`` shows a progress bar on stderr; None shows it only when
    stderr is a terminal. ``mtp`` also reads (and requires) the checkpoint's
    multi-token-prediction layers, which are otherwise skipped unread.

    Raises :class:`~kern.checkpoint.errors.CheckpointError` subclasses naming the file and what
    was expected: :class:`~kern.checkpoint.errors.MissingFileError`, :class:`MissingShardError`,
    :class:`PickleCheckpointError`, :class:`MissingTensorError`,
    :class:`UnexpectedTensorError`, :class:`TensorShapeError`, :class:`TensorError`, and those
    of :func:`~kern.checkpoint.config.load_config`.
    """
    path = Path(path)
    if not path.is_dir():
        raise MissingFileError(f"{path}: no such checkpoint folder")
    dtype = parse_dtype(dtype)
    config = load_config(path)
    entries = index_tensors(path, config, mtp)
    validate(path, config, entries, mtp)
    tokenizer = Tokenizer.from_dir(path, extra_eos_token_ids=eos_token_ids(path, config))

    if progress is None:
        progress = sys.stderr.isatty()
    tensors = read_tensors(
        entries, device=device, dtype=dtype, desc=f"loading {path.name}", progress=progress
    )
    return Checkpoint(path=path, config=config, tensors=tensors, tokenizer=tokenizer)


def read_tensors(
    entries: Mapping[str, _Entry],
    *,
    device: str | torch.device,
    dtype: torch.dtype,
    desc: str,
    progress: bool,
    pick: Callable[[str], Sequence[Part] | None] | None = None,
) -> dict[str, torch.Tensor]:
    """Read the tensors of ``entries`` (validated), each cast to ``dtype`` on ``device``,
    file by file; a progress bar of ``desc`` on stderr when ``progress``. ``pick(name)``
    gives the parts of a tensor to read, joined along their dim (a rank's slices, read with
    ``get_slice`` so nothing else is materialised); None, or no ``pick``, reads it whole."""
    by_file: dict[Path, list[tuple[str, _Entry]]] = {}
    for name, entry in entries.items():
        by_file.setdefault(entry.file, []).append((name, entry))
    tensors: dict[str, torch.Tensor] = {}
    with tqdm(
        total=sum(_num_bytes(e) for e in entries.values()),
        unit="B",
        unit_scale=True,
        desc=desc,
        disable=not progress,
        file=sys.stderr,
        leave=False,
    ) as bar:
        for file in sorted(by_file):
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for name, entry in by_file[file]:
                    parts = None if pick is None else pick(name)
                    if entry.scale is not None or entry.piece is not None:
                        t = _whole(f, entry)
                        if parts is not None:
                            pieces = [t[a:b] if d == 0 else t[:, a:b] for d, a, b in parts]
                            t = torch.cat(pieces, dim=parts[0][0])
                    elif parts is None:
                        t = f.get_tensor(entry.stored_name)
                    else:
                        view = f.get_slice(entry.stored_name)
                        pieces = [view[a:b] if dim == 0 else view[:, a:b] for dim, a, b in parts]
                        t = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=parts[0][0])
                    integer = entry.dtype in _INT_DTYPES and entry.scale is None
                    tensors[name] = t.long() if integer else t.to(dtype)
                    bar.update(_num_bytes(entry))
    return tensors


def _whole(f: Any, entry: _Entry) -> torch.Tensor:
    """A fused tensor's piece (only its rows are read), a quantised tensor dequantised, or
    both (gpt-oss's MXFP4 experts)."""
    t = _read_stored(f, entry)
    return t if entry.scale is None else _dequantize(t, entry, f)


def _weight_files(path: Path) -> tuple[list[Path], dict[str, str] | None, Path | None]:
    """The safetensors files to read, and the index's weight map if the folder is sharded."""
    index_file = path / _INDEX
    if index_file.is_file():
        try:
            index = json.loads(index_file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index_file}: not valid JSON: {e}") from e
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise CheckpointError(f"{index_file}: expected a 'weight_map' of tensor name -> file")
        files = []
        for shard in sorted(set(weight_map.values())):
            file = path / shard
            if Path(shard).name != shard:
                raise CheckpointError(f"{index_file}: shard {shard!r} is not a file in the folder")
            if not file.is_file():
                raise MissingShardError(f"{index_file} names shard {shard!r}, which is missing")
            files.append(file)
        return files, weight_map, index_file
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files, None, None
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise PickleCheckpointError(
            f"{path}: has only pickled weights ({', '.join(pickles)}); kern reads safetensors "
            "only, because loading a pickle runs arbitrary code. Convert the checkpoint with "
            "transformers: AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT)."
        )
    raise MissingFileError(f"{path}: no *.safetensors files (nor {_INDEX})")


def index_tensors(path: Path, config: ModelConfig, mtp: bool = False) -> dict[str, _Entry]:
    """Name -> where it is stored, from the safetensors headers alone (no data is read);
    an FP8 weight's entry carries its scales'. ``mtp``: read the MTP layers' too."""
    files, weight_map, index_file = _weight_files(path)
    entries: dict[str, _Entry] = {}
    for file in files:
        try:
            f_ctx = safe_open(str(file), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises SafetensorError, a bare Exception subclass
            raise CheckpointError(f"{file}: not a valid safetensors file: {e}") from e
        with f_ctx as f:
            for stored in f.keys():
                if weight_map is not None and weight_map.get(stored) != file.name:
                    # The index is the authority on where a tensor lives; a stray copy in
                    # another shard would otherwise be read depending on file order.
                    continue
                name = canonical_name(config, stored, mtp)
                if name is None:
                    continue
                if name in entries:
                    raise CheckpointError(
                        f"{file}: tensor {stored!r} is also stored in {entries[name].file.name}"
                    )
                view = f.get_slice(stored)
                entry = _Entry(file, stored, tuple(view.get_shape()), view.get_dtype())
                for piece_name, piece in _pieces(config, name, entry):
                    if piece_name in entries:
                        raise CheckpointError(
                            f"{file}: tensor {stored!r} holds {piece_name!r}, which is also "
                            f"stored as {entries[piece_name].stored_name!r}"
                        )
                    entries[piece_name] = piece
    if weight_map is not None:
        found = {e.stored_name for e in entries.values()}
        for stored, shard in sorted(weight_map.items()):
            if stored not in found and canonical_name(config, stored, mtp) is not None:
                raise MissingTensorError(
                    f"{index_file} says tensor {stored!r} is in {shard}, but it is not there"
                )
    return _pair_scales(config, entries)


def _pieces(config: ModelConfig, name: str, entry: _Entry) -> list[tuple[str, _Entry]]:
    """The stored tensor ``entry`` as kern's tensors: itself, or a fused tensor's pieces
    (its shape checked here: the pieces' shapes follow from it)."""
    split = split_stored(config, name)
    if split is None:
        return [(name, entry)]
    want, pieces = split
    if entry.shape != want:
        raise TensorShapeError(
            f"{entry.file}: tensor {entry.stored_name!r} has shape {list(entry.shape)}, "
            f"expected {list(want)} from config.json"
        )
    rest = entry.shape[2:]
    out = []
    for piece_name, (index, start, stop, *transposed) in pieces:
        shape = (stop - start, math.prod(rest)) if len(rest) > 1 else (stop - start, *rest)
        flip = bool(transposed and transposed[0])
        piece = replace(entry, shape=shape[::-1] if flip else shape, piece=(index, start, stop))
        out.append((piece_name, replace(piece, transposed=flip)))
    return out


def validate(
    path: Path, config: ModelConfig, entries: dict[str, _Entry], mtp: bool = False
) -> None:
    expected = expected_shapes(config)
    optional: dict[str, tuple[int, ...]] = {}
    if config.tie_word_embeddings:
        optional[head_name(config)] = (config.vocab_size, config.hidden_size)
    if mtp:
        if not config.num_mtp_layers:
            raise MissingTensorError(
                f"{path}: config.json has no multi-token-prediction layer "
                "(num_nextn_predict_layers is 0): nothing to draft with"
            )
        shapes, may_lack = mtp_shapes(config)
        expected.update({k: v for k, v in shapes.items() if k not in may_lack})
        optional.update({k: shapes[k] for k in may_lack})
    where = f"{path} ({config.model_type}, {config.num_hidden_layers} layers)"

    missing = sorted(set(expected) - set(entries))
    if missing:
        raise MissingTensorError(
            f"{where}: {len(missing)} tensor(s) missing, e.g. {_names(missing)}; "
            f"expected shape of {missing[0]!r}: {list(expected[missing[0]])}"
        )
    unexpected = sorted(set(entries) - set(expected) - set(optional))
    if unexpected:
        first = entries[unexpected[0]]
        raise UnexpectedTensorError(
            f"{where}: {len(unexpected)} tensor(s) that config.json does not describe, e.g. "
            f"{_names(unexpected)} (in {first.file.name}); is config.json for these weights?"
        )
    for name, entry in sorted(entries.items()):
        integer = integer_tensor(config, name)
        if integer != (entry.dtype in _INT_DTYPES and entry.scale is None) or (
            not integer and entry.dtype not in _FLOAT_DTYPES and entry.scale is None
        ):
            kinds = (
                "an integer tensor"
                if integer
                else f"floating-point weights only ({', '.join(_FLOAT_DTYPES)}, block-scaled "
                f"{_FP8} and, for {_fp4_families()} routed experts, FP4 in {_FP4})"
            )
            raise TensorError(
                f"{entry.file}: tensor {entry.stored_name!r} has dtype {entry.dtype}; kern "
                f"loads {kinds} there"
            )
        want = expected.get(name, optional.get(name))
        if entry.shape != want:
            raise TensorShapeError(
                f"{entry.file}: tensor {entry.stored_name!r} has shape {list(entry.shape)}, "
                f"expected {list(want)} from config.json"
            )


def _fp4_families() -> str:
    """The families whose routed experts may be FP4, as an error message names them."""
    return " and ".join(f"{name}'s" for name in registry.with_fp4())


def _names(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def eos_token_ids(path: Path, config: ModelConfig) -> list[int]:
    """End-of-sequence ids from config.json and generation_config.json (optional)."""
    ids = list(config.eos_token_ids)
    file = path / "generation_config.json"
    if file.is_file():
        try:
            gen: Any = json.loads(file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{file}: not valid JSON: {e}") from e
        value = gen.get("eos_token_id") if isinstance(gen, dict) else None
        values = value if isinstance(value, list) else [] if value is None else [value]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise CheckpointError(f"{file}: field 'eos_token_id' must hold token ids")
        ids.extend(values)
    return ids


def sampling_defaults(checkpoint: Path) -> dict[str, float]:
    """The sampling parameters a checkpoint's generation_config.json sets, by kern's names
    (vLLM serves these as the defaults of a request that leaves them unset). A file that is
    missing or unreadable sets none; values of the wrong type are left out."""
    file = Path(checkpoint) / "generation_config.json"
    try:
        gen = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(gen, dict):
        return {}
    out: dict[str, float] = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = gen.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = value
    if gen.get("do_sample") is False:
        out["temperature"] = 0.0  # the checkpoint decodes greedily by default
    return out
