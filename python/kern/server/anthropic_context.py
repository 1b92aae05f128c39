"""Anthropic's context management (``context_management.edits``): what a Messages request asks
to clear from its conversation before the prompt is rendered, and the ``applied_edits`` the
answer reports.

Design notes
------------
* ``clear_thinking_20251015`` drops the thinking of all but the last ``keep`` assistant turns
  that have any (``keep: "all"`` keeps every one; Anthropic's default keeps 1).
  kern's templates drop earlier turns' reasoning anyway, so the tokens it clears are often 0:
  they are counted, not assumed.
* ``clear_tool_uses_20250919``: once the prompt is over ``trigger`` (input tokens, default
  100,000, or a count of tool uses), the results of all but the last ``keep`` tool uses
  (default 3) become :data:`CLEARED`, oldest first, except the tools ``exclude_tools`` names;
  ``clear_tool_inputs`` (true, or a list of tool names) clears those calls' inputs too. An
  edit that would clear fewer than ``clear_at_least`` input tokens is not applied.
* Token counts are of the prompt as kern renders and tokenizes it, so ``cleared_input_tokens``
  is exact for this model; a prompt is rendered again only when an edit changed something.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from kern.server import api

__all__ = ["CLEARED", "ContextManagement", "apply_edits"]

# What a cleared tool result (and a cleared input) says in its place.
CLEARED = "[tool result cleared by context management]"
# Anthropic's defaults for clear_tool_uses_20250919.
DEFAULT_TRIGGER_TOKENS = 100_000
DEFAULT_KEEP_TOOL_USES = 3

Count = Annotated[int, Meta(ge=0)]


class InputTokens(Struct, kw_only=True, forbid_unknown_fields=True, tag="input_tokens"):
    value: Count


class ToolUses(Struct, kw_only=True, forbid_unknown_fields=True, tag="tool_uses"):
    value: Count


class ThinkingTurns(Struct, kw_only=True, forbid_unknown_fields=True, tag="thinking_turns"):
    value: Count


class ClearToolUses(
    Struct, kw_only=True, forbid_unknown_fields=True, tag="clear_tool_uses_20250919"
):
    trigger: InputTokens | ToolUses | None = None
    keep: ToolUses | None = None
    clear_at_least: InputTokens | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: bool | list[str] | None = None


class ClearThinking(
    Struct, kw_only=True, forbid_unknown_fields=True, tag="clear_thinking_20251015"
):
    keep: ThinkingTurns | Literal["all"] | None = None


class ContextManagement(Struct, kw_only=True, forbid_unknown_fields=True):
    edits: list[ClearToolUses | ClearThinking] = []


Counter = Callable[[list[api.ChatMessage]], Awaitable[int]]


async def apply_edits(
    cm: ContextManagement, messages: list[api.ChatMessage], count: Counter
) -> dict[str, Any]:
    """Apply ``cm``'s edits to ``messages`` in place, in order; ``count`` gives a
    conversation's prompt tokens. Returns the answer's ``context_management``."""
    applied: list[dict[str, Any]] = []
    tokens: int | None = None
    for edit in cm.edits:
        if isinstance(edit, ClearThinking):
            cleared = _clear_thinking(edit, messages)
            if not cleared:
                continue
            before = tokens if tokens is not None else await count(cleared[1])
            tokens = await count(messages)
            applied.append(
                {
                    "type": "clear_thinking_20251015",
                    "cleared_thinking_turns": cleared[0],
                    "cleared_input_tokens": max(0, before - tokens),
                }
            )
        else:
            tokens = tokens if tokens is not None else await count(messages)
            done = await _clear_tool_uses(edit, messages, tokens, count)
            if done is not None:
                applied.append(done[0])
                tokens = done[1]
    return {"applied_edits": applied}


def _clear_thinking(
    edit: ClearThinking, messages: list[api.ChatMessage]
) -> tuple[int, list[api.ChatMessage]] | None:
    """(turns cleared, the conversation before) or None when nothing is cleared."""
    keep = edit.keep
    if keep == "all":
        return None
    kept = 1 if keep is None else keep.value  # type: ignore[union-attr]
    turns = [i for i, m in enumerate(messages) if m.role == "assistant" and m.reasoning_content]
    clear = turns[: max(0, len(turns) - kept)]
    if not clear:
        return None
    before = [_copy(m) for m in messages]
    for i in clear:
        messages[i].reasoning_content = None
    return len(clear), before


async def _clear_tool_uses(
    edit: ClearToolUses, messages: list[api.ChatMessage], tokens: int, count: Counter
) -> tuple[dict[str, Any], int] | None:
    """(the applied edit, the prompt's tokens after) or None when it does not apply."""
    uses = [
        (i, call)
        for i, m in enumerate(messages)
        if m.role == "assistant"
        for call in m.tool_calls or ()
    ]
    trigger = edit.trigger or InputTokens(value=DEFAULT_TRIGGER_TOKENS)
    measure = tokens if isinstance(trigger, InputTokens) else len(uses)
    if measure <= trigger.value:
        return None
    keep = edit.keep.value if edit.keep is not None else DEFAULT_KEEP_TOOL_USES
    excluded = set(edit.exclude_tools or ())
    inputs = edit.clear_tool_inputs
    results = {m.tool_call_id: m for m in messages if m.role == "tool"}
    before = [_copy(m) for m in messages]
    cleared = 0
    for _, call in uses[: max(0, len(uses) - keep)]:
        if call.function.name in excluded:
            continue
        result = results.get(call.id)
        changed = False
        if result is not None and result.content != CLEARED:
            result.content, changed = CLEARED, True
        if (inputs is True or (isinstance(inputs, list) and call.function.name in inputs)) and (
            call.function.arguments != "{}"
        ):
            call.function.arguments, changed = "{}", True
        cleared += changed
    if not cleared:
        return None
    after = await count(messages)
    if edit.clear_at_least is not None and tokens - after < edit.clear_at_least.value:
        messages[:] = before
        return None
    done = {
        "type": "clear_tool_uses_20250919",
        "cleared_tool_uses": cleared,
        "cleared_input_tokens": max(0, tokens - after),
    }
    return done, after


def _copy(m: api.ChatMessage) -> api.ChatMessage:
    """``m`` with its own tool calls, so that an edit undone leaves it as it was."""
    calls = None
    if m.tool_calls is not None:
        calls = [
            api.MessageToolCall(
                id=c.id,
                type=c.type,
                function=api.CalledFunction(name=c.function.name, arguments=c.function.arguments),
            )
            for c in m.tool_calls
        ]
    return api.ChatMessage(
        role=m.role,
        content=m.content,
        name=m.name,
        tool_calls=calls,
        tool_call_id=m.tool_call_id,
        reasoning_content=m.reasoning_content,
    )
