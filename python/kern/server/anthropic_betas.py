"""The ``anthropic-beta`` header of a Messages request: what each value Claude Code sends
means to kern (:data:`BETAS`), and a debug line naming the values kern does not know."""

from __future__ import annotations

import logging

__all__ = ["BETAS", "note_betas"]

log = logging.getLogger("kern")

# The anthropic-beta values kern knows, and what each asks of kern. kern reads no beta flag:
# what it implements is on without one, and a feature's request fields it lacks are refused
# by name whatever the header says. Others are named in a debug log line (note_betas).
BETAS = {
    "claude-code-20250219": "names the client (Claude Code); asks for nothing",
    "interleaved-thinking-2025-05-14": "thinking between tool calls: each answer after a tool "
    "result may open its own reasoning block",
    "context-management-2025-06-27": "context_management: implemented",
    "effort-2025-11-24": "output_config.effort: implemented",
    "mid-conversation-tool-changes-2026-07-01": "tools that change between turns: each request "
    "renders its own tools",
    "advanced-tool-use-2025-11-20": "tools[].defer_loading: every tool is loaded at once",
    "thinking-token-count-2026-05-13": "no thinking-token count is reported: usage.output_tokens "
    "includes the thinking",
    "prompt-caching-2024-07-31": "every prompt prefix is cached without markers",
    "token-counting-2024-11-01": "POST /v1/messages/count_tokens: implemented",
    "fine-grained-tool-streaming-2025-05-14": "a tool call's input streams in one delta, "
    "once whole",
    "output-128k-2025-02-19": "max_tokens is bound by the model's context only",
    "structured-outputs-2025-11-13": "output_config.format: implemented",
}


def note_betas(headers: list[tuple[bytes, bytes]]) -> None:
    """Log, at debug level, the anthropic-beta values kern does not know (see :data:`BETAS`)."""
    for name, value in headers:
        if name == b"anthropic-beta":
            unknown = [b for b in value.decode("latin-1").split(",") if b.strip() not in BETAS]
            if unknown:
                log.debug("anthropic-beta %s: not known to kern (no effect)", ",".join(unknown))
