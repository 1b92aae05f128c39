"""The structural tags of constrained answers (xgrammar's ``structural_tag`` format): a JSON
schema's, tool calls in Qwen3's and Kimi K2's conventions, and the reasoning block that may
come first. What they enforce and why is in kern.engine.structured's design notes; this
module only writes them."""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "KIMI_ARGUMENTS",
    "KIMI_CALL_BEGIN",
    "KIMI_CALL_END",
    "KIMI_INDEX",
    "KIMI_SECTION_BEGIN",
    "KIMI_SECTION_END",
    "TAG_WHITESPACE",
    "after_reasoning",
    "json_format",
    "kimi_calls",
    "qwen3_calls",
]

# Whitespace characters allowed between JSON tokens in a structural tag's JSON.
TAG_WHITESPACE = 1
# Kimi K2's tool-call markers (kern.server.splitter reads them; the engine imports no server).
KIMI_SECTION_BEGIN, KIMI_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
KIMI_ARGUMENTS = "<|tool_call_argument_begin|>"
# A Kimi call's index (calls counted over the conversation): bounded, so that a model the
# grammar holds cannot write digits forever.
KIMI_INDEX = "(0|[1-9][0-9]{0,5})"


def json_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": TAG_WHITESPACE}


def after_reasoning(think: str | None, answer: dict[str, Any]) -> dict[str, Any]:
    """``answer``, after a reasoning block that ``think`` says may ("may") or must ("must",
    the prompt opened it) come first."""
    if think is None:
        return answer
    if think == "must":
        block: dict[str, Any] = {"type": "tag", "begin": "", "content": {"type": "any_text"},
                                 "end": "</think>\n\n"}  # fmt: skip
    else:
        block = {
            "type": "optional",
            "content": {"type": "tag", "begin": "<think>", "content": {"type": "any_text"},
                        "end": "</think>\n\n"},
        }  # fmt: skip
    return {"type": "sequence", "elements": [block, answer]}


def _arguments(tool: dict[str, Any]) -> dict[str, Any]:
    return json_format(tool.get("parameters") or {"type": "object"})


def qwen3_calls(tools: list[dict[str, Any]], choice: str, parallel: bool) -> dict[str, Any]:
    """Calls as ``<tool_call>`` blocks, one per call, a newline between them."""
    tags = [
        {
            "type": "tag",
            "begin": '<tool_call>\n{"name": ' + json.dumps(t["name"]) + ', "arguments": ',
            "content": _arguments(t),
            "end": "}\n</tool_call>",
        }
        for t in tools
    ]
    if choice == "auto":
        return {
            "type": "triggered_tags",
            "triggers": ["<tool_call>"],
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


def kimi_calls(tools: list[dict[str, Any]], choice: str, parallel: bool) -> dict[str, Any]:
    """Calls in one Kimi tool-calls section: each ``functions.NAME:INDEX`` and its arguments
    between Kimi's markers (see the design notes)."""
    tags = [
        {
            "type": "tag",
            "begin": KIMI_CALL_BEGIN + "functions." + t["name"] + ":",
            "content": {
                "type": "sequence",
                "elements": [
                    {"type": "regex", "pattern": KIMI_INDEX},
                    {"type": "const_string", "value": KIMI_ARGUMENTS},
                    _arguments(t),
                ],
            },
            "end": KIMI_CALL_END,
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
        section = {"type": "tag", "begin": KIMI_SECTION_BEGIN, "content": calls,
                   "end": KIMI_SECTION_END}  # fmt: skip
        return {
            "type": "triggered_tags",
            "triggers": [KIMI_SECTION_BEGIN],
            "tags": [section],
            "stop_after_first": not parallel,
            # A call outside a section would not parse: the text may not open one.
            "excludes": [KIMI_CALL_BEGIN],
        }
    return {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": KIMI_SECTION_BEGIN},
            calls,
            {"type": "const_string", "value": KIMI_SECTION_END},
        ],
    }
