"""Every family kern runs, one row each: what a checkpoint of it is (model types, config
reader, tensor names and shapes) and what it can do (page kind, parallel splits, drafters, CUDA
graphs). The loader, the sharding, the CUDA graphs, the drafter checks and ``kern test`` ask
a row; nothing outside ``kern.models`` names a family.

Design notes
------------
* Torch-free: the config readers and tensor tables a row names are plain functions
  (``kern.models.<family>.config``, ``.tensors``), and the model, its page kind, its MTP
  layer and its tiny checkpoint writer are named as ``"module:attribute"`` and imported only
  when asked for (vLLM's registry does the same), so reading a ``config.json`` imports no
  torch.
* Adding a family is a folder under ``kern/models/`` and a row here (docs/families.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kern.checkpoint.fields import Fields
from kern.models import shapes
from kern.models.config import ModelConfig
from kern.models.deepseek_v3 import config as deepseek_v3
from kern.models.deepseek_v3 import tensors as deepseek_v3_tensors
from kern.models.deepseek_v4 import config as deepseek_v4
from kern.models.deepseek_v4 import tensors as deepseek_v4_tensors
from kern.models.gpt_oss import config as gpt_oss
from kern.models.kimi_linear import config as kimi_linear
from kern.models.kimi_linear import tensors as kimi_linear_tensors
from kern.models.qwen3 import config as qwen3
from kern.models.qwen3_5 import config as qwen3_5
from kern.models.qwen3_5_moe import config as qwen3_5_moe
from kern.models.qwen3_moe import config as qwen3_moe
from kern.models.qwen3_next import config as qwen3_next

__all__ = [
    "EXPERTS",
    "EXPERTS_ONLY",
    "FAMILIES",
    "HEADS",
    "NAMES",
    "Family",
    "Mtp",
    "by_model_type",
    "family",
    "model_types",
    "of",
]

# What a parallel mode splits (Family.parallel): attention heads and MLP columns (partial
# sums joined); routed experts, with the rest split by heads; routed experts only, the rest
# replicated on every rank (kern.engine.ranks.shard).
HEADS = "heads"
EXPERTS = "experts"
EXPERTS_ONLY = "experts_only"


def _same_name(c: ModelConfig, name: str, mtp: bool) -> str | None:
    return name


def _stored_as_named(c: ModelConfig, name: str) -> str:
    return name


def _no_fp4(c: ModelConfig, name: str) -> bool:
    return False


def _not_fused(c: ModelConfig, name: str) -> None:
    return None


def load(path: str) -> Any:
    """``"module:attribute"``, imported."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class Mtp:
    """A family's multi-token-prediction layers: their tensors (``shapes(config)``: shapes,
    and the names a checkpoint may leave out) and the model that runs one as a drafter."""

    shapes: Callable[[ModelConfig], tuple[shapes.Shapes, set[str]]]
    model: str


