"""Kimi K2's chat format: the calls in one section, ``<|tool_calls_section_begin|>``, then per
call ``<|tool_call_begin|>``, the call's id ``functions.NAME:INDEX``,
``<|tool_call_argument_begin|>``, the arguments object and ``<|tool_call_end|>``, then
``<|tool_calls_section_end|>``.

Design notes
------------
* The call's id is kept as its ``id``: Kimi's template renders it back, and its tool results
  name it. A section whose calls are not that shape, or whose arguments are not a JSON
  object, stays content, verbatim, as does one cut off by the end: a section gives its calls
  only once it is whole. Whitespace between the calls is allowed.
* The grammar: ``required`` is a section of one or more calls (one when parallel_tool_calls
  is false), a named function a section of one call of it, ``auto`` free text in which a
  section, once opened, must hold calls of the tools (and a call may not open outside one:
  it would not parse). The index is bounded (:data:`INDEX`).
* The markers are special tokens of Kimi's tokenizer, so the answer's text keeps special
  tokens (``keep_special``). xgrammar matches text, and the vocabulary handed over holds
  every added token as its text (special or not, none is left out), so the grammar allows a
  marker's token as well as the marker spelt in pieces.
* No reasoning parser: Kimi K2 writes no reasoning block.
"""

from __future__ import annotations

import re
from typing import Any

from kern.chat_formats.base import ChatFormat, ToolCall, arguments_format, json_object

__all__ = ["KIMI_K2", "KimiK2"]

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
ARGUMENTS = "<|tool_call_argument_begin|>"
# A call's index (calls counted over the conversation): bounded, so that a model the grammar
# holds cannot write digits forever.
INDEX = "(0|[1-9][0-9]{0,5})"
# A call id: the name runs to the last colon, the index after it.
_ID = re.compile(r"functions\.(.+):[0-9]+")


class KimiK2(ChatFormat):
    name = "kimi_k2"
    calls_open, calls_close = SECTION_BEGIN, SECTION_END
    summary = "tool-calls sections"
    keep_special = True

    def parse(self, text: str) -> list[ToolCall] | None:
        """The calls of a section; None unless it is one or more calls, whitespace between
        them."""
        calls: list[ToolCall] = []
        rest = text.strip()
        while rest:
            if not rest.startswith(CALL_BEGIN):
                return None
            call, found, rest = rest[len(CALL_BEGIN) :].partition(CALL_END)
            call_id, arrow, args_text = call.partition(ARGUMENTS)
            call_id = call_id.strip()
            match = _ID.fullmatch(call_id)
            args = json_object(args_text) if found and arrow else None
            if match is None or args is None:
                return None
            calls.append(ToolCall(call_id, match.group(1), args))
            rest = rest.lstrip()
        return calls or None

    def grammar(self, tools: list[dict[str, Any]], choice: str, parallel: bool) -> dict[str, Any]:
        tags = [
            {
                "type": "tag",
                "begin": CALL_BEGIN + "functions." + t["name"] + ":",
                "content": {
                    "type": "sequence",
                    "elements": [
                        {"type": "regex", "pattern": INDEX},
                        {"type": "const_string", "value": ARGUMENTS},
                        arguments_format(t),
                    ],
                },
                "end": CALL_END,
            }
            for t in tools
        ]
        calls: dict[str, Any] = tags[0]
        if choice in ("auto", "required"):
            calls = {
                "type": "tags_with_separator",
                "tags": tags,
                "separator": "",
                "at_least_one": True,
                "stop_after_first": not parallel,
            }
        if choice == "auto":
            section = {"type": "tag", "begin": SECTION_BEGIN, "content": calls,
                       "end": SECTION_END}  # fmt: skip
            return {
                "type": "triggered_tags",
                "triggers": [SECTION_BEGIN],
                "tags": [section],
                "stop_after_first": not parallel,
                # A call outside a section would not parse: the text may not open one.
                "excludes": [CALL_BEGIN],
            }
        return {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": SECTION_BEGIN},
                calls,
                {"type": "const_string", "value": SECTION_END},
            ],
        }


KIMI_K2 = KimiK2()
