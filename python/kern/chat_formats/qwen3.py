"""Qwen3's chat format: a ``<think>`` block of reasoning first, and a ``<tool_call>`` block per
call, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Design notes
------------
* A block that is not a JSON object of exactly ``name`` (a non-empty string) and
  ``arguments`` (an object) stays content, verbatim. A call's id is made here
  (``call_`` and 24 hex digits): the format writes none.
* The grammar: ``required`` is one or more blocks, a newline between them (one when
  parallel_tool_calls is false), a named function exactly one block of it, ``auto`` free text
  in which a block, once opened, must be a call of one of the tools. Each block is written as
  the template writes it, ``<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>``,
  the arguments following the tool's parameters schema. ``auto`` is held lazily
  (``calls_lazy``, kern.engine.tool_calls): free text until ``<tool_call>``, then the union
  of the tools' own grammars, each compiled and cached alone.
* The markers are plain text in Qwen3's tokenizers: special tokens may be skipped.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from kern.chat_formats.base import ChatFormat, Reasoning, ToolCall, arguments_format

__all__ = ["QWEN3", "Qwen3"]


class Qwen3(ChatFormat):
    name = "qwen3"
    calls_open, calls_close = "<tool_call>", "</tool_call>"
    summary = "<tool_call> blocks"
    reasoning = Reasoning("<think>", "</think>", "\n\n")
    calls_lazy = True

    def parse(self, text: str) -> list[ToolCall] | None:
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if not isinstance(value, dict) or set(value) != {"name", "arguments"}:
            return None
        name, args = value["name"], value["arguments"]
        if not isinstance(name, str) or not name or not isinstance(args, dict):
            return None
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        return [ToolCall(call_id, name, json.dumps(args, ensure_ascii=False))]

    def grammar(self, tools: list[dict[str, Any]], choice: str, parallel: bool) -> dict[str, Any]:
        tags = [
            {
                "type": "tag",
                "begin": f'{self.calls_open}\n{{"name": {json.dumps(t["name"])}, "arguments": ',
                "content": arguments_format(t),
                "end": "}\n" + self.calls_close,
            }
            for t in tools
        ]
        if choice == "auto":
            return {
                "type": "triggered_tags",
                "triggers": [self.calls_open],
                "tags": tags,
                "stop_after_first": not parallel,
            }
        if choice == "required":
            return {
                "type": "tags_with_separator",
                "tags": tags,
                "separator": "\n",
                "at_least_one": True,
                "stop_after_first": not parallel,
            }
        return tags[0]


QWEN3 = Qwen3()
