"""The rendering of one generation's events into a response: a whole JSON answer or an SSE
stream, for completions (:class:`CompletionRun`) and chat completions (:class:`ChatRun`).

A run is handed what it renders with (the model's name, the tokenizer, an abort callable),
never the app; :class:`Run` holds what both share: the event loop over the queue, the usage,
the framing of a stream, and what a drain does to an open run.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import ClassVar

from kern.engine.request import Event, Request
from kern.server import api
from kern.server.http import DONE, SSE, Disconnected, Marker, Receive, Send, respond, send_sse
from kern.server.splitter import Parts
from kern.server.text import Choice
from kern.tokenizer import Tokenizer
from kern.tokenizer.token_bytes import ByteLedger

__all__ = ["Abort", "ChatRun", "CompletionRun", "Item", "Run"]

# What a run's queue carries: one sequence's event (from the scheduler thread, through the
# app) or a marker (the client hung up, the server drains).
Item = tuple[Request, Event] | Marker
# Ends a sequence early with a finish reason (``Scheduler.abort``).
Abort = Callable[[Request, str], None]
# What one pass over the queue released: (choice, text, finish reason or None).
Released = list[tuple[Choice, str, str | None]]


class Run:
    """One HTTP generation: its sequences' events turned into a response or a stream."""

    prefix: ClassVar[str]

    def __init__(
        self,
        body: api.CompletionRequest | api.ChatCompletionRequest,
        prompts: list[list[int]],
        n: int,
        reqs: list[Request],
        choices: list[Choice],
        queue: asyncio.Queue[Item],
        *,
        model_name: str,
        tokenizer: Tokenizer,
        abort: Abort,
    ) -> None:
        self.body = body
        self.prompts = prompts
        self.n = n
        self.reqs = reqs
        self.choices = choices
        self.queue = queue
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.abort = abort
        if reqs and reqs[0].num_logprobs is not None:
            # The bytes each token adds, for logprobs (kern.tokenizer.token_bytes).
            for ch in choices:
                ch.ledger = ByteLedger.of(tokenizer)
        self.id = self.prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self.shut = False

    def shut_down(self) -> None:
        """End this run now (the server drains): its choices end with ``abort``, streamed or
        whole (see kern.server.drain)."""
        self.shut = True
        self.queue.put_nowait(Marker.SHUTDOWN)

    async def watch(self, receive: Receive) -> None:
        """Abort this run's requests when the client hangs up (the only way to learn it under
        ASGI 2.1); run beside the rendering."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                for r in self.reqs:
                    self.abort(r, "abort")
                self.queue.put_nowait(Marker.HANGUP)
                return

    async def events(self) -> AsyncIterator[Released]:
        """Batches of (choice, text, finish) until every choice has its final event."""
        left = len(self.choices)
        while left:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            out: Released = []
            for item in items:
                if item is Marker.HANGUP:
                    raise Disconnected
                if item is Marker.SHUTDOWN:
                    for ch in self.choices:
                        if not ch.done and ch.finish is None:
                            ch.finish = "abort"
                            out.append((ch, ch.flush()[0], "abort"))
                        ch.done = True
                    left = 0
                    break
                assert not isinstance(item, Marker)
                req, (tok, lp, reason) = item
                ch = self.choices[req.index]
                if ch.done:
                    continue
                if tok is not None and ch.finish is None:
                    text, stopped = ch.feed(tok)
                    if lp is not None:
                        ch.logprobs.append((tok, lp[0], lp[1]))
                    if stopped:
                        ch.finish = "stop"
                        self.abort(req, "stop")
                        out.append((ch, text, "stop"))
                    elif text:
                        out.append((ch, text, None))
                if reason is not None:
                    ch.done = True
                    left -= 1
                    if ch.finish is None:
                        text, stopped = ch.flush()
                        ch.finish = "stop" if stopped else reason
                        if not stopped and reason == "stop" and ch.ids:
                            last = ch.ids[-1]
                            if last in req.stop_ids:
                                ch.stop_reason = last
                        out.append((ch, text, ch.finish))
            if out:
                yield out

    def usage(self) -> api.Usage:
        completion = sum(len(c.ids) for c in self.choices)
        prompt = sum(len(p) for p in self.prompts)
        cached = sum(self.reqs[p * self.n].cached_tokens or 0 for p in range(len(self.prompts)))
        return api.Usage(prompt, completion, prompt + completion, api.PromptTokensDetails(cached))

    async def collect(self, send: Send) -> None:
        """The whole answer, once every choice has ended (a drain ends them with ``abort``:
        the answer so far, never a 503, whose tokens would be lost)."""
        async for batch in self.events():
            for ch, text, finish in batch:
                self.released(ch, text, finish)
        await respond(send, 200, self._whole())

    async def stream(self, send: Send) -> None:
        """The answer as SSE events, each write carrying what one pass over the queue
        released, then the usage chunk if asked for and ``[DONE]``."""
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        await send_sse(send, self._opening())
        async for batch in self.events():
            lines = []
            for ch, text, finish in batch:
                # Every logprob entry not sent yet, once each: a token that released no text
                # goes out with the next chunk, and the final chunk carries all the rest.
                start, end = ch.sent_logprobs, self._ready(ch)
                ch.sent_logprobs = end
                lines.append(self._chunk(ch, text, finish, start, end))
            await send_sse(send, lines)
        tail = [self._usage_chunk()] if include_usage else []
        body = b"".join(b"data: " + line + b"\n\n" for line in tail) + DONE
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def released(self, ch: Choice, text: str, finish: str | None) -> Parts:
        """Keep ``text``, released by ``ch`` (split, where it has a splitter), for the whole
        answer; returns its parts."""
        if ch.split is not None:
            return ch.parts(text, finish is not None)
        ch.text.append(text)
        return Parts(content=text)

    def _lp(self) -> bool:
        return self.reqs[0].num_logprobs is not None

    def _ready(self, ch: Choice) -> int:
        """How many of ``ch``'s logprob entries may be sent now."""
        return len(ch.logprobs)

    def _token_ids(self, ch: Choice) -> list[int] | None:
        return list(ch.ids) if self.body.return_token_ids else None

    def _display(self, token: int) -> tuple[str, bytes]:
        """A token's text for logprobs and its bytes. A token holding part of a UTF-8
        character is written ``bytes:\\xNN...``, as OpenAI does, so keys never collide."""
        raw = self.tokenizer.token_bytes(token)
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw

    def _whole(self) -> bytes:
        """The encoded whole response, every choice ended."""
        raise NotImplementedError

    def _opening(self) -> list[bytes]:
        """The encoded chunks a stream starts with, before any token."""
        raise NotImplementedError

    def _chunk(self, ch: Choice, text: str, finish: str | None, start: int, end: int) -> bytes:
        """The encoded chunk of ``text`` released by ``ch`` (ending it when ``finish``), with
        its logprob entries ``start:end``."""
        raise NotImplementedError

    def _usage_chunk(self) -> bytes:
        """The encoded chunk that carries the usage, after the last choice's."""
        raise NotImplementedError


