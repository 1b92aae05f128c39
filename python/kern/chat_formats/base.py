"""What a chat format is (:class:`ChatFormat`), its reasoning markers (:class:`Reasoning`), the
calls it parses (:class:`ToolCall`), and the pieces of structural tags its grammar is made of."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "TAG_WHITESPACE",
    "ChatFormat",
    "Reasoning",
    "ToolCall",
    "arguments_format",
    "json_format",
    "json_object",
]

# Whitespace characters allowed between JSON tokens in a structural tag's JSON.
TAG_WHITESPACE = 1


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True)
class Reasoning:
    """A reasoning block: ``open`` at the very start of the answer (or left open by the
    prompt: templates that end the generation prompt with it) up to ``close``; ``gap`` is
    what a constrained answer writes between ``close`` and the answer proper."""

    open: str
    close: str
    gap: str

    def opened_by(self, prompt: str) -> bool:
        """Whether the rendered prompt leaves a block open for the answer."""
        return prompt.rfind(self.open) > prompt.rfind(self.close)

    def grammar(self, opened: bool) -> dict[str, Any]:
        """The block as a structural tag's element: one the answer may start with, or (the
        prompt ``opened`` it) the rest of the one it must start with."""
        end = self.close + self.gap
        if opened:
            return {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": end}
        return {
            "type": "optional",
            "content": {"type": "tag", "begin": self.open, "content": {"type": "any_text"},
                        "end": end},
        }  # fmt: skip


class ChatFormat(ABC):
    """How a model family writes tool calls (and reasoning) in its answers: one object per
    format (kern.chat_formats), which the server's splitter reads the answer with and the
    engine's grammars hold a constrained answer to."""

    # The format's name: a value of kern.toml's tool_parser (and of reasoning_parser when it
    # has ``reasoning``).
    name: ClassVar[str]
    # What opens and closes a block of calls in the answer's text (one call, or a section).
    calls_open: ClassVar[str]
    calls_close: ClassVar[str]
    # How ``kern serve --help`` names those blocks.
    summary: ClassVar[str]
    # The markers are special tokens of the format's tokenizers: skipped from the text as
    # special tokens are by default, no call would parse.
    keep_special: ClassVar[bool] = False
    # The reasoning block's markers; None: the format has no reasoning parser.
    reasoning: ClassVar[Reasoning | None] = None
    # Each call is a tag of its own that starts with ``calls_open`` (:meth:`call_grammar`), so
    # tool_choice "auto" can be held one grammar per tool, from the trigger on
    # (kern.engine.tool_calls). False where calls sit inside a section: auto then keeps the
    # whole structural tag.
    calls_lazy: ClassVar[bool] = False
    # The whole answer is a run of the format's messages (harmony): the server reads it with
    # the format's own parser and renders the prompt itself, not with the checkpoint's template.
    messages: ClassVar[bool] = False
    # With ``messages``: what reads an answer (a splitter's interface: ``feed``, ``cut``,
    # ``reasoning``, ``state``), made with ``calls=`` whether tool calls are on.
    answer_parser: ClassVar[Any] = None

    def render(self, messages: list[dict[str, Any]], **kwargs: Any) -> tuple[str, list[str]]:
        """With ``messages``: the prompt of chat ``messages`` and the client's texts in it."""
        raise NotImplementedError(f"the {self.name} format renders no prompts")

    @abstractmethod
    def parse(self, text: str) -> list[ToolCall] | None:
        """The calls of one block, ``text`` being what its markers enclose; None if the block
        is not that shape (it then stays content, verbatim)."""

    @abstractmethod
    def grammar(self, tools: list[dict[str, Any]], choice: str, parallel: bool) -> dict[str, Any]:
        """The structural tag's element of an answer's calls of ``tools`` (``{"name",
        "parameters"}`` each) under tool_choice ``choice`` ("auto", "required" or a tool's
        name, then ``tools`` is that one); ``parallel``: more than one call allowed."""

    def call_grammar(self, tool: dict[str, Any]) -> dict[str, Any]:
        """The structural tag's element of one call of ``tool``, from ``calls_open`` on (with
        ``calls_lazy``: what a lazily held tool set compiles per tool)."""
        return self.grammar([tool], tool["name"], False)


def json_format(schema: Any) -> dict[str, Any]:
    """A structural tag's element holding JSON of ``schema``."""
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": TAG_WHITESPACE}


def arguments_format(tool: dict[str, Any]) -> dict[str, Any]:
    """The element of a call's arguments: JSON of the tool's parameters schema."""
    return json_format(tool.get("parameters") or {"type": "object"})


def json_object(text: str) -> str | None:
    """``text``, a JSON object, as kern returns a call's arguments; None if not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None
