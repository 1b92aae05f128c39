"""How much a Messages request may think (kern.server.anthropic_messages): ``thinking`` and
``output_config.effort`` as the chat template's variables, and as a thinking budget (see the
design notes of kern.server.anthropic_messages)."""

from __future__ import annotations

import logging
from typing import Any

from kern.server.api import ApiError
from kern.server.openai import OpenAI

__all__ = ["EFFORT_BUDGETS", "thinking_budget", "thinking_kwargs"]

log = logging.getLogger("kern")

# Thinking tokens an effort allows where the model reasons (high, xhigh and max: up to
# max_tokens, as without one); the template's own reasoning_effort takes precedence.
EFFORT_BUDGETS = {"low": 2_048, "medium": 8_192}
# reasoning_effort values for the efforts a template's scale (low, medium, high) lacks.
_TEMPLATE_EFFORT = {"xhigh": "high", "max": "high"}


def thinking_kwargs(handlers: OpenAI, req: Any) -> dict[str, Any]:
    """The chat template's variables ``thinking`` and ``output_config.effort`` set."""
    kwargs: dict[str, Any] = {}
    template = handlers.tokenizer.chat_template or ""
    if req.thinking is not None:
        # adaptive lets the model not think: without a reasoning parser it does not.
        on = req.thinking.type == "enabled" or (
            req.thinking.type == "adaptive" and handlers.reasoning is not None
        )
        if on and not handlers.reasoning:
            raise _refuse("this model is served without a reasoning parser")
        if "enable_thinking" in template:
            kwargs["enable_thinking"] = on
        elif handlers.reasoning:
            raise _refuse("this model's chat template cannot turn thinking on or off")
    effort = req.output_config.effort if req.output_config is not None else None
    takes_effort = handlers.reasoning is not None and "reasoning_effort" in template
    if effort is not None and (takes_effort or handlers.chat_format.messages):
        kwargs["reasoning_effort"] = _TEMPLATE_EFFORT.get(effort, effort)
    return kwargs


def thinking_budget(handlers: OpenAI, req: Any) -> int | None:
    """The thinking tokens an answer may take: ``thinking.budget_tokens``, else what
    ``output_config.effort`` maps to (:data:`EFFORT_BUDGETS`) where the model reasons and its
    template has no effort of its own; None: up to ``max_tokens``."""
    if req.thinking is not None and req.thinking.budget_tokens is not None:
        return req.thinking.budget_tokens
    effort = req.output_config.effort if req.output_config is not None else None
    if effort is None:
        return None
    template = handlers.tokenizer.chat_template or ""
    if handlers.chat_format.messages:
        return None  # harmony's system message takes the effort (thinking_kwargs)
    if handlers.reasoning is None:
        log.debug(
            "output_config.effort %r: no effect, the model is served without reasoning", effort
        )
        return None
    if "reasoning_effort" in template:
        return None
    budget = EFFORT_BUDGETS.get(effort)
    return budget if budget is not None and budget < req.max_tokens else None


def _refuse(message: str) -> ApiError:
    return ApiError(400, f"{message} (at thinking)", param="thinking")
