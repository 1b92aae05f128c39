"""The rendering of a ``/v1/messages`` generation (kern.server.anthropic_messages): a Message
or Anthropic's typed event stream, with thinking, text and tool_use blocks."""

from __future__ import annotations

from typing import Any

import msgspec

from kern.server import api
from kern.server.http import SSE, Send
from kern.server.responses import ChatRun
from kern.server.splitter import Parts
from kern.server.text import Choice

__all__ = ["MessagesRun"]

_SHUTTING_DOWN = "the server is shutting down"


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + api.encode({"type": kind, **data}) + b"\n\n"


class MessagesRun(ChatRun):
    """A ``/v1/messages`` generation (one choice): a Message, or its event stream."""

    prefix = "msg_"

    def __init__(
        self,
        *args: Any,
        thinking_budget: int | None = None,
        omit_thinking: bool = False,
        context_management: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.thinking_budget = thinking_budget
        self.omit_thinking = omit_thinking
        # The edits applied to the prompt (kern.server.anthropic_context), reported when the
        # request asked for context management.
        self.context_management = context_management
        self.open: str | None = None  # the kind of the content block being streamed
        self.blocks = 0  # content blocks started

    def _check_budget(self, ch: Choice) -> None:
        """End an answer still thinking at its budget (see the design notes)."""
        split = ch.split
        if (
            self.thinking_budget is not None
            and split is not None
            and split.state in ("start", "think")
            and len(ch.ids) >= self.thinking_budget
            and ch.finish is None
        ):
            self.abort(self.reqs[ch.index], "length")

    def _usage(self, final: bool) -> dict[str, int]:
        u = self.usage()
        cached = u.prompt_tokens_details.cached_tokens
        return {
            "input_tokens": u.prompt_tokens - cached,
            "output_tokens": u.completion_tokens if final else 0,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }

    def _stop(self, ch: Choice) -> tuple[str | None, str | None]:
        """(stop_reason, stop_sequence)."""
        if ch.finish == "length":
            return "max_tokens", None
        if isinstance(ch.stop_reason, str):
            return "stop_sequence", ch.stop_reason
        if ch.calls and ch.finish == "stop":
            return "tool_use", None
        return "end_turn", None

    def _message(self, content: list[dict[str, Any]], final: bool) -> dict[str, Any]:
        ch = self.choices[0]
        stop = self._stop(ch) if final else (None, None)
        out = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model_name,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": self._usage(final),
        }
        if self.context_management is not None:
            out["context_management"] = self.context_management
        return out

    def released(self, ch: Choice, text: str, finish: str | None) -> Parts:
        parts = super().released(ch, text, finish)
        self._check_budget(ch)
        return parts

    def _whole(self) -> bytes:
        ch = self.choices[0]
        content: list[dict[str, Any]] = []
        reasoning = "".join(ch.reasoning)
        if reasoning:
            shown = "" if self.omit_thinking else reasoning
            content.append({"type": "thinking", "thinking": shown, "signature": ""})
        text = "".join(ch.text)
        if text:
            content.append({"type": "text", "text": text})
        content += [_tool_use(c.id, c.name, c.arguments) for c in ch.calls]
        return api.encode(self._message(content, True))

    async def stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        started = False
        async for batch in self.events():
            out: list[bytes] = []
            if not started:
                out.append(_event("message_start", {"message": self._message([], False)}))
                started = True
            for ch, text, finish in batch:
                out += self._deltas(self.released(ch, text, finish))
            if out:
                await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
        ch = self.choices[0]
        tail = [] if started else [_event("message_start", {"message": self._message([], False)})]
        tail += self._close()
        if self.shut:
            tail.append(
                _event(
                    "error",
                    {
                        "error": {
                            "type": "overloaded_error",
                            "message": "the server is shutting down",
                        }
                    },
                )
            )
        else:
            stop_reason, stop_sequence = self._stop(ch)
            tail.append(
                _event(
                    "message_delta",
                    {
                        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                        "usage": self._usage(True),
                        **(
                            {"context_management": self.context_management}
                            if self.context_management is not None
                            else {}
                        ),
                    },
                )
            )
            tail.append(_event("message_stop", {}))
        await send({"type": "http.response.body", "body": b"".join(tail), "more_body": False})

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            # A thinking block ends with its signature (empty: kern signs nothing).
            delta = {"type": "signature_delta", "signature": ""}
            out.append(_event("content_block_delta", {"index": self.blocks - 1, "delta": delta}))
        self.open = None
        out.append(_event("content_block_stop", {"index": self.blocks - 1}))
        return out

    def _begin(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        out.append(_event("content_block_start", {"index": self.blocks, "content_block": block}))
        self.open = kind
        self.blocks += 1
        return out

    def _deltas(self, parts: Parts) -> list[bytes]:
        out: list[bytes] = []
        if parts.reasoning:
            if self.open != "thinking":
                out += self._begin(
                    "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                )
            if not self.omit_thinking:
                delta = {"type": "thinking_delta", "thinking": parts.reasoning}
                out.append(
                    _event("content_block_delta", {"index": self.blocks - 1, "delta": delta})
                )
        if parts.content:
            if self.open != "text":
                out += self._begin("text", {"type": "text", "text": ""})
            delta = {"type": "text_delta", "text": parts.content}
            out.append(_event("content_block_delta", {"index": self.blocks - 1, "delta": delta}))
        for call in parts.calls:
            out += self._begin("tool_use", {**_tool_use(call.id, call.name, "{}"), "input": {}})
            delta = {"type": "input_json_delta", "partial_json": call.arguments}
            out.append(_event("content_block_delta", {"index": self.blocks - 1, "delta": delta}))
        return out


def _tool_use(id_: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "tool_use", "id": id_, "name": name, "input": msgspec.json.decode(arguments)}
