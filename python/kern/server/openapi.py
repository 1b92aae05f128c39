"""``GET /openapi.json``: the OpenAPI 3.1 document of every route kern serves, its schemas
generated from the msgspec Structs the server parses and writes (never written by hand, so it
cannot drift from what the server accepts).

Design notes
------------
* One table, :data:`ROUTES`: path, method, request Struct, answer. The app's own routing
  (``kern.app``) is the reference; ``tests/test_fuzz.py`` checks both list the same paths.
* Errors take the shape the route's clients read: OpenAI's everywhere but under
  ``/v1/messages``, where they are Anthropic's (``{"type": "error", "error": {...}}``).
* Generating routes answer JSON, or ``text/event-stream`` with ``stream: true``; the agent
  protocols' answers are declared as objects (their shapes are the SDKs').
* Built once per process (:func:`document`): schema generation walks every Struct.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import msgspec
from msgspec import Struct

from kern import __version__
from kern.server import anthropic_messages, api
from kern.server.openai_responses_types import ResponsesRequest

__all__ = ["ROUTES", "document"]


class AnthropicErrorBody(Struct):
    type: str
    message: str


class AnthropicError(Struct):
    """Anthropic's error shape (``anthropic_messages.error_body`` writes it)."""

    type: Literal["error"]
    error: AnthropicErrorBody


class Version(Struct):
    version: str


# What a route answers with 200: a Struct, "object" (a JSON object of the SDKs' shape) or
# "text" (plain text).
Answer = type | Literal["object", "text"]

# (path, method, request body Struct or None, 200 answer, streams with stream: true)
ROUTES: tuple[tuple[str, str, type | None, Answer, bool], ...] = (
    ("/v1/completions", "post", api.CompletionRequest, api.CompletionResponse, True),
    ("/v1/chat/completions", "post", api.ChatCompletionRequest, api.ChatCompletionResponse, True),
    ("/v1/models", "get", None, api.ModelList, False),
    ("/v1/models/{model}", "get", None, api.ModelCard, False),
    ("/tokenize", "post", api.TokenizeRequest, api.TokenizeResponse, False),
    ("/detokenize", "post", api.DetokenizeRequest, api.DetokenizeResponse, False),
    ("/v1/messages", "post", anthropic_messages.MessagesRequest, "object", True),
    ("/v1/messages/count_tokens", "post", anthropic_messages.CountTokensRequest, "object", False),
    ("/v1/responses", "post", ResponsesRequest, "object", True),
    ("/v1/responses/{response_id}", "get", None, "object", False),
    ("/health", "get", None, "text", False),
    ("/api/hello", "get", None, "text", False),
    ("/metrics", "get", None, "text", False),
    ("/version", "get", None, Version, False),
    ("/openapi.json", "get", None, "object", False),
)

# The error statuses a route can answer (besides 5xx, which the fuzzer treats as bugs): a
# bad body, a missing key, an unknown model or route, a slow or large body, a wrong type.
_ERRORS = ("400", "401", "404", "405", "408", "413", "415", "503")
_PARAMS = {"{model}": "model", "{response_id}": "response_id"}


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    return {"content": {"application/json": {"schema": schema}}}


def _refine(components: dict[str, Any], bodies: list[type]) -> None:
    """What the Structs alone do not say: a request's unknown top-level field is refused
    (``OpenAI._decode``), and so is a field of :data:`api.UNSUPPORTED` set to anything but
    null or its default (typed ``Any`` in the Struct, so that kern can name it)."""
    for body in bodies:
        schema = components[body.__name__]
        schema["additionalProperties"] = False
        for name, field in schema["properties"].items():
            if name in api.UNSUPPORTED and set(field) <= {"default"}:
                schema["properties"][name] = {
                    "type": "null",
                    "description": "not supported: refused unless null or its default",
                }


@functools.cache
def document() -> dict[str, Any]:
    """The OpenAPI 3.1 document (a JSON-ready dict, the same object each call: do not
    change it)."""
    bodies = [r[2] for r in ROUTES if r[2] is not None]
    answers = [r[3] for r in ROUTES if isinstance(r[3], type)]
    types = list(dict.fromkeys([*bodies, *answers, api.ChatCompletionChunk]))
    types += [api.ErrorResponse, AnthropicError]
    refs, components = msgspec.json.schema_components(
        types, ref_template="#/components/schemas/{name}"
    )
    ref = dict(zip(types, refs, strict=True))
    _refine(components, bodies)
    paths: dict[str, Any] = {}
    for path, method, body, answer, streams in ROUTES:
        error = ref[AnthropicError] if path.startswith("/v1/messages") else ref[api.ErrorResponse]
        if answer == "text":
            ok: dict[str, Any] = {"content": {"text/plain": {"schema": {"type": "string"}}}}
        else:
            ok = _json(ref[answer] if isinstance(answer, type) else {"type": "object"})
        if streams:  # server-sent events, one JSON object each
            ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
        op: dict[str, Any] = {
            "operationId": method + "_" + "".join(c if c.isalnum() else "_" for c in path[1:]),
            "responses": {
                "200": {"description": "the answer", **ok},
                **{s: {"description": "an error", **_json(error)} for s in _ERRORS},
            },
        }
        if body is not None:
            op["requestBody"] = {"required": True, **_json(ref[body])}
        params = [p for p in _PARAMS if p in path]
        if params:
            op["parameters"] = [
                {"name": _PARAMS[p], "in": "path", "required": True, "schema": {"type": "string"}}
                for p in params
            ]
        if path in ("/health", "/api/hello"):
            op["security"] = []  # the liveness routes, served without the key
        paths[path] = {method: op}
    return {
        "openapi": "3.1.0",
        "info": {"title": "kern", "version": __version__},
        "paths": paths,
        "components": {
            "schemas": components,
            # The key as OpenAI's clients send it or as Anthropic's do (either works anywhere).
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
        "security": [{"bearer": []}, {"x-api-key": []}],
    }