@dataclass(frozen=True)
class Family:
    """One family's row (see the module notes)."""

    name: str
    # config.json model_type strings read as this family, and those among them whose text
    # model's fields sit under ``text_config`` (multimodal releases).
    model_types: tuple[str, ...]
    read_config: Callable[[Fields, dict[str, Any]], ModelConfig]
    tensor_shapes: Callable[[ModelConfig], shapes.Shapes]
    model: str  # its model class, "module:Class"
    pages: str  # its page kind, "module:Class" (kern.models.pages)
    tiny: str  # its tiny checkpoint writer, a module (kern.tiny)
    text_config: tuple[str, ...] = ()
    # Stored name -> kern's (None: not read; ``mtp``: read the MTP layers too), and back.
    canonical_name: Callable[[ModelConfig, str, bool], str | None] = _same_name
    stored_name: Callable[[ModelConfig, str], str] = _stored_as_named
    head: str = "lm_head.weight"  # the output head (optional when embeddings are tied)
    integer_leaves: tuple[str, ...] = ()  # name suffixes of integer tensors (kept integer)
    fp4_weight: Callable[[ModelConfig, str], bool] = _no_fp4  # stored as FP4 (e2m1 bytes)
    # A stored tensor that holds several of kern's (fused experts): its shape and the pieces,
    # each kern's name with (index on dim 0, first row, end row); None for any other.
    split_stored: Callable[[ModelConfig, str], Any] = _not_fused
    mtp: Mtp | None = None
    # Parallel mode ("tp", "ep") -> what it splits (HEADS, EXPERTS, EXPERTS_ONLY).
    parallel: Mapping[str, str] = field(default_factory=dict)
    # Whether a draft checkpoint can draft for it (its pages hold other families' KV rows)
    # and it can be one.
    draft_checkpoints: bool = True
    # Whether its decode forward launches device work only (no host read-back), so CUDA
    # graphs can capture it (kern.engine.cuda_graphs).
    cuda_graphs: bool = False
    # The chat format its answers are always in (kern.chat_formats: gpt-oss's "harmony"), the
    # target's tool_parser unless one is set; None: the target's choice.
    chat_format: str | None = None

    def build_model(self, ops: Any, config: ModelConfig, tensors: Any) -> Any:
        """The family's model over ``tensors`` (its names), prepared for ``ops``."""
        return load(self.model)(ops, config, tensors)

    def page_kind(self) -> Any:
        """Its page kind class (``kern.models.pages.PageKind``)."""
        return load(self.pages)

    def tiny_writer(self) -> Any:
        """Its tiny checkpoint writer module."""
        return importlib.import_module(self.tiny)


