"""Request and response bodies of the OpenAI-compatible API, as msgspec Structs.

Design notes
------------
* Every body is a Struct: msgspec checks types and ``Meta`` bounds while it parses, so a bad
  body costs one pass and no dict is built. Cross-field rules (``max_tokens`` against
  ``max_completion_tokens``, ``top_logprobs`` without ``logprobs``) live in ``__post_init__``;
  a ``ValueError`` raised there surfaces as a ``msgspec.ValidationError`` like any other.
* One ``Decoder`` and one ``Encoder`` per type, built once at import (``decode`` below).
* Errors take OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``. msgspec ends
  a validation message with `` - at `$.field` ``: that path is the ``param``; a missing field
  is named inside the message instead (``Object missing required field `model` ``).
* An unknown top-level request field is a 400 naming it, as OpenAI answers
  (``OpenAI._decode``; ``KERN_ALLOW_UNKNOWN_FIELDS=1`` accepts them instead, named in a
  warning log line, as vLLM does); every OpenAI and vLLM field kern knows is implemented or
  refused by name (:data:`UNSUPPORTED`).
* JSON nested deeper than :data:`MAX_JSON_DEPTH` is refused before it is parsed: msgspec
  recurses per level and skipping ~1,000 nested arrays in an unknown field raised
  ``RecursionError``. The check counts brackets first (C speed); only a body with more
  brackets than the limit is scanned for its real depth, outside strings.
* Responses leave out ``None`` fields (``omit_defaults``) except where OpenAI clients expect
  the key (``logprobs``, ``finish_reason`` in a stream chunk), which are plain fields.
"""

from __future__ import annotations

import logging
import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

from kern.server.request_context import current_id

__all__ = [
    "ApiError",
    "ChatCompletionRequest",
    "CompletionRequest",
    "DetokenizeRequest",
    "TokenizeRequest",
    "decode",
    "encode",
    "error_body",
]

# Bounds that keep a request from asking for the impossible before the scheduler sees it. The
# scheduler checks the real limits (the pool and the model's context) and names them.
MAX_TOKENS_LIMIT = 1 << 20
MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP = 8
MAX_JSON_DEPTH = 64
# Model names echoed in error messages are cut to this many characters.
MAX_ECHO = 64

PositiveInt = Annotated[int, Meta(ge=1, le=MAX_TOKENS_LIMIT)]
TokenId = Annotated[int, Meta(ge=0, le=0xFFFFFFFF)]
Temperature = Annotated[float, Meta(ge=0.0, le=2.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1)]
N = Annotated[int, Meta(ge=1, le=MAX_N)]
Seed = Annotated[int, Meta(ge=-(1 << 63), le=(1 << 63) - 1)]


class StreamOptions(Struct, forbid_unknown_fields=False):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None

    def __post_init__(self) -> None:
        if self.continuous_usage_stats:
            raise ValueError(
                "continuous_usage_stats is not supported"
                " - at `$.stream_options.continuous_usage_stats`"
            )


Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
Prob = Annotated[float, Meta(ge=0.0, le=1.0)]
Count = Annotated[int, Meta(ge=0, le=MAX_TOKENS_LIMIT)]
# vLLM's request priority: lower is served first.
Priority = Annotated[int, Meta(ge=-(1 << 31), le=(1 << 31) - 1)]


def _never(value: Any) -> bool:
    return False


# OpenAI request fields kern does not implement, with the values that ask for nothing (what
# the field means when it is left out). Anything else is a 400 naming the field: a field a
# client sets must never be accepted and ignored. null always means "left out".
UNSUPPORTED: dict[str, Any] = {
    "best_of": lambda v: v == 1,
    "echo": lambda v: v is False,
    "suffix": lambda v: v == "",
    "functions": lambda v: v == [],
    "function_call": lambda v: v == "none",
    "audio": _never,
    "modalities": lambda v: v == ["text"],
    "prediction": _never,
    # Taken by harmony models (gpt-oss); another model refuses it (kern.server.openai).
    "reasoning_effort": lambda v: v in ("low", "medium", "high"),
    "verbosity": _never,
    "web_search_options": _never,
    "store": lambda v: v is False,
    "service_tier": lambda v: v in ("auto", "default"),
    "moderation": _never,
    "prompt_cache_retention": _never,
    "prompt_cache_options": _never,
    "guided_json": _never,
    "guided_regex": _never,
    "guided_choice": _never,
    "guided_grammar": _never,
    "structured_outputs": _never,
    "use_beam_search": lambda v: v is False,
    "prompt_logprobs": _never,
    "truncate_prompt_tokens": _never,
    "continue_final_message": lambda v: v is False,
    "documents": _never,
    "mm_processor_kwargs": _never,
    # vLLM's.
    "bad_words": lambda v: v == [],
    "spaces_between_special_tokens": lambda v: v is True,
    "return_tokens_as_token_ids": lambda v: v is False,
    "chat_template": _never,
}


