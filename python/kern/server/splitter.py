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
* Tool calls (Qwen3's convention, on when a request has tools and tool_choice is not "none"):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. A block whose JSON is not a
  name and an arguments object stays content, verbatim, as does a block cut off by the end.
  Whitespace between and after calls is dropped; any other text there stays content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from kern.kern_toml import REASONING_PARSERS

__all__ = ["REASONING_PARSERS", "Parts", "Splitter", "ToolCall", "opens_reasoning"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


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
    def __init__(self, *, reasoning: bool, tools: bool, prompt_opened: bool = False) -> None:
        self.tools = tools
        # "start": may still begin with <think>; "think"; "text"; "call": inside a tool call.
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
        at = self.buf.find(CALL_OPEN)
        if at >= 0:
            self._content(out, self.buf[:at])
            self.blank = ""  # whitespace before a call goes with it
            self.buf = self.buf[at:]
            self.state = "call"
            return
        keep = 0 if final else _held(self.buf, CALL_OPEN)
        self._content(out, self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep :]

    def _call(self, out: Parts, final: bool) -> None:
        at = self.buf.find(CALL_CLOSE)
        if at < 0:
            return  # the end (final) leaves the unfinished block as content
        block = self.buf[: at + len(CALL_CLOSE)]
        self.buf = self.buf[at + len(CALL_CLOSE) :]
        self.state = "text"
        call = _parse(block[len(CALL_OPEN) : -len(CALL_CLOSE)])
        if call is None:
            self._content(out, block)
        else:
            out.calls.append(call)
            self.calls += 1
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


def _parse(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or set(value) != {"name", "arguments"}:
        return None
    name, args = value["name"], value["arguments"]
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, json.dumps(args, ensure_ascii=False))