FAMILIES: tuple[Family, ...] = (
    Family(
        "qwen3",
        model_types=("qwen3",),
        read_config=qwen3.read_config,
        tensor_shapes=qwen3.tensor_shapes,
        model="kern.models.qwen3.model:Qwen3",
        pages="kern.models.pages:KvPages",
        tiny="kern.models.qwen3.tiny",
        parallel={"tp": HEADS},
        cuda_graphs=True,
    ),
    Family(
        "qwen3_5",
        model_types=("qwen3_5", "qwen3_5_text"),
        text_config=("qwen3_5",),
        read_config=qwen3_5.read_config,
        tensor_shapes=qwen3_5.tensor_shapes,
        canonical_name=qwen3_5.canonical_name,
        model="kern.models.qwen3_5.model:Qwen3_5",
        pages="kern.models.pages:KvPages",
        tiny="kern.models.qwen3_5.tiny",
        parallel={"tp": HEADS},
    ),
    Family(
        "qwen3_moe",
        model_types=("qwen3_moe",),
        read_config=qwen3_moe.read_config,
        tensor_shapes=qwen3_moe.tensor_shapes,
        model="kern.models.qwen3_moe.model:Qwen3Moe",
        pages="kern.models.pages:KvPages",
        tiny="kern.models.qwen3_moe.tiny",
        parallel={"tp": HEADS, "ep": EXPERTS},
    ),
    Family(
        "qwen3_next",
        model_types=("qwen3_next",),
        read_config=qwen3_next.read_config,
        tensor_shapes=qwen3_next.tensor_shapes,
        model="kern.models.qwen3_next.model:Qwen3Next",
        pages="kern.models.pages:KvPages",
        tiny="kern.models.qwen3_next.tiny",
        parallel={"ep": EXPERTS_ONLY},
    ),
    Family(
        "qwen3_5_moe",
        model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
        text_config=("qwen3_5_moe",),
        read_config=qwen3_5_moe.read_config,
        tensor_shapes=qwen3_5_moe.tensor_shapes,
        canonical_name=qwen3_5_moe.canonical_name,
        split_stored=qwen3_5_moe.split_stored,
        model="kern.models.qwen3_5_moe.model:Qwen3_5Moe",
        pages="kern.models.pages:KvPages",
        tiny="kern.models.qwen3_5_moe.tiny",
        parallel={"ep": EXPERTS_ONLY},
    ),
    Family(
        "gpt_oss",
        model_types=("gpt_oss",),
        read_config=gpt_oss.read_config,
        tensor_shapes=gpt_oss.tensor_shapes,
        canonical_name=gpt_oss.canonical_name,
        fp4_weight=gpt_oss.fp4_weight,
        split_stored=gpt_oss.split_stored,
        model="kern.models.gpt_oss.model:GptOss",
        pages="kern.models.gpt_oss.pages:SlidingKvPages",
        tiny="kern.models.gpt_oss.tiny",
        parallel={"ep": EXPERTS_ONLY},
        chat_format="harmony",
    ),
    Family(
        "deepseek_v3",
        model_types=("deepseek_v3", "kimi_k2", "kimi_k25"),
        text_config=("kimi_k25",),
        read_config=deepseek_v3.read_config,
        tensor_shapes=deepseek_v3_tensors.tensor_shapes,
        canonical_name=deepseek_v3_tensors.canonical_name,
        model="kern.models.deepseek_v3.model:DeepseekV3",
        pages="kern.models.pages:LatentPages",
        tiny="kern.models.deepseek_v3.tiny",
        mtp=Mtp(deepseek_v3_tensors.mtp_shapes, "kern.models.deepseek_v3.mtp:MtpModel"),
        parallel={"ep": EXPERTS_ONLY},
    ),
    Family(
        "kimi_linear",
        model_types=("kimi_linear",),
        read_config=kimi_linear.read_config,
        tensor_shapes=kimi_linear_tensors.tensor_shapes,
        canonical_name=kimi_linear_tensors.canonical_name,
        stored_name=kimi_linear_tensors.stored_name,
        model="kern.models.kimi_linear.model:KimiLinear",
        pages="kern.models.pages:LatentPages",
        tiny="kern.models.kimi_linear.tiny",
        parallel={"ep": EXPERTS_ONLY},
    ),
    Family(
        "deepseek_v4",
        model_types=("deepseek_v4",),
        read_config=deepseek_v4.read_config,
        tensor_shapes=deepseek_v4_tensors.tensor_shapes,
        canonical_name=deepseek_v4_tensors.canonical_name,
        head=deepseek_v4_tensors.HEAD,
        integer_leaves=deepseek_v4_tensors.INTEGER_LEAVES,
        fp4_weight=deepseek_v4_tensors.fp4_weight,
        model="kern.models.deepseek_v4.model:DeepseekV4",
        pages="kern.models.deepseek_v4.pages:CompressedPages",
        tiny="kern.models.deepseek_v4.tiny",
        parallel={"ep": EXPERTS_ONLY},
        draft_checkpoints=False,
    ),
)

NAMES: tuple[str, ...] = tuple(f.name for f in FAMILIES)
_BY_NAME = {f.name: f for f in FAMILIES}
_BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def family(name: str) -> Family:
    """The row of family ``name``; ``KeyError`` for a name kern does not run."""
    return _BY_NAME[name]


def of(config: ModelConfig) -> Family:
    """The row of ``config``'s family."""
    return _BY_NAME[config.model_type]


def by_model_type(model_type: object) -> Family | None:
    """The family a config.json ``model_type`` is read as, or None."""
    return _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None


def model_types() -> list[str]:
    """Every config.json ``model_type`` kern reads, sorted."""
    return sorted(_BY_MODEL_TYPE)


def with_mtp() -> tuple[str, ...]:
    """The families whose checkpoints draft with their own MTP layers."""
    return tuple(f.name for f in FAMILIES if f.mtp is not None)


def with_fp4() -> tuple[str, ...]:
    """The families whose checkpoints may store routed experts as FP4."""
    return tuple(f.name for f in FAMILIES if f.fp4_weight is not _no_fp4)


def splitting(mode: str) -> tuple[str, ...]:
    """The families a parallel mode splits."""
    return tuple(f.name for f in FAMILIES if mode in f.parallel)
