"""The rendering of a ``/v1/responses`` generation (kern.server.openai_responses): a Response
object or the typed event stream, with reasoning, message and function_call items; the
finished response goes into the store."""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import msgspec

from kern.server import api
from kern.server.http import SSE, Send
from kern.server.openai_responses_types import ResponsesRequest, ResponseStore
from kern.server.responses import ChatRun
from kern.server.splitter import Parts
from kern.server.text import Choice

__all__ = ["ResponsesRun"]


def _reasoning_tokens(ch: Choice) -> int:
    """Tokens of ``ch`` up to and with the one that closed its reasoning (all of them if it
    never closed)."""
    if not "".join(ch.reasoning):
        return 0
    assert ch.split is not None and ch.split.reasoning is not None
    close = ch.split.reasoning.close
    seen = ""
    for k, piece in enumerate(ch.pieces):
        seen += piece
        if close in seen[-len(piece) - len(close) :]:
            return k + 1
    return len(ch.ids)


class ResponsesRun(ChatRun):
    """A ``/v1/responses`` generation (one choice): a Response, or its event stream."""

    prefix = "resp_"

    def __init__(
        self,
        *args: Any,
        request: ResponsesRequest,
        conversation: list[api.ChatMessage],
        store: ResponseStore,
        namespaced: dict[str, tuple[str, str]] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.request = request
        # The functions of namespace tools: the name the model calls -> (namespace, name).
        self.namespaced = namespaced or {}
        self.conversation = conversation
        self.store = store
        self.created_at = int(time.time())
        self.seq = 0
        # Streamed output items: [kind, id, text so far]; the last one is open.
        self.items: list[list[Any]] = []

    # --- the Response object

    def _item_id(self, prefix: str) -> str:
        return f"{prefix}_{uuid.uuid4().hex}"

    def _reasoning_item(self, id_: str, text: str, done: bool) -> dict[str, Any]:
        item: dict[str, Any] = {
            "type": "reasoning",
            "id": id_,
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if done else [],
            "status": "completed" if done else "in_progress",
        }
        if done and self.request.include:
            item["encrypted_content"] = base64.b64encode(text.encode()).decode()
        return item

    def _message_item(self, id_: str, text: str, done: bool) -> dict[str, Any]:
        return {
            "type": "message",
            "id": id_,
            "role": "assistant",
            "status": self._done_status() if done else "in_progress",
            "content": [_output_text(text)] if done else [],
        }

    def _done_status(self) -> str:
        """A finished message item's status: ``incomplete`` when cut by the length."""
        return "incomplete" if self.choices[0].finish == "length" else "completed"

    def _call_item(self, id_: str, call_id: str, name: str, arguments: str, done: bool) -> dict:
        item = {
            "type": "function_call",
            "id": id_,
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": "completed" if done else "in_progress",
        }
        # A call of a namespace tool's function: named as the client declared it.
        if name in self.namespaced:
            item["namespace"], item["name"] = self.namespaced[name]
        return item

    def _status(self) -> tuple[str, dict[str, Any] | None]:
        ch = self.choices[0]
        if ch.finish == "length":
            return "incomplete", {"reason": "max_output_tokens"}
        return "completed", None

    def _response(
        self, status: str, output: list[dict[str, Any]], error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        req = self.request
        final = status != "in_progress"
        usage = None
        if final:
            u = self.usage()
            usage = {
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": _reasoning_tokens(self.choices[0])},
                "total_tokens": u.total_tokens,
            }
        incomplete = self._status()[1] if status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model_name,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": msgspec.to_builtins(req.reasoning) if req.reasoning else None,
            "store": req.store is not False,
            "temperature": req.temperature,
            "text": {"format": (req.text.format if req.text else None) or {"type": "text"}},
            "tool_choice": msgspec.to_builtins(req.tool_choice or "auto"),
            "tools": req.tools or [],
            "top_p": req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "metadata": req.metadata or {},
            **({"client_metadata": req.client_metadata} if req.client_metadata is not None else {}),
            "user": req.user,
        }

    def _finish(self, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The final Response, stored unless ``store`` is false."""
        status = self._status()[0]
        response = self._response(status, output)
        if self.request.store is not False:
            ch = self.choices[0]
            calls = [
                api.MessageToolCall(
                    id=c.id,
                    type="function",
                    function=api.CalledFunction(name=c.name, arguments=c.arguments),
                )
                for c in ch.calls
            ]
            answer = api.ChatMessage(
                role="assistant",
                content="".join(ch.text),
                tool_calls=calls or None,
                reasoning_content="".join(ch.reasoning) or None,
            )
            self.store.put(self.id, [*self.conversation, answer], response)
        return response

    def _whole(self) -> bytes:
        ch = self.choices[0]
        output = []
        reasoning = "".join(ch.reasoning)
        if reasoning:
            output.append(self._reasoning_item(self._item_id("rs"), reasoning, True))
        text = "".join(ch.text)
        if text or not ch.calls:
            output.append(self._message_item(self._item_id("msg"), text, True))
        for c in ch.calls:
            output.append(self._call_item(self._item_id("fc"), c.id, c.name, c.arguments, True))
        return api.encode(self._finish(output))

    # --- the stream

    def _event(self, kind: str, data: dict[str, Any]) -> bytes:
        self.seq += 1
        body = api.encode({"type": kind, "sequence_number": self.seq - 1, **data})
        return b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"

    async def stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        start = self._response("in_progress", [])
        opening = [
            self._event("response.created", {"response": start}),
            self._event("response.in_progress", {"response": start}),
        ]
        await send({"type": "http.response.body", "body": b"".join(opening), "more_body": True})
        async for batch in self.events():
            out: list[bytes] = []
            for ch, text, finish in batch:
                out += self._deltas(self.released(ch, text, finish))
            if out:
                await send({"type": "http.response.body", "body": b"".join(out), "more_body": True})
        tail = self._close()
        output = [self._done_item(item) for item in self.items]
        if self.shut:
            error = {"code": "server_error", "message": "the server is shutting down"}
            failed = self._response("failed", output, error)
            tail.append(self._event("response.failed", {"response": failed}))
        else:
            if not any(item[0] == "message" for item in self.items) and not self.choices[0].calls:
                # An empty answer is still a message, as the whole response has one.
                tail += self._open("message")
                tail += self._close()
                output = [self._done_item(item) for item in self.items]
            response = self._finish(output)
            tail.append(self._event("response.completed", {"response": response}))
        await send({"type": "http.response.body", "body": b"".join(tail), "more_body": False})

    def _done_item(self, item: list[Any]) -> dict[str, Any]:
        kind, id_, text = item[0], item[1], item[2]
        if kind == "reasoning":
            return self._reasoning_item(id_, text, True)
        if kind == "message":
            return self._message_item(id_, text, True)
        call = item[3]
        return self._call_item(id_, call.id, call.name, call.arguments, True)

    def _open(self, kind: str, call: Any = None) -> list[bytes]:
        out = self._close()
        index = len(self.items)
        if kind == "reasoning":
            id_ = self._item_id("rs")
            item = self._reasoning_item(id_, "", False)
        elif kind == "message":
            id_ = self._item_id("msg")
            item = self._message_item(id_, "", False)
        else:
            id_ = self._item_id("fc")
            item = self._call_item(id_, call.id, call.name, "", False)
        self.items.append([kind, id_, "", call, True])
        out.append(self._event("response.output_item.added", {"output_index": index, "item": item}))
        if kind == "message":
            out.append(
                self._event(
                    "response.content_part.added",
                    {
                        "item_id": id_,
                        "output_index": index,
                        "content_index": 0,
                        "part": _output_text(""),
                    },
                )
            )
        return out

    def _close(self) -> list[bytes]:
        if not self.items or not self.items[-1][4]:
            return []
        item = self.items[-1]
        item[4] = False
        kind, id_, text, call = item[0], item[1], item[2], item[3]
        index = len(self.items) - 1
        at = {"item_id": id_, "output_index": index}
        out = []
        if kind == "reasoning":
            out.append(
                self._event(
                    "response.reasoning_text.done", {**at, "content_index": 0, "text": text}
                )
            )
        elif kind == "message":
            out.append(
                self._event(
                    "response.output_text.done",
                    {**at, "content_index": 0, "text": text, "logprobs": []},
                )
            )
            out.append(
                self._event(
                    "response.content_part.done",
                    {**at, "content_index": 0, "part": _output_text(text)},
                )
            )
        else:
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    {**at, "name": call.name, "arguments": call.arguments},
                )
            )
        out.append(
            self._event(
                "response.output_item.done", {"output_index": index, "item": self._done_item(item)}
            )
        )
        return out

    def _deltas(self, parts: Parts) -> list[bytes]:
        out: list[bytes] = []
        for kind, text in (("reasoning", parts.reasoning), ("message", parts.content)):
            if not text:
                continue
            if not self.items or self.items[-1][0] != kind or not self.items[-1][4]:
                out += self._open(kind)
            item = self.items[-1]
            item[2] += text
            at = {"item_id": item[1], "output_index": len(self.items) - 1, "content_index": 0}
            if kind == "reasoning":
                out.append(self._event("response.reasoning_text.delta", {**at, "delta": text}))
            else:
                out.append(
                    self._event("response.output_text.delta", {**at, "delta": text, "logprobs": []})
                )
        for call in parts.calls:
            out += self._open("function_call", call)
            item = self.items[-1]
            item[2] = call.arguments
            at = {"item_id": item[1], "output_index": len(self.items) - 1}
            out.append(
                self._event(
                    "response.function_call_arguments.delta", {**at, "delta": call.arguments}
                )
            )
        return out


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
