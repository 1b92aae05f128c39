"""The Responses API's request body (:class:`ResponsesRequest`) and the store of the responses
it keeps (:class:`ResponseStore`): what the route (kern.server.openai_responses) and the
rendering (kern.server.openai_responses_run) both name, so neither imports the other's."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Literal

from msgspec import Struct

from kern.server import api
from kern.server.api import ApiError

__all__ = ["STORE_SIZE", "ReasoningConfig", "ResponseStore", "ResponsesRequest", "TextConfig"]

# Stored responses kept (the oldest goes first).
STORE_SIZE = 256


class TextConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    format: dict[str, Any] | None = None
    verbosity: Literal["medium"] | None = None


class ReasoningConfig(Struct, kw_only=True, forbid_unknown_fields=True):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # kern writes no reasoning summaries: "auto" (the server's choice) and "none" say as much;
    # "concise" and "detailed" ask for one and are refused by name.
    summary: Literal["auto", "none"] | None = None


class ResponsesRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: api.PositiveInt | None = None
    temperature: api.Temperature | None = None
    top_p: api.TopP | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    include: list[Literal["reasoning.encrypted_content"]] | None = None
    truncation: Literal["disabled"] | None = None
    service_tier: Literal["auto", "default"] | None = None
    # Identifiers that ask for no behaviour.
    metadata: dict[str, str] | None = None
    # Codex CLI's identifiers (session, thread, turn): stored and echoed as metadata is.
    client_metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None


class ResponseStore:
    """The last :data:`STORE_SIZE` stored responses: each one's conversation (without its
    instructions) and its Response object."""

    def __init__(self, size: int = STORE_SIZE) -> None:
        self.size = size
        self.items: OrderedDict[str, tuple[list[api.ChatMessage], dict[str, Any]]] = OrderedDict()

    def put(self, id_: str, conversation: list[api.ChatMessage], response: dict[str, Any]) -> None:
        self.items[id_] = (conversation, response)
        while len(self.items) > self.size:
            self.items.popitem(last=False)

    def get(self, id_: str, param: str) -> tuple[list[api.ChatMessage], dict[str, Any]]:
        found = self.items.get(id_)
        if found is None:
            raise ApiError(
                404,
                f"response {api.echo(id_)} is not stored (kern keeps the last {self.size} "
                "stored responses in memory)",
                param=param,
                type="invalid_request_error",
                code="not_found",
            )
        return found
