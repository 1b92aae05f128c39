"""``kern.app:app``: the OpenAI-compatible HTTP API as a raw ASGI application.

This module is the transport: lifespan, routing, auth, reading bodies, responding, draining
and the crash exit. The handlers, the settings and the rendering of answers live in
kern.server, whose docstring carries the server's design notes.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kern import __version__
from kern.chat_formats import FORMATS, reasoning_block
from kern.checkpoint.load import sampling_defaults
from kern.engine.cuda_graphs import graphs_at_load
from kern.engine.load import Engine
from kern.engine.request import Event, Request
from kern.engine.scheduler import Scheduler
from kern.engine.structured import GrammarBudget, Grammars
from kern.engine.thread import start_scheduler
from kern.kern_toml import Target
from kern.metrics import Metrics
from kern.server import anthropic_messages, api, heap, openai_responses, openapi
from kern.server.anthropic_betas import note_betas
from kern.server.api import ApiError
from kern.server.cors import Cors
from kern.server.drain import Admission, retry_elsewhere
from kern.server.hangup import StepGate
from kern.server.http import JSON, Disconnected, Receive, Scope, Send, headers_only, respond
from kern.server.logs import RECORD, RequestRecord, StatsLine, request_id
from kern.server.openai import OpenAI
from kern.server.openai_responses_types import ResponseStore
from kern.server.request_head import UnreadBody, check_framing
from kern.server.settings import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES, Settings
from kern.server.startup import exit_failed_start

__all__ = ["App", "app"]

log = logging.getLogger("kern")

# Routes that answer without the API key: liveness only (/api/hello: Claude Code's probe).
_KEYLESS = frozenset({"/health", "/api/hello"})

CRASH_EXIT_CODE = 101
# Seconds between a scheduler failure and the exit: the open requests' ends reach their
# clients meanwhile, and new requests get a 503.
CRASH_EXIT_DELAY = 0.5

Handler = Callable[[Scope, Receive, Send], Awaitable[None]]


class App:
    """The ASGI application. Loads the model in :meth:`start` (at lifespan startup unless
    called before), through ``load_engine`` (``kern.engine.load.Engine.load`` unless given: the
    crash test passes one whose runner fails)."""

    def __init__(
        self,
        load_engine: Callable[[Target], Engine] | None = None,
        settings: Settings | None = None,
    ) -> None:
        self.load_engine = load_engine
        self.settings = settings
        self.engine: Engine | None = None
        self.decode_graphs = ""  # the start-up line's words on decode (graphs_at_load)
        self.scheduler: Scheduler | None = None
        self.metrics: Metrics | None = None
        # The loaded model's handlers (kern.server.openai), set before ``scheduler``.
        self.openai: OpenAI | None = None
        self.created = int(time.time())
        self.api_key: bytes | None = None
        self.max_body = DEFAULT_MAX_BODY_BYTES
        self.body_timeout = DEFAULT_BODY_TIMEOUT
        # Browser clients' origins (kern.server.cors); None: CORS is off.
        self.cors: Cors | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        # How far the scheduler may run ahead of the loop (kern.server.hangup).
        self.gate = StepGate()
        # Whether requests are admitted, and those in flight (kern.server.drain waits on them).
        self.admission = Admission()
        self._stats_task: asyncio.Task[None] | None = None
        self._trim_task: asyncio.Task[None] | None = None
        self._routes: dict[str, tuple[str, Handler]] = {
            "/v1/completions": ("POST", self._completions),
            "/v1/chat/completions": ("POST", self._chat),
            "/v1/models": ("GET", self._models),
            "/tokenize": ("POST", self._tokenize),
            "/detokenize": ("POST", self._detokenize),
            "/health": ("GET", self._health),
            # Claude Code's warm-up probe (HEAD, no key) as it starts: the server is there.
            "/api/hello": ("GET", self._health),
            "/metrics": ("GET", self._metrics),
            "/version": ("GET", self._version),
            "/openapi.json": ("GET", self._openapi),
            "/v1/messages": ("POST", self._messages),
            "/v1/messages/count_tokens": ("POST", self._count_tokens),
            "/v1/responses": ("POST", self._responses),
        }
        # Stored Responses API responses (kern.server.openai_responses).
        self.response_store = ResponseStore()

    # --- ASGI -------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.loop = asyncio.get_running_loop()
                if self.scheduler is None:
                    try:
                        await asyncio.to_thread(self.start)
                    except Exception as e:
                        exit_failed_start(e)  # one line for a user's mistake, exit 2
                if self.settings is not None and self.settings.stats_interval > 0:
                    assert self.metrics is not None
                    stats = StatsLine(self.metrics, self.settings.stats_interval)
                    self._stats_task = self.loop.create_task(stats.run())
                self._trim_task = self.loop.create_task(heap.trim_forever())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.drain()
                for task in (self._stats_task, self._trim_task):
                    if task is not None:
                        task.cancel()
                if self.scheduler is not None:
                    await asyncio.to_thread(self.scheduler.stop)
                await send({"type": "lifespan.shutdown.complete"})
                return

    def start(self) -> Engine | None:
        """Load the model and start the scheduler (blocking; call it off the event loop).
        Returns the engine. Raises ``UsageError`` / ``CheckpointError`` for a user's mistake."""
        if self.settings is None:
            self.settings = Settings.from_env()
        key = self.settings.api_key
        self.api_key = key.encode() if key else None
        self.max_body = self.settings.max_body
        self.body_timeout = self.settings.body_timeout
        if self.settings.allowed_origins:
            self.cors = Cors(self.settings.allowed_origins)
        # Built on the scheduler's own thread: every torch op runs there.
        self.scheduler = start_scheduler(self._load)
        return self.engine

    def _load(self) -> Scheduler:
        assert self.settings is not None and self.settings.target is not None
        target = self.settings.target
        engine = (self.load_engine or Engine.load)(target)
        self.engine = engine
        tokenizer = self.settings.tokenizer(engine.checkpoint.tokenizer)
        config = engine.checkpoint.config
        max_len = self.settings.max_model_len or config.max_position_embeddings
        self.metrics = Metrics(target.name, max_len)
        scheduler = engine.scheduler(
            self._deliver, metrics=self.metrics, on_crash=self._crashed, max_model_len=max_len
        )
        eager = self.settings.enforce_eager  # at load: plain hypercorn gets graphs too
        self.decode_graphs = graphs_at_load(engine, scheduler, max_len=max_len, eager=eager)
        # Compiled in a process of their own, within the target's budgets; made ready in the
        # background now, not by the first request with tools (a coding agent's first).
        grammars = Grammars(
            tokenizer,
            config.vocab_size,
            GrammarBudget(target.grammar_timeout, target.grammar_max_bytes),
        )
        threading.Thread(target=grammars.warm, name="kern-grammar-warm", daemon=True).start()
        self.openai = OpenAI(
            scheduler,
            tokenizer,
            grammars,
            model_name=target.name,
            aliases=self.settings.served_model_names,
            vocab_size=config.vocab_size,
            max_model_len=max_len,
            sampling_defaults=sampling_defaults(target.checkpoint),
            reasoning=reasoning_block(target.reasoning_parser),
            chat_format=FORMATS[target.tool_parser],
            log_prompts=self.settings.log_prompts,
            created=self.created,
            allow_unknown_fields=self.settings.allow_unknown_fields or target.allow_unknown_fields,
            hosted_tools=target.hosted_tools,
        )
        return scheduler

    def drain(self) -> None:
        """Stop admitting and end every open generation (see kern.server's design notes). On
        the event loop's thread; idempotent."""
        self.admission.draining = True
        if self.openai is not None:
            self.openai.shut_down()

    def _deliver(self, events: list[tuple[Request, Event]]) -> None:
        """From the scheduler thread, once per step; held while the event loop is
        ``StepGate.ahead`` steps behind, so a hang-up costs a bounded number of steps."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            self.gate.deliver(loop, _dispatch, events)

    def _crashed(self, e: BaseException) -> None:
        print(
            f"kern: the scheduler failed ({type(e).__name__}: {e}); exiting with code "
            f"{CRASH_EXIT_CODE}",
            file=sys.stderr,
            flush=True,
        )
        # Give the event loop a moment to end the open streams, then go: a server whose
        # scheduler is gone must not keep its port open with requests hanging.
        threading.Timer(CRASH_EXIT_DELAY, os._exit, (CRASH_EXIT_CODE,)).start()

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        record = RequestRecord(request_id(scope["headers"]), scope["method"], path)
        RECORD.set(record)
        tags = [(b"x-request-id", record.id.encode())]
        if self.cors is not None:
            tags += self.cors.headers(scope["headers"])

        receive = (unread := UnreadBody(scope, receive)).receive

        async def send_tagged(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                headers = [*message.get("headers", ()), *tags]
                message = {**message, "headers": [*headers, *unread.close(headers)]}
            await send(message)

        counted = False
        try:
            # Before anything reads the body: a body framed two ways is refused outright.
            check_framing(scope)
            # A CORS preflight before the key: browsers never send it on one.
            if self.cors is not None:
                preflight = self.cors.preflight(scope["method"], scope["headers"])
                if preflight is not None:
                    await respond(send_tagged, 204, b"", preflight)
                    return
            # Auth first, for every route but the liveness ones: without the key, a client
            # learns nothing, not even which routes exist.
            if path not in _KEYLESS and self.api_key is not None:
                self._authorize(scope)
            route = self._routes.get(path)
            if route is None and path.startswith("/v1/models/"):
                route = ("GET", self._model)
            if route is None and path.startswith("/v1/responses/"):
                route = ("GET", self._stored_response)
            if route is None:
                raise ApiError(404, f"no route {api.echo(path)}", type="not_found_error")
            method, handler = route
            allowed = "GET, HEAD" if method == "GET" else method
            if scope["method"] == "HEAD" and method == "GET":
                send_tagged = headers_only(send_tagged)
            elif scope["method"] != method:
                raise ApiError(
                    405,
                    f"{path} takes {allowed}",
                    type="invalid_request_error",
                    headers=[(b"allow", allowed.encode())],
                )
            if self.scheduler is None:
                raise ApiError(503, "the model is loading", type="server_error")
            if self.admission.draining and path != "/metrics":
                raise ApiError(
                    503,
                    "the server is shutting down",
                    type="server_error",
                    headers=retry_elsewhere(scope),
                )
            if self.scheduler.failed is not None and path != "/metrics":
                raise ApiError(
                    503, "the server is shutting down (its scheduler failed)", type="server_error"
                )
            if method == "POST":
                _require_json(scope)
            counted = True
            self.admission.enter()
            await handler(scope, receive, send_tagged)
        except ApiError as e:
            record.error = e.message
            await respond(send_tagged, e.status, _error_body(path, e), [*JSON, *e.headers])
        except Disconnected:
            record.error = "the client disconnected"
        except Exception as e:
            traceback.print_exc()
            err = ApiError(500, f"internal error: {type(e).__name__}", type="server_error")
            record.error = err.message
            await respond(send_tagged, 500, _error_body(path, err))
        finally:
            record.log()
            if counted:
                self.admission.leave()

    def _authorize(self, scope: Scope) -> None:
        assert self.api_key is not None
        # A bearer token (OpenAI's clients) or x-api-key (Anthropic's), checked alike.
        for k, v in scope["headers"]:
            if k == b"authorization":
                scheme, _, token = v.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key):
                    return
            elif k == b"x-api-key" and hmac.compare_digest(v.strip(), self.api_key):
                return
        raise ApiError(
            401,
            "missing or wrong API key",
            type="authentication_error",
            code="invalid_api_key",
            headers=[(b"www-authenticate", b'Bearer realm="kern"')],
        )

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        for k, v in scope["headers"]:
            if k == b"content-length" and v.isdigit() and int(v) > self.max_body:
                raise ApiError(413, f"body over {self.max_body} bytes", code="body_too_large")
        parts: list[bytes] = []
        size = 0
        # The whole body within body_timeout seconds: a client that declares a length and
        # sends less must not hold its connection (and a file descriptor) forever.
        deadline = time.monotonic() + self.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except TimeoutError:
                raise ApiError(
                    408,
                    f"the request body did not arrive within {self.body_timeout:g} s",
                    code="body_timeout",
                    headers=[(b"connection", b"close")],
                ) from None
            if message["type"] == "http.disconnect":
                raise Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise ApiError(413, f"body over {self.max_body} bytes", code="body_too_large")
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    # --- routes -----------------------------------------------------------------------------
    # The model's routes are its handlers' (kern.server.openai): the app reads the body and
    # hands it over. They exist once the model has loaded; until then ``_http`` answers 503.

    @property
    def _handlers(self) -> OpenAI:
        assert self.openai is not None
        return self.openai

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._handlers.completions(await self._body(scope, receive), receive, send)

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._handlers.chat(await self._body(scope, receive), receive, send)

    async def _tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._handlers.tokenize(await self._body(scope, receive), send)

    async def _detokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._handlers.detokenize(await self._body(scope, receive), send)

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._handlers.models(send)

    async def _model(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._handlers.model(scope["path"].removeprefix("/v1/models/"), send)

    async def _messages(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._body(scope, receive)
        note_betas(scope["headers"])
        await anthropic_messages.create(self._handlers, body, receive, send)

    async def _count_tokens(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._body(scope, receive)
        await anthropic_messages.count_tokens(self._handlers, body, send)

    async def _responses(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await self._body(scope, receive)
        await openai_responses.create(self._handlers, self.response_store, body, receive, send)

    async def _stored_response(self, scope: Scope, receive: Receive, send: Send) -> None:
        id_ = scope["path"].removeprefix("/v1/responses/")
        await openai_responses.get(self.response_store, id_, send)

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, b"ok\n", [(b"content-type", b"text/plain")])

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.metrics is not None
        text = generate_latest(self.metrics.registry)
        await respond(send, 200, text, [(b"content-type", CONTENT_TYPE_LATEST.encode())])

    async def _version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, api.encode({"version": __version__}))

    async def _openapi(self, scope: Scope, receive: Receive, send: Send) -> None:
        await respond(send, 200, api.encode(openapi.document()))


def _error_body(path: str, e: ApiError) -> bytes:
    """``e`` in the shape the route's clients read: Anthropic's under /v1/messages."""
    if path.startswith("/v1/messages"):
        return anthropic_messages.error_body(e)
    return api.error_body(e)


def _dispatch(events: list[tuple[Request, Event]]) -> None:
    """On the event loop: each event to its request's handler queue."""
    for req, ev in events:
        req.sink.put_nowait((req, ev))


def _require_json(scope: Scope) -> None:
    """POST bodies are JSON, and say so: a form or ``text/plain`` POST is what a web page can
    send cross-site without a CORS preflight, so accepting it would let any page drive a
    server that has no key."""
    sent = "none"
    for k, v in scope["headers"]:
        if k == b"content-type":
            media = v.split(b";", 1)[0].strip().lower()
            if media == b"application/json" or (
                media.startswith(b"application/") and media.endswith(b"+json")
            ):
                return
            sent = api.echo(media.decode("latin-1"))
            break
    # Whatever the HTTP version (1.0 included): a probe that sends no Content-Type gets this.
    raise ApiError(
        415,
        f"a POST body must be JSON sent with Content-Type: application/json (got {sent})",
        code="unsupported_media_type",
    )


app = App()
