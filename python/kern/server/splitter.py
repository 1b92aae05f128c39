"""Splits a chat answer's text, as it streams, into reasoning, content and tool calls.

Design notes
------------
* One splitter per choice, fed the text the answer releases (after stop strings are cut), so a
  streamed answer and a whole one split the same way: ``collect`` feeds it everything, then
  ``final``; ``stream`` feeds it chunk by chunk. Text that may begin a tag is held back until
  the next piece (or the end) decides, as stop strings are.
* Reasoning (the ``qwen3`` parser, on per target): a ``<think>`` at the very start of the answer,
  or one the prompt opened and did not close (templates that end the generation prompt with
  ``<think>``), starts reasoning; ``</think>`` ends it. An answer cut off while reasoning is all
  reasoning. Anything else is content.
* Tool calls (on when a request has tools and tool_choice is not "none"), in the target's
  convention (``tool_parser``): Qwen3's (``qwen3``), a block per call,
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; or Kimi K2's (``kimi_k2``), a
  section of calls, ``<|tool_calls_section_begin|>`` then per call ``<|tool_call_begin|>``,
  the call's id ``functions.NAME:INDEX`` (kept as the call's ``id``: Kimi's template renders
  it back, and its tool results name it), ``<|tool_call_argument_begin|>``, the arguments
  object and ``<|tool_call_end|>``, then ``<|tool_calls_section_end|>``. A block (a section)
  that is not that shape, or whose arguments are not a JSON object, stays content, verbatim,
  as does one cut off by the end: a Kimi section gives its calls only once it is whole.
  Whitespace between and after calls is dropped; any other text there stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from kern.engine.structured import (
    KIMI_ARGUMENTS,
    KIMI_CALL_BEGIN,
    KIMI_CALL_END,
    KIMI_SECTION_BEGIN,
    KIMI_SECTION_END,
)
from kern.kern_toml import REASONING_PARSERS, TOOL_PARSERS

__all__ = ["REASONING_PARSERS", "TOOL_PARSERS", "Parts", "Splitter", "ToolCall", "opens_reasoning"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# A Kimi call id: the name runs to the last colon, the index after it.
_KIMI_ID = re.compile(r"functions\.(.+):[0-9]+")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as text


@dataclass
class Parts:
    """What a piece of text released: reasoning text, content text and whole tool calls."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt leaves a ``<think>`` block open for the answer."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def _held(buf: str, tag: str) -> int:
    """How many characters at the end of ``buf`` may begin ``tag``."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if tag.startswith(buf[-k:]):
            return k
    return 0


class Splitter:
    def __init__(
        self,
        *,
        reasoning: bool,
        tools: bool,
        prompt_opened: bool = False,
        tool_parser: str = TOOL_PARSERS[0],
    ) -> None:
        self.tools = tools
        # What opens and closes a block of calls, and what reads the calls inside.
        self.open, self.close, self.parse = _CONVENTIONS[tool_parser]
        # "start": may still begin with <think>; "think"; "text"; "call": in a block of calls.
        self.state = "think" if reasoning and prompt_opened else "start" if reasoning else "text"
        self.buf = ""
        self.calls = 0
        self.blank = ""  # whitespace after a tool call, kept until text follows it
        self.fresh = False  # nothing but whitespace since the last call

    def feed(self, text: str, final: bool = False) -> Parts:
        out = Parts()
        self.buf += text
        while True:
            before = (self.state, len(self.buf))
            getattr(self, "_" + self.state)(out, final)
            if (self.state, len(self.buf)) == before:
                break
        if final:
            self._content(out, self.buf)
            self.buf = ""
            self.blank = ""
        return out

    def _start(self, out: Parts, final: bool) -> None:
        if self.buf.startswith(THINK_OPEN):
            self.buf = self.buf[len(THINK_OPEN) :]
            self.state = "think"
        elif final or not THINK_OPEN.startswith(self.buf):
            self.state = "text"

    def _think(self, out: Parts, final: bool) -> None:
        at = self.buf.find(THINK_CLOSE)
        if at >= 0:
            out.reasoning += self.buf[:at]
            self.buf = self.buf[at + len(THINK_CLOSE) :]
            self.state = "text"
            return
        keep = 0 if final else _held(self.buf, THINK_CLOSE)
        out.reasoning += self.buf[: len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep :]

    def _text(self, out: Parts, final: bool) -> None:
        if not self.tools:
            self._content(out, self.buf)
            self.buf = ""
            return
        at = self.buf.find(self.open)
        if at >= 0:
            self._content(out, self.buf[:at])
            self.blank = ""  # whitespace before a call goes with it
            self.buf = self.buf[at:]
            self.state = "call"
            return
        keep = 0 if final else _held(self.buf, self.open)
        self._content(out, self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep :]

    def _call(self, out: Parts, final: bool) -> None:
        at = self.buf.find(self.close)
        if at < 0:
            return  # the end (final) leaves the unfinished block as content
        block = self.buf[: at + len(self.close)]
        self.buf = self.buf[at + len(self.close) :]
        self.state = "text"
        calls = self.parse(block[len(self.open) : -len(self.close)])
        if calls is None:
            self._content(out, block)
        else:
            out.calls += calls
            self.calls += len(calls)
            self.fresh = True

    def _content(self, out: Parts, text: str) -> None:
        if not text:
            return
        if self.calls:
            # After a call, leading whitespace is dropped and trailing whitespace held:
            # dropped before the next call or at the end.
            if self.fresh:
                text = text.lstrip()
                if not text:
                    return
                self.fresh = False
            text = self.blank + text
            stripped = text.rstrip()
            self.blank = text[len(stripped) :]
            text = stripped
        out.content += text


def _arguments(text: str) -> str | None:
    """A call's arguments, a JSON object, as kern returns them; None if not one."""
    try:
        args = json.loads(text)
    except ValueError:
        return None
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None


def _parse_qwen3(body: str) -> list[ToolCall] | None:
    """The call of a ``<tool_call>`` block's ``body``; None if it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or set(value) != {"name", "arguments"}:
        return None
    name, args = value["name"], value["arguments"]
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    call_id = f"call_{uuid.uuid4().hex[:24]}"
    return [ToolCall(call_id, name, json.dumps(args, ensure_ascii=False))]


def _parse_kimi_k2(body: str) -> list[ToolCall] | None:
    """The calls of a Kimi tool-calls section's ``body``; None unless it is one or more
    calls, whitespace between them."""
    calls: list[ToolCall] = []
    rest = body.strip()
    while rest:
        if not rest.startswith(KIMI_CALL_BEGIN):
            return None
        call, found, rest = rest[len(KIMI_CALL_BEGIN) :].partition(KIMI_CALL_END)
        call_id, arrow, text = call.partition(KIMI_ARGUMENTS)
        call_id = call_id.strip()
        match = _KIMI_ID.fullmatch(call_id)
        args = _arguments(text) if found and arrow else None
        if match is None or args is None:
            return None
        calls.append(ToolCall(call_id, match.group(1), args))
        rest = rest.lstrip()
    return calls or None


_CONVENTIONS: dict[str, tuple[str, str, Callable[[str], list[ToolCall] | None]]] = {
    "qwen3": (CALL_OPEN, CALL_CLOSE, _parse_qwen3),
    "kimi_k2": (KIMI_SECTION_BEGIN, KIMI_SECTION_END, _parse_kimi_k2),
}
assert tuple(_CONVENTIONS) == TOOL_PARSERS