def _refuse_unsupported(struct: Any) -> None:
    for name in UNSUPPORTED:
        value = getattr(struct, name, None)
        if value is not None and not UNSUPPORTED[name](value):
            raise ValueError(f"{name} is not supported (only its default) - at `$.{name}`")


class _Sampling(Struct, kw_only=True):
    """Parameters shared by completions and chat completions. Every optional field may be
    null, meaning unset: the checkpoint's generation_config.json default where it has one,
    else OpenAI's (see ``kern.server.openai.OpenAI._sampling``)."""

    model: str
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    # -1 and 0 both disable top-k (vLLM's spelling and kern's).
    top_k: TopK | None = None
    min_p: Prob | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=100.0)] | None = None
    # Token id (a string, as JSON keys are) -> a bias added to its logit.
    logit_bias: dict[str, Bias] | None = None
    min_tokens: Count | None = None
    seed: Seed | None = None
    stop: str | Annotated[list[str], Meta(max_length=MAX_STOP)] | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    n: N | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # A kern (and vLLM) extension: each choice carries the ids it produced, so a client can
    # send the next turn as ids (an answer's text need not tokenize back to its ids).
    return_token_ids: bool | None = None
    # vLLM's: only these ids may be sampled (a mask before sampling).
    allowed_token_ids: Annotated[list[TokenId], Meta(min_length=1)] | None = None
    # vLLM's: special tokens' text left out of the answer (the default) or kept.
    skip_special_tokens: bool | None = None
    # vLLM's: the tokenizer's special tokens (a BOS) added to the prompt's text; unset: not
    # added (a chat template writes its own).
    add_special_tokens: bool | None = None
    # vLLM's: lower is admitted first; equal priorities in arrival order.
    priority: Priority | None = None
    # Identifiers that ask for no behaviour: accepted and put in the request's log line.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    # Refused unless left out or set to their default (UNSUPPORTED).
    best_of: Any = None
    functions: Any = None
    function_call: Any = None
    # {"type": "text" | "json_object" | "json_schema", ...}: checked and compiled by the app
    # (kern.engine.structured).
    response_format: dict[str, Any] | None = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    store: Any = None
    service_tier: Any = None
    moderation: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    use_beam_search: Any = None
    prompt_logprobs: Any = None
    truncate_prompt_tokens: Any = None
    documents: Any = None
    mm_processor_kwargs: Any = None
    bad_words: Any = None
    spaces_between_special_tokens: Any = None
    return_tokens_as_token_ids: Any = None

    def _check(self) -> None:
        _refuse_unsupported(self)
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true - at `$.stream_options`")
        # As vLLM: an empty stop string would match before every token.
        if "" in self.stop_strings():
            raise ValueError("stop cannot contain an empty string - at `$.stop`")
        cap = self.max_tokens
        if cap is None:
            cap = getattr(self, "max_completion_tokens", None)  # chat's other spelling
        if self.min_tokens and cap is not None and self.min_tokens > cap:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) is over max_tokens ({cap}) - at `$.min_tokens`"
            )
        for key in self.logit_bias or {}:
            # ASCII digits only: str.isdigit() is true of "²" (int() refuses it) and "٧".
            if not (key.isascii() and key.isdigit()) or int(key) > 0xFFFFFFFF:
                raise ValueError(
                    f"logit_bias key {echo(key)} is not a token id - at `$.logit_bias`"
                )

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling, kw_only=True, forbid_unknown_fields=True):
    # One prompt (text or ids) or a batch (texts or id lists), checked in __post_init__:
    # msgspec takes one array-like type per union.
    prompt: str | Annotated[list[str | int | list[TokenId]], Meta(min_length=1)]
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: Any = None
    suffix: Any = None
    # Chat fields: refused here unless they ask for nothing.
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def __post_init__(self) -> None:
        self._check()
        if self.tools not in (None, []) or self.tool_choice not in (None, "none"):
            field_ = "tools" if self.tools not in (None, []) else "tool_choice"
            raise ValueError(
                f"{field_} is not supported on completions (use chat completions) - at `$.{field_}`"
            )
        if isinstance(self.prompt, str):
            if not self.prompt:
                raise ValueError("prompt is empty - at `$.prompt`")
            return
        kinds = {type(p) for p in self.prompt}
        if kinds == {int}:
            for i, t in enumerate(self.prompt):
                if not 0 <= t <= 0xFFFFFFFF:  # type: ignore[operator]
                    raise ValueError(f"{t} is not a token id - at `$.prompt[{i}]`")
        elif len(kinds) != 1:
            raise ValueError(
                "a prompt list is token ids, or a batch of texts, or a batch of id lists, "
                "not a mix - at `$.prompt`"
            )
        else:
            for i, p in enumerate(self.prompt):
                if not p:
                    raise ValueError(f"prompt {i} of the batch is empty - at `$.prompt[{i}]`")

    def prompts(self) -> list[str | list[int]]:
        """The batch: one entry per prompt (a text or its ids)."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]


class TextPart(Struct, kw_only=True):
    # Checked below rather than as a Literal: an image's part gets a 400 that says so.
    type: str
    text: str | None = None

    def __post_init__(self) -> None:
        if self.type in ("image_url", "input_audio", "file", "image", "input_image"):
            raise ValueError(
                f"a content part of type {self.type!r} is not supported: kern serves text "
                "models (images, audio and files are not supported)"
            )
        if self.type != "text":
            raise ValueError(f"a content part of type {self.type!r} is not supported (only text)")
        if self.text is None:
            raise ValueError("a text part needs text")


# OpenAI's rule for function names (letters, digits, underscores, dashes; at most 64), with
# dots and colons, which MCP tool names use. Never a quote: names go into JSON and grammars.
FunctionName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class FunctionDef(Struct, kw_only=True, omit_defaults=True):
    name: FunctionName
    description: str | None = None
    # A JSON schema of the arguments object; none: any object.
    parameters: dict[str, Any] | None = None
    # Accepted either way: kern always enforces the schema of a call it parses (see
    # kern.engine.structured), which is what strict asks for.
    strict: bool | None = None


class Tool(Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(Struct, kw_only=True):
    name: FunctionName


class NamedToolChoice(Struct, kw_only=True):
    type: Literal["function"]
    function: ChosenFunction


class CalledFunction(Struct, kw_only=True):
    name: FunctionName
    arguments: str


class MessageToolCall(Struct, kw_only=True):
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(Struct, kw_only=True, forbid_unknown_fields=False):
    # The roles the chat templates kern serves render; others are refused here by name.
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # An assistant turn's calls; a tool turn answers one of them by id.
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    # An assistant turn's reasoning, as kern returned it: accepted, not rendered (templates
    # drop earlier turns' reasoning).
    reasoning_content: str | None = None

    def check(self, at: str) -> None:
        """Rules across fields; ``at``: the message's path (``messages[3]``). Checked by the
        request, which knows the index."""
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages - at `$.{at}.tool_calls`")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError(f"a tool message needs tool_call_id - at `$.{at}.tool_call_id`")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id belongs to tool messages - at `$.{at}.tool_call_id`")
        for i, call in enumerate(self.tool_calls or ()):
            try:
                args = msgspec.json.decode(call.function.arguments)
            except msgspec.DecodeError:
                args = None
            if not isinstance(args, dict):
                raise ValueError(
                    "arguments is not a JSON object"
                    f" - at `$.{at}.tool_calls[{i}].function.arguments`"
                )

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)


# Template variables a request may not set through chat_template_kwargs: the server sets them.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "add_generation_prompt", "tools", "documents", "bos_token", "eos_token",
     "pad_token", "unk_token"}
)  # fmt: skip


class ChatCompletionRequest(_Sampling, kw_only=True, forbid_unknown_fields=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: bool | None = None
    # Variables for the chat template (Qwen3's enable_thinking, ...).
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: Any = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extensions, refused unless at their default (UNSUPPORTED).
    echo: Any = None
    chat_template: Any = None

    def __post_init__(self) -> None:
        self._check()
        for i, m in enumerate(self.messages):
            m.check(f"messages[{i}]")
        names = [t.function.name for t in self.tools or ()]
        for i, tool in enumerate(self.tools or ()):
            schema = tool.function.parameters
            if schema is not None and schema.get("type", "object") != "object":
                raise ValueError(
                    "parameters must describe an object (a call's arguments are one)"
                    f" - at `$.tools[{i}].function.parameters`"
                )
        if len(set(names)) != len(names):
            raise ValueError("two tools have the same name - at `$.tools`")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            # "auto" too: with nothing to call it would parse calls of no tool.
            name = choice.function.name if isinstance(choice, NamedToolChoice) else choice
            raise ValueError(f"tool_choice {name!r} needs tools - at `$.tool_choice`")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(
                f"tool_choice names {choice.function.name!r}, which is not in tools"
                " - at `$.tool_choice`"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true - at `$.top_logprobs`")
        if (
            self.max_completion_tokens is not None
            and self.max_tokens is not None
            and self.max_completion_tokens != self.max_tokens
        ):
            raise ValueError(
                "max_tokens and max_completion_tokens disagree - at `$.max_completion_tokens`"
            )
        for key in self.chat_template_kwargs or {}:
            if key in _RESERVED_TEMPLATE_KWARGS:
                raise ValueError(
                    f"chat_template_kwargs may not set {key!r} - at `$.chat_template_kwargs`"
                )

    def tool_choice_name(self) -> str:
        """The tool choice: "none", "auto", "required" or the named function ("auto" when tools are
        given without a choice, "none" without tools: OpenAI's defaults)."""
        choice = self.tool_choice
        if not self.tools:
            return "none"  # __post_init__ refused any other choice without tools
        if isinstance(choice, NamedToolChoice):
            return choice.function.name
        return "auto" if choice is None else choice

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_tokens is None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    model: str | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Rendered into a messages prompt, as a chat request with them would be.
    tools: list[Tool] | None = None
    # vLLM's: the response carries token_strs, each id's token string.
    return_token_strs: bool | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages - at `$.prompt`")
        if self.tools and self.messages is None:
            raise ValueError("tools go with messages - at `$.tools`")
        for i, m in enumerate(self.messages or ()):
            m.check(f"messages[{i}]")
        for key in self.chat_template_kwargs or {}:
            if key in _RESERVED_TEMPLATE_KWARGS:
                raise ValueError(
                    f"chat_template_kwargs may not set {key!r} - at `$.chat_template_kwargs`"
                )


class DetokenizeRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    tokens: list[TokenId]
    model: str | None = None


# --- responses --------------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(Struct, omit_defaults=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    # The stop string or stop token id that ended the choice; null otherwise (end of
    # sequence, length), as vLLM reports it.
    stop_reason: str | int | None
    token_ids: list[int] | None = None


class CompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[TokenLogprob]


class OutFunction(Struct):
    name: str
    arguments: str


class OutToolCall(Struct):
    id: str
    function: OutFunction
    type: str = "function"


class AssistantMessage(Struct, omit_defaults=True):
    # null when the answer is only tool calls, as OpenAI sends it.
    content: str | None
    role: str
    tool_calls: list[OutToolCall] | None = None
    reasoning_content: str | None = None


class DeltaToolCall(Struct):
    index: int
    id: str
    function: OutFunction
    type: str = "function"


class ChatChoice(Struct, omit_defaults=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None
    stop_reason: str | int | None
    token_ids: list[int] | None = None


class ChatCompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class Delta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(Struct, omit_defaults=True):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None
    stop_reason: str | int | None
    token_ids: list[int] | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class ModelCard(Struct):
    id: str
    created: int
    owned_by: str = "kern"
    max_model_len: int | None = None
    # What a request that leaves them unset samples with (the checkpoint's
    # generation_config.json; OpenAI's defaults for the rest).
    sampling_defaults: dict[str, float] | None = None
    object: str = "model"


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class TokenizeResponse(Struct, omit_defaults=True):
    tokens: list[int]
    count: int
    max_model_len: int
    # With return_token_strs: each id's token string (the vocabulary's spelling, vLLM's).
    token_strs: list[str] | None = None


class DetokenizeResponse(Struct):
    prompt: str


class ErrorBody(Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Struct):
    error: ErrorBody


# --- decoding and errors ----------------------------------------------------------------------


class ApiError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers or []


T = TypeVar("T")
_DECODERS: dict[type, msgspec.json.Decoder[Any]] = {
    t: msgspec.json.Decoder(t)
    for t in (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
}
_ENCODER = msgspec.json.Encoder()
_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_FIELD = re.compile(r"required field `([^`]+)`")
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_log = logging.getLogger("kern")


def echo(text: str) -> str:
    """``text`` for an error message, cut to :data:`MAX_ECHO` characters."""
    return (
        repr(text) if len(text) <= MAX_ECHO else repr(text[:MAX_ECHO]) + f"... ({len(text)} chars)"
    )


def json_depth(body: bytes) -> int:
    """How deep ``body``'s arrays and objects nest (brackets inside strings not counted);
    a cheap upper bound when that is under :data:`MAX_JSON_DEPTH`."""
    bound = body.count(b"[") + body.count(b"{")
    if bound <= MAX_JSON_DEPTH:
        return bound
    import numpy as np

    b = np.frombuffer(_STRING.sub(b'""', body), dtype=np.uint8)
    step = ((b == 0x5B) | (b == 0x7B)).astype(np.int32) - ((b == 0x5D) | (b == 0x7D))
    return int(np.cumsum(step).max(initial=0))


# An unknown field of a struct that forbids them, as msgspec says it.
_UNKNOWN = re.compile(r"^Object contains unknown field `([^`]*)`(?: - at `\$([^`]*)`)?$")
_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
# Unknown fields one body may have dropped (each costs a decode): past it, a 400.
MAX_UNKNOWN = 64
# How the 400 for an unknown field says to turn the warning on.
UNKNOWN_SWITCH = (
    "kern refuses request fields it does not know; to drop them with a warning instead, start "
    "the server with --allow-unknown-fields (kern.toml: allow_unknown_fields = true; "
    "environment: KERN_ALLOW_UNKNOWN_FIELDS=1)"
)


def unknown_fields(names: list[str], allow: bool) -> None:
    """Request fields kern does not know (their paths, ``messages[1].foo``): a 400 naming
    them, or (``allow``, the server's allow_unknown_fields) a warning naming them."""
    if not names:
        return
    listed = ", ".join(echo(k) for k in names[:20])
    plural = "s" if len(names) > 1 else ""
    if not allow:
        raise ApiError(
            400,
            f"unknown parameter{plural} {listed} ({UNKNOWN_SWITCH})",
            param=names[0][:MAX_ECHO],
            code="unknown_parameter",
        )
    _log.warning("request %s: dropped unknown field%s %s", current_id(), plural, listed)


def decode(body: bytes, type_: type[T], *, allow_unknown: bool = False) -> T:
    """Parse and validate ``body`` as ``type_``; raises :class:`ApiError` (400) naming the
    field when it can. A field ``type_`` does not know, at any depth where its structs forbid
    unknown fields, is a 400 naming every such field, or with ``allow_unknown`` dropped and
    named in a warning (:func:`unknown_fields`)."""
    if json_depth(body) > MAX_JSON_DEPTH:
        raise ApiError(400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    decoder = _DECODERS.get(type_)
    if decoder is None:  # another module's body (the agent protocols), built once
        decoder = _DECODERS[type_] = msgspec.json.Decoder(type_)
    dropped: list[str] = []
    value: Any = None
    while True:
        try:
            out = decoder.decode(body) if value is None else msgspec.convert(value, type_)
            break
        except RecursionError:
            raise ApiError(
                400, f"JSON nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json"
            ) from None
        except msgspec.ValidationError as e:
            found = _UNKNOWN.match(str(e))
            if found is None:
                raise _validation_error(str(e)) from None
            if len(dropped) >= MAX_UNKNOWN:
                raise ApiError(
                    400, f"more than {MAX_UNKNOWN} unknown fields", code="unknown_parameter"
                ) from None
            if value is None:
                value = msgspec.json.decode(body)
            where, name = found.group(2) or "", found.group(1)
            dropped.append(f"{where.lstrip('.')}.{name}" if where.lstrip(".") else name)
            # Dropped whether or not they are allowed, so that the 400 names every one.
            _drop(value, where, name)
        except msgspec.DecodeError as e:
            raise ApiError(400, f"invalid JSON body: {e}", code="invalid_json") from None
    unknown_fields(dropped, allow_unknown)
    return out


def _drop(value: Any, path: str, name: str) -> None:
    """Remove key ``name`` from the object at ``path`` (msgspec's ``.field[3].field``)."""
    for key, index in _SEGMENT.findall(path):
        value = value[int(index)] if index else value[key]
    del value[name]


def _validation_error(message: str) -> ApiError:
    param = None
    m = _AT.search(message)
    if m:
        param = m.group(1) or None
        message = message[: m.start()] + f" (at {param})" if param else message[: m.start()]
    else:
        f = _FIELD.search(message)
        if f:
            param = f.group(1)
    return ApiError(400, message, param=param, code="invalid_value")


def encode(value: Any) -> bytes:
    return _ENCODER.encode(value)


def error_body(e: ApiError) -> bytes:
    return _ENCODER.encode(ErrorResponse(ErrorBody(e.message, e.type, e.param, e.code)))
