"""kern.toml: named targets, each a checkpoint and how to serve it.

```toml
[targets.tiny]
checkpoint = "models/tiny-qwen3"   # relative to this file
dtype = "float32"                  # default: float32 on cpu, bfloat16 on cuda
device = "cpu"
pool_bytes = "1GiB"                # device budget for KV pages and states
host_bytes = "4GiB"                # host tier for parked cache entries; 0 = none
page_tokens = 16
snapshot_pages = 4                 # window models (deepseek_v4): a prefill snapshot every N pages
rows = [1, 4]                      # decode row shapes; kern run and serve use the widest
draft = "ngram"                    # drafter at rows > 1 (default); "mtp"; or a checkpoint
ranks = 1                          # processes (tensor / expert parallel), see docs/serve.md
parallel = "tp"                    # with ranks > 1: "tp" (heads and MLP columns) or "ep" (experts)
threads = 2                        # torch intra-op threads (CPU results depend on it)
reasoning_parser = "qwen3"         # chat answers' <think> block -> reasoning_content
tool_parser = "qwen3"              # chat answers' tool calls: "qwen3" (default) or "kimi_k2"
grammar_timeout = 5                # CPU seconds one response_format / tools grammar may compile
grammar_max_bytes = "1MiB"         # the largest schema (as JSON) a request may ask to compile
allow_unknown_fields = false       # an unknown request field: a warning naming it, not a 400
hosted_tools = "refuse"            # a vendor-hosted tool (web_search, ...): "refuse" or "drop"
```

Unknown keys and unknown target names are errors naming the key (or target) and the file: a
misspelt ``page_token = 32`` silently ignored would serve with 16 and nobody would know. This
module parses; whether a command can run what a target asks (a draft checkpoint of the same
tokenizer whose KV fits the target's pages, kern.engine.drafters.model; ``draft = "mtp"`` on
a deepseek_v3 checkpoint with a multi-token-prediction layer, kern.engine.drafters.mtp;
``ranks`` and ``parallel`` split only what kern implements) is
:func:`kern.engine.targets.check_target`'s call. A step at rows R verifies the last token and R - 1
drafts, so ``rows`` also says how many tokens to draft; ``draft`` without a row shape above 1
would draft nothing, and is an error.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kern.chat_formats import REASONING_PARSERS, TOOL_PARSERS

__all__ = [
    "DEFAULT_GRAMMAR_MAX_BYTES",
    "DEFAULT_GRAMMAR_TIMEOUT",
    "DEFAULT_THREADS",
    "DRAFTERS",
    "HOSTED_TOOLS",
    "KernConfig",
    "Target",
    "TomlConfigError",
    "check_device",
    "default_dtype",
    "grammar_timeout",
    "load_toml_config",
    "parse_bytes",
]

# Torch intra-op threads when neither the target nor the command line names a count. Fixed
# rather than os.cpu_count(): CPU float32 results can differ between 1 and 2 threads
# (docs/invariance.md), so the same command must not give different bits on more cores.
DEFAULT_THREADS = 2
# The grammar budgets' defaults (kern.engine.grammar_compile): CPU seconds one compile may
# take, bytes of a schema (as JSON) a request may ask to compile.
DEFAULT_GRAMMAR_TIMEOUT = 5.0
DEFAULT_GRAMMAR_MAX_BYTES = 2**20

_DEVICES = re.compile(r"^(cpu|cuda(:\d+)?)$")
_DTYPES = ("float32", "bfloat16", "float16")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_TARGET_KEYS = (
    "checkpoint",
    "dtype",
    "device",
    "pool_bytes",
    "host_bytes",
    "page_tokens",
    "snapshot_pages",
    "rows",
    "draft",
    "ranks",
    "parallel",
    "threads",
    "reasoning_parser",
    "tool_parser",
    "grammar_timeout",
    "grammar_max_bytes",
    "allow_unknown_fields",
    "hosted_tools",
)
# hosted_tools values: a request naming a tool only its vendor runs (the Responses API's
# web_search, ...) is refused naming it, or served without it and a warning naming it.
HOSTED_TOOLS = ("refuse", "drop")
# draft values that name no checkpoint: n-gram lookup, the target's own MTP layer (a folder
# of either name is written "./mtp").
DRAFTERS = ("ngram", "mtp")
# parallel values (kern.engine.ranks.shard.PARALLEL; kept here so parsing imports nothing).
PARALLEL_MODES = ("tp", "ep")


class TomlConfigError(ValueError):
    """kern.toml is malformed, has an unknown key, or names an unknown target."""


@dataclass(frozen=True)
class Target:
    """One ``[targets.NAME]`` table, with defaults filled and paths resolved."""

    name: str
    checkpoint: Path
    dtype: str = "float32"
    device: str = "cpu"
    # None: on CUDA the server takes 85% of the memory free after loading the weights; on
    # the CPU a fixed 256 MiB (kern.engine.scheduler.DEFAULT_POOL_BYTES).
    pool_bytes: int | None = None
    host_bytes: int = 0
    page_tokens: int = 16
    # A model with window pages (kern.engine.window_pages) resumes only at a snapshot: its
    # prefill leaves one every this many pages (where a window page ends too); None: 1. Refused
    # for other models.
    snapshot_pages: int | None = None
    # Row shapes a decode step may verify (1 = plain decoding), ascending. A step at rows R
    # verifies the sequence's last token and R - 1 drafted tokens.
    rows: tuple[int, ...] = (1,)
    # "ngram" for n-gram lookup in the context, "mtp" for the checkpoint's own
    # multi-token-prediction layer (deepseek_v3, kern.engine.drafters.mtp), a draft
    # checkpoint folder, or None (at rows > 1: n-gram lookup, the drafter that needs no model).
    draft: str | None = None
    ranks: int = 1
    # How ranks split the model (kern.engine.ranks.shard): "tp" or "ep".
    parallel: str = "tp"
    threads: int = DEFAULT_THREADS
    # Split the chat format's reasoning block (<think>...</think>) into reasoning_content when
    # serving chat (kern.chat_formats.REASONING_PARSERS, kern.server.splitter); None: off.
    reasoning_parser: str | None = None
    # The chat format answers write tool calls in, one of kern.chat_formats.TOOL_PARSERS (the
    # first the default).
    tool_parser: str = TOOL_PARSERS[0]
    # What a served request's grammar (response_format, tools) may take to compile: CPU
    # seconds, and bytes of its schema as JSON (kern.engine.grammar_compile).
    grammar_timeout: float = DEFAULT_GRAMMAR_TIMEOUT
    grammar_max_bytes: int = DEFAULT_GRAMMAR_MAX_BYTES
    # An unknown field of a served request (any POST route, nested ones too): a warning
    # naming it instead of a 400 naming it (kern.server.api.decode).
    allow_unknown_fields: bool = False
    # A request's vendor-hosted tools (kern.server.openai_responses): "refuse" names them in
    # a 400, "drop" serves without them and names them in a warning.
    hosted_tools: str = HOSTED_TOOLS[0]
    # The rows this command decodes at (``--rows``, ``KERN_ROWS``); None: the widest declared.
    chosen_rows: int | None = None
    # Where each key was set, for errors: "kern.toml: targets.x.pool_bytes", "--pool-bytes".
    origin: dict[str, str] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def widest_rows(self) -> int:
        return self.rows[-1]

    @property
    def draft_checkpoint(self) -> Path | None:
        """The draft checkpoint folder, or None (n-gram or MTP drafts, or none)."""
        if self.draft is None or self.draft in DRAFTERS:
            return None
        return Path(self.draft)

    @property
    def decode_rows(self) -> int:
        """The rows a decode step verifies: the chosen ones, else the widest declared."""
        return self.widest_rows if self.chosen_rows is None else self.chosen_rows

    def where(self, key: str) -> str:
        """What set ``key``: a file and table, or a flag (the target's name if a default)."""
        return self.origin.get(key, f"target {self.name!r}")


@dataclass(frozen=True)
class KernConfig:
    path: Path
    targets: dict[str, Target]

    def target(self, name: str) -> Target:
        """The target called ``name``; raises :class:`TomlConfigError` naming the known ones."""
        try:
            return self.targets[name]
        except KeyError:
            known = ", ".join(sorted(self.targets)) or "none"
            raise TomlConfigError(f"{self.path}: no target {name!r} (targets: {known})") from None


def load_toml_config(path: str | Path) -> KernConfig:
    """Parse kern.toml. Raises :class:`TomlConfigError` (and ``FileNotFoundError``)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise
    except tomllib.TOMLDecodeError as e:
        raise TomlConfigError(f"{path}: not valid TOML: {e}") from e
    for key in data:
        if key != "targets":
            raise TomlConfigError(f"{path}: unknown key {key!r} (expected [targets.NAME] tables)")
    tables = data.get("targets", {})
    if not isinstance(tables, dict):
        raise TomlConfigError(f"{path}: 'targets' must be tables ([targets.NAME])")
    targets = {}
    for name, table in tables.items():
        if not isinstance(table, dict):
            raise TomlConfigError(f"{path}: targets.{name} must be a table")
        targets[name] = _target(path, name, table)
    return KernConfig(path=path, targets=targets)


def _target(path: Path, name: str, table: dict[str, Any]) -> Target:
    where = f"{path}: targets.{name}"
    for key in table:
        if key not in _TARGET_KEYS:
            raise TomlConfigError(
                f"{where}: unknown key {key!r} (known: {', '.join(_TARGET_KEYS)})"
            )
    if "checkpoint" not in table:
        raise TomlConfigError(f"{where}: missing key 'checkpoint'")
    checkpoint = _str(table, "checkpoint", where)
    device = _str(table, "device", where, "cpu")
    check_device(device, f"{where}.device")
    dtype = _str(table, "dtype", where, default_dtype(device))
    if dtype not in _DTYPES:
        raise TomlConfigError(f"{where}.dtype: {dtype!r} is not one of {', '.join(_DTYPES)}")
    rows_value = table.get("rows", [1])
    rows_list = rows_value if isinstance(rows_value, list) else [rows_value]
    if not rows_list or not all(_is_pos_int(r) for r in rows_list):
        raise TomlConfigError(f"{where}.rows: expected a positive integer or a list of them")
    draft = table.get("draft")
    if draft is not None and not isinstance(draft, str):
        raise TomlConfigError(f"{where}.draft: expected 'ngram', 'mtp' or a checkpoint path")
    if draft is not None and max(rows_list) == 1:
        raise TomlConfigError(
            f"{where}.draft: draft = {draft!r} drafts nothing at rows {rows_list} (a step at "
            "rows R verifies R - 1 drafts): declare a row shape above 1, e.g. rows = [1, 4]"
        )
    if draft is not None and draft not in DRAFTERS:
        draft = str((path.parent / draft).resolve())
    pool = table.get("pool_bytes")
    parallel = _str(table, "parallel", where, "tp")
    if parallel not in PARALLEL_MODES:
        raise TomlConfigError(
            f"{where}.parallel: {parallel!r} is not one of {', '.join(PARALLEL_MODES)}"
        )
    if "parallel" in table and table.get("ranks", 1) == 1:
        raise TomlConfigError(f"{where}.parallel: says how ranks split the model; ranks is 1")
    parser = table.get("reasoning_parser")
    if parser is not None and parser not in REASONING_PARSERS:
        raise TomlConfigError(
            f"{where}.reasoning_parser: {parser!r} is not one of {', '.join(REASONING_PARSERS)}"
        )
    tool_parser = table.get("tool_parser", TOOL_PARSERS[0])
    if tool_parser not in TOOL_PARSERS:
        raise TomlConfigError(
            f"{where}.tool_parser: {tool_parser!r} is not one of {', '.join(TOOL_PARSERS)}"
        )
    allow_unknown = table.get("allow_unknown_fields", False)
    if not isinstance(allow_unknown, bool):
        raise TomlConfigError(f"{where}.allow_unknown_fields: expected true or false")
    hosted = table.get("hosted_tools", HOSTED_TOOLS[0])
    if hosted not in HOSTED_TOOLS:
        raise TomlConfigError(
            f"{where}.hosted_tools: {hosted!r} is not one of {', '.join(HOSTED_TOOLS)}"
        )
    return Target(
        name=name,
        # Relative paths are relative to the file, so a config works from any directory.
        checkpoint=(path.parent / checkpoint).resolve(),
        dtype=dtype,
        device=device,
        pool_bytes=None if pool is None else parse_bytes(pool, f"{where}.pool_bytes", minimum=1),
        host_bytes=parse_bytes(table.get("host_bytes", 0), f"{where}.host_bytes", minimum=0),
        page_tokens=_pos_int(table, "page_tokens", where, 16),
        snapshot_pages=(
            _pos_int(table, "snapshot_pages", where, 1) if "snapshot_pages" in table else None
        ),
        rows=tuple(sorted(set(rows_list))),
        draft=draft,
        ranks=_pos_int(table, "ranks", where, 1),
        parallel=parallel,
        threads=_pos_int(table, "threads", where, DEFAULT_THREADS),
        reasoning_parser=parser,
        tool_parser=tool_parser,
        grammar_timeout=grammar_timeout(
            table.get("grammar_timeout", DEFAULT_GRAMMAR_TIMEOUT), f"{where}.grammar_timeout"
        ),
        grammar_max_bytes=parse_bytes(
            table.get("grammar_max_bytes", DEFAULT_GRAMMAR_MAX_BYTES),
            f"{where}.grammar_max_bytes",
            minimum=1,
        ),
        allow_unknown_fields=allow_unknown,
        hosted_tools=hosted,
        origin={key: f"{where}.{key}" for key in _TARGET_KEYS if key in table},
    )


def grammar_timeout(value: Any, where: str) -> float:
    """A grammar time budget: a positive, finite number of seconds (0 would refuse every
    grammar)."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not 0 < value < float("inf"):
        raise TomlConfigError(f"{where}: expected a positive number of seconds, got {value!r}")
    return float(value)


def check_device(device: str, where: str) -> None:
    if not _DEVICES.match(device):
        raise TomlConfigError(f"{where}: {device!r} is not 'cpu', 'cuda' or 'cuda:N'")


def default_dtype(device: str) -> str:
    """The dtype a device's backend computes in (kern.backend)."""
    return "float32" if device == "cpu" else "bfloat16"


def _is_pos_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _pos_int(table: dict[str, Any], key: str, where: str, default: int) -> int:
    value = table.get(key, default)
    if not _is_pos_int(value):
        raise TomlConfigError(f"{where}.{key}: expected a positive integer, got {value!r}")
    return value


def _str(table: dict[str, Any], key: str, where: str, default: str | None = None) -> str:
    value = table.get(key, default)
    if not isinstance(value, str):
        raise TomlConfigError(f"{where}.{key}: expected a string, got {value!r}")
    return value


def parse_bytes(value: Any, where: str, *, minimum: int) -> int:
    """An integer byte count, or a string with a unit: "512MiB", "1.5GB"."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str) and (m := _SIZE.match(value)):
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").lower()])
    else:
        raise TomlConfigError(f"{where}: expected bytes (an integer or e.g. '4GiB'), got {value!r}")
    if n < minimum:
        raise TomlConfigError(f"{where}: must be at least {minimum}, got {value!r}")
    return n