class CompletionRun(Run):
    """A ``/v1/completions`` generation."""

    prefix = "cmpl-"
    body: api.CompletionRequest

    def _whole(self) -> bytes:
        lp = self._lp()
        choices = [
            api.CompletionChoice(
                c.index,
                "".join(c.text),
                self._logprobs(c, 0, len(c.logprobs), 0) if lp else None,
                c.finish,  # type: ignore[arg-type]
                c.stop_reason,
                self._token_ids(c),
            )
            for c in self.choices
        ]
        out = api.CompletionResponse(self.id, self.created, self.model_name, choices, self.usage())
        return api.encode(out)

    def _opening(self) -> list[bytes]:
        return []

    def _chunk(self, ch: Choice, text: str, finish: str | None, start: int, end: int) -> bytes:
        entries = None
        if self._lp():
            entries = self._logprobs(ch, start, end, ch.sent_offset)
            ch.sent_offset += sum(len(p) for p in ch.pieces[start:end])
        choice = api.CompletionChoice(
            ch.index,
            text,
            entries,
            finish,  # type: ignore[arg-type]
            ch.stop_reason if finish else None,
            self._token_ids(ch) if finish else None,
        )
        return api.encode(api.CompletionResponse(self.id, self.created, self.model_name, [choice]))

    def _usage_chunk(self) -> bytes:
        return api.encode(
            api.CompletionResponse(self.id, self.created, self.model_name, [], self.usage())
        )

    def _logprobs(self, ch: Choice, start: int, end: int, offset: int) -> api.CompletionLogprobs:
        """Entries ``start:end`` of ``ch``: ``tokens`` are the text each token released, so
        they join back to the answer's text, and ``text_offset`` is where each begins."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for k in range(start, end):
            _tok, lp, top = ch.logprobs[k]
            piece = ch.pieces[k] if k < len(ch.pieces) else ""
            tokens.append(piece)
            token_lps.append(lp)
            tops.append({self._display(i)[0]: v for i, v in top})
            offsets.append(offset)
            offset += len(piece)
        return api.CompletionLogprobs(tokens, token_lps, tops, offsets)


class ChatRun(Run):
    """A ``/v1/chat/completions`` generation: messages and deltas, with the reasoning and tool
    calls its choices' splitters find (kern.server.splitter)."""

    prefix = "chatcmpl-"
    body: api.ChatCompletionRequest

    def _whole(self) -> bytes:
        lp = self._lp()
        choices = [
            api.ChatChoice(
                c.index,
                _message(c),
                self._logprobs(c, 0, len(c.logprobs)) if lp else None,
                c.finish_reason(),  # type: ignore[arg-type]
                c.stop_reason,
                self._token_ids(c),
            )
            for c in self.choices
        ]
        out = api.ChatCompletionResponse(
            self.id, self.created, self.model_name, choices, self.usage()
        )
        return api.encode(out)

    def _opening(self) -> list[bytes]:
        # The role first, as OpenAI's streams do.
        first = [
            api.ChatChunkChoice(c.index, api.Delta(role="assistant", content=""), None, None, None)
            for c in self.choices
        ]
        return [api.encode(api.ChatCompletionChunk(self.id, self.created, self.model_name, first))]

    def _chunk(self, ch: Choice, text: str, finish: str | None, start: int, end: int) -> bytes:
        entries = self._logprobs(ch, start, end) if self._lp() else None
        if ch.split is not None:
            delta = _delta(ch, ch.parts(text, finish is not None))
        else:
            delta = api.Delta(content=text) if text else api.Delta()
        choice = api.ChatChunkChoice(
            ch.index,
            delta,
            entries,
            ch.finish_reason() if finish else None,  # type: ignore[arg-type]
            ch.stop_reason if finish else None,
            self._token_ids(ch) if finish else None,
        )
        return api.encode(api.ChatCompletionChunk(self.id, self.created, self.model_name, [choice]))

    def _usage_chunk(self) -> bytes:
        return api.encode(
            api.ChatCompletionChunk(self.id, self.created, self.model_name, [], self.usage())
        )

    def _ready(self, ch: Choice) -> int:
        # An entry goes out once its bytes are final: the text released covers them (a
        # partial character or a possible stop string is still held), or the choice ended.
        if ch.ledger is None:
            return len(ch.logprobs)
        return min(len(ch.logprobs), ch.ledger.ready(ch.finish is not None))

    def _logprobs(self, ch: Choice, start: int, end: int) -> api.ChatLogprobs:
        """Entries ``start:end`` of ``ch``: each token's ``bytes`` are those it adds to the
        text (kern.tokenizer.token_bytes), the alternatives' their own."""
        content = []
        for k in range(start, end):
            tok, lp, top = ch.logprobs[k]
            text, raw = self._display(tok)
            if ch.ledger is not None:
                raw = ch.ledger.entry(k)
            tops = []
            for i, v in top:
                t, b = self._display(i)
                tops.append(api.TopLogprob(t, v, list(b)))
            content.append(api.TokenLogprob(text, lp, list(raw), tops))
        return api.ChatLogprobs(content)


def _message(ch: Choice) -> api.AssistantMessage:
    content = "".join(ch.text)
    if ch.split is None:
        return api.AssistantMessage(content, "assistant")
    calls = [api.OutToolCall(c.id, api.OutFunction(c.name, c.arguments)) for c in ch.calls]
    reasoning = "".join(ch.reasoning)
    return api.AssistantMessage(
        None if calls and not content else content,
        "assistant",
        calls or None,
        reasoning or None,
    )


def _delta(ch: Choice, parts: Parts) -> api.Delta:
    """A stream chunk's delta: each tool call whole, indexed in the choice's order."""
    first = len(ch.calls) - len(parts.calls)
    calls = [
        api.DeltaToolCall(first + k, c.id, api.OutFunction(c.name, c.arguments))
        for k, c in enumerate(parts.calls)
    ]
    return api.Delta(
        content=parts.content or None,
        reasoning_content=parts.reasoning or None,
        tool_calls=calls or None,
    )
