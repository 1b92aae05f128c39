"""Chat formats: how a model family writes tool calls and reasoning in its answers, one
:class:`ChatFormat` per module (``qwen3``, ``kimi_k2``), and the registry of them (:data:`FORMATS`)
that kern.toml's checks, ``kern serve``'s flags, the server's splitter
(kern.server.splitter) and the engine's grammars (kern.engine.structured) read.

Nothing outside this package names a format: a new one (Kimi K3's, say) is a
module with its object and a line in :data:`FORMATS`. Torch-free, and it imports nothing else of
kern.
"""

from __future__ import annotations

from kern.chat_formats.base import ChatFormat, Reasoning, ToolCall, json_format
from kern.chat_formats.harmony import HARMONY
from kern.chat_formats.kimi_k2 import KIMI_K2
from kern.chat_formats.qwen3 import QWEN3

__all__ = [
    "DEFAULT",
    "FORMATS",
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "ChatFormat",
    "Reasoning",
    "ToolCall",
    "json_format",
    "reasoning_block",
]

# Name -> format; the first is tool_parser's default.
FORMATS: dict[str, ChatFormat] = {f.name: f for f in (QWEN3, KIMI_K2, HARMONY)}
DEFAULT = next(iter(FORMATS.values()))
# kern.toml's tool_parser values (the convention chat answers' tool calls are written in), the
# first the default; and its reasoning_parser values, the formats with a reasoning block.
TOOL_PARSERS = tuple(FORMATS)
# (A format whose answers are its messages reads their reasoning itself: not one of them.)
REASONING_PARSERS = tuple(
    name for name, f in FORMATS.items() if f.reasoning is not None and not f.messages
)


def reasoning_block(parser: str | None) -> Reasoning | None:
    """The reasoning block of reasoning_parser ``parser`` (one of :data:`REASONING_PARSERS`);
    None when there is no parser."""
    if parser is None:
        return None
    block = FORMATS[parser].reasoning
    assert block is not None, parser
    return block
