"""``kern.app:app``: the OpenAI-compatible HTTP API as a raw ASGI application.

Design notes
------------
* No web framework: a dict of routes, msgspec for every body (kern.server.api), and the scheduler
  behind a queue. The app tokenizes, validates against the limits, and turns the scheduler's
  token events into text; the scheduler only ever sees ints.
* Configuration comes from the environment so ``hypercorn kern.app:app`` works as well as
  ``kern serve`` (which sets the same variables): ``KERN_CONFIG`` + ``KERN_TARGET`` name a
  kern.toml target, else the embedded tiny model is served; ``KERN_API_KEY`` guards every
  route but ``/health``; ``KERN_MAX_BODY_BYTES`` bounds a request body.
* Hang-ups: hypercorn speaks ASGI 2.1 and its ``send()`` keeps succeeding after a client has
  gone (seen with hypercorn 0.18: ``send()`` kept succeeding for 3 s after a hang-up while
  ``receive()`` returned ``http.disconnect`` at once). So every generating handler runs a
  watcher on ``receive()`` beside it; on ``http.disconnect`` it aborts the request's
  sequences (the scheduler frees them at its next step) and wakes the handler, queued or
  streaming alike.
* Events cross from the scheduler thread once per step (``call_soon_threadsafe``), and a
  handler drains everything queued before it writes, so a busy stream sends a few tokens per
  write instead of one write per token.
* Stop strings are the app's: the text is matched as it is detokenized, the request is aborted
  the moment one appears, and the choice ends with ``stop``; text that may begin a stop
  string is held back until it cannot.
* A crash of the scheduler thread ends every open request with ``abort``, prints the error and
  exits the process with code 101 (after a moment, so those ends reach the clients).
* Loading is :meth:`App.start`: ``kern serve`` calls it before it serves (so a user's mistake
  is one line and exit 2, and the start-up line can describe what loaded); under plain
  hypercorn the lifespan startup calls it.
* Shutdown is :meth:`App.drain`, on the event loop: no new request is admitted (503), every
  open stream gets a final ``abort`` chunk and ``[DONE]``, and every request still waiting
  for a whole answer gets a 503 in the error shape. ``kern serve`` drains on SIGTERM/SIGINT
  before hypercorn closes the connections; the lifespan shutdown drains as well.
* Every HTTP request carries an id, ``X-Request-Id`` from the client or made here, echoed in
  the response and in the one log line a generation request ends with (kern.server.logs). A stats
  line is logged every ``stats_interval`` seconds while there is work.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import logging
import os
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from kern import __version__
from kern.engine.params import SamplingParams
from kern.engine.request import Event, LimitError, Request
from kern.engine.scheduler import Scheduler, start_scheduler
from kern.server import api, logs
from kern.server.api import ApiError
from kern.server.logs import RequestRecord, StatsLine, request_id
from kern.server.splitter import Parts, Splitter, ToolCall, opens_reasoning

__all__ = ["App", "Settings", "app"]

log = logging.getLogger("kern")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_STATS_INTERVAL = 10.0
DEFAULT_BODY_TIMEOUT = 30.0
# Characters above which a prompt is tokenized on a worker thread.
_THREAD_TEXT = 16_384
CRASH_EXIT_CODE = 101
# Seconds between a scheduler failure and the exit: the open requests' ends reach their
# clients meanwhile, and new requests get a 503.
CRASH_EXIT_DELAY = 0.5
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_DONE = b"data: [DONE]\n\n"
_HANGUP = object()  # queued for a handler whose client disconnected
_SHUTDOWN = object()  # queued for every open handler when the server drains
# The current HTTP request's log record (each ASGI request runs in its own task and context).
_RECORD: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
    "kern_request", default=None
)


class _Disconnected(Exception):
    pass


@dataclass
class _Choice:
    """The text side of one sequence: detokenizer, stop strings and what was produced."""

    index: int
    stream: Any
    stops: list[str]
    hold: int
    include_stop: bool = False
    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    # The text each token released (the last one also what the end flushed): joined, the
    # whole decoded answer; what completions logprobs' ``tokens`` list.
    pieces: list[str] = field(default_factory=list)
    pending: str = ""
    finish: str | None = None
    # The stop string or stop token id that ended the choice (OpenAI's ``stop_reason``).
    stop_reason: str | int | None = None
    done: bool = False  # the scheduler's final event arrived
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    # Logprob entries already sent in a stream.
    sent_logprobs: int = 0
    # Chat answers with a reasoning parser or tools: splits the text (kern.server.splitter).
    split: Splitter | None = None
    reasoning: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)

    def parts(self, text: str, final: bool) -> Parts:
        """``text`` split; kept for the whole answer."""
        assert self.split is not None
        parts = self.split.feed(text, final)
        self.reasoning.append(parts.reasoning)
        self.text.append(parts.content)
        self.calls += parts.calls
        return parts

    def finish_reason(self) -> str | None:
        """OpenAI's: "tool_calls" for an answer that ended on its own after calls."""
        if self.calls and self.finish == "stop" and self.stop_reason is None:
            return "tool_calls"
        return self.finish

    def feed(self, token: int) -> tuple[str, bool]:
        """The text ``token`` releases, and whether a stop string ended the choice."""
        self.ids.append(token)
        piece = self.stream.step(token)
        self.pieces.append(piece)
        buf = self.pending + piece
        if not self.stops:
            self.pending = ""
            return buf, False
        cut = self._stop_at(buf)
        if cut is not None:
            self.pending = ""
            return cut, True
        keep = min(self.hold, len(buf))
        self.pending = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> tuple[str, bool]:
        """At the sequence's end: the text held back (what might have begun a stop string,
        and the detokenizer's trailing U+FFFD of an unfinished character, which ``decode``
        and so ``kern run`` keep), and whether a stop string ended the choice."""
        rest = self.stream.finish()
        if self.pieces:
            self.pieces[-1] += rest
        buf = self.pending + rest
        self.pending = ""
        cut = self._stop_at(buf)
        return (buf, False) if cut is None else (cut, True)

    def _stop_at(self, buf: str) -> str | None:
        """``buf`` up to the first stop string in it (through it with include_stop), or
        None; records the string as the stop reason."""
        found = [(i, -len(s), s) for s in self.stops if (i := buf.find(s)) >= 0]
        if not found:
            return None
        i, _, stop = min(found)
        self.stop_reason = stop
        return buf[: i + len(stop)] if self.include_stop else buf[:i]


@dataclass
class Settings:
    """How to serve: ``kern serve`` passes its flags; under ``hypercorn kern.app:app`` they come
    from the environment (:meth:`from_env`)."""

    # A checked kern.kern_toml.Target (kern.targets); None: resolved from the environment.
    target: Any = None
    api_key: str | None = None
    max_body: int = DEFAULT_MAX_BODY_BYTES
    log_prompts: bool = False
    # Seconds between stats lines while there is work; 0: none.
    stats_interval: float = DEFAULT_STATS_INTERVAL
    # Seconds a client has to send a request body whole.
    body_timeout: float = DEFAULT_BODY_TIMEOUT

    @classmethod
    def from_env(cls) -> Settings:
        """``KERN_CONFIG`` + ``KERN_TARGET`` (a kern.toml target) or ``KERN_MODEL`` (a
        checkpoint folder), ``KERN_ROWS`` (as ``kern serve --rows``), ``KERN_API_KEY``,
        ``KERN_MAX_BODY_BYTES``, ``KERN_LOG_LEVEL``, ``KERN_LOG_PROMPTS``,
        ``KERN_STATS_INTERVAL``, ``KERN_REASONING_PARSER``. Raises ``UsageError`` naming the
        variable."""
        from kern.errors import UsageError
        from kern.targets import check_target, choose_rows, resolve_target

        env = os.environ
        parser = env.get("KERN_REASONING_PARSER") or None
        from kern.kern_toml import REASONING_PARSERS

        if parser is not None and parser not in REASONING_PARSERS:
            raise UsageError(
                f"KERN_REASONING_PARSER={parser!r} is not one of {', '.join(REASONING_PARSERS)}"
            )
        config, name, model = env.get("KERN_CONFIG"), env.get("KERN_TARGET"), env.get("KERN_MODEL")
        if config and not name:
            raise UsageError("KERN_CONFIG needs KERN_TARGET")
        if name and not config:
            raise UsageError("KERN_TARGET needs KERN_CONFIG")
        target, toml_name = resolve_target(
            config=Path(config) if config else None,
            target=name or None,
            model=Path(model) if model else None,
            overrides={"reasoning_parser": parser},
        )
        if "KERN_ROWS" in env:
            rows = env["KERN_ROWS"]
            if not rows.isdigit() or int(rows) < 1:
                raise UsageError(f"KERN_ROWS={rows!r} is not a positive integer")
            target = choose_rows(target, toml_name, int(rows), "KERN_ROWS")
        check_target(target, serving=True)
        out = cls(
            target=target,
            api_key=api_key(
                None, Path(env["KERN_API_KEY_FILE"]) if "KERN_API_KEY_FILE" in env else None
            ),
        )
        for var, attr, kind in (
            ("KERN_MAX_BODY_BYTES", "max_body", int),
            ("KERN_STATS_INTERVAL", "stats_interval", float),
            ("KERN_BODY_TIMEOUT", "body_timeout", float),
        ):
            if var in env:
                try:
                    setattr(out, attr, kind(env[var]))
                except ValueError:
                    raise UsageError(f"{var}={env[var]!r} is not a number") from None
        out.log_prompts = env.get("KERN_LOG_PROMPTS", "") not in ("", "0")
        level = env.get("KERN_LOG_LEVEL", "info").lower()
        if level not in logs.LEVELS:
            raise UsageError(f"KERN_LOG_LEVEL={level!r} is not one of {', '.join(logs.LEVELS)}")
        if not log.handlers:
            logs.configure(level)
        return out


def api_key(flag: str | None, file: Path | None, flag_name: str = "--api-key") -> str | None:
    """The API key from a flag, a file (its first line) or ``KERN_API_KEY``, in that order;
    None: no key. An empty or blank key is a ``UsageError``: an unset shell variable must
    not start a server with no auth."""
    from kern.errors import UsageError

    if flag is not None and file is not None:
        raise UsageError(f"{flag_name} and a key file: pass one of them")
    if flag is not None:
        key, where = flag, flag_name
    elif file is not None:
        try:
            lines = file.read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise UsageError(f"{file}: cannot read the API key file: {e.strerror}") from None
        key, where = (lines[0] if lines else ""), str(file)
    elif "KERN_API_KEY" in os.environ:
        key, where = os.environ["KERN_API_KEY"], "KERN_API_KEY"
    else:
        return None
    if not key.strip():
        raise UsageError(f"{where}: the API key is empty")
    if key != key.strip() or any(c.isspace() for c in key):
        raise UsageError(f"{where}: the API key contains whitespace")
    return key


class App:
    """The ASGI application. Loads the model in :meth:`start` (at lifespan startup unless
    called before), through ``load_engine`` (``kern.engine.load.Engine.load`` unless given: the
    crash test passes one whose runner fails)."""

    def __init__(
        self, load_engine: Callable[[Any], Any] | None = None, settings: Settings | None = None
    ) -> None:
        self.load_engine = load_engine
        self.settings = settings
        self.engine: Any = None
        self.scheduler: Scheduler | None = None
        self.metrics: Any = None
        self.tokenizer: Any = None
        self.model_name = "kern"
        self.vocab_size = 0
        self.max_model_len = 0
        self.gen_defaults: dict[str, float] = {}
        # The target's reasoning parser is on (kern.server.splitter).
        self.reasoning = False
        self.grammars: Any = None
        self.created = int(time.time())
        self.api_key: bytes | None = None
        self.max_body = DEFAULT_MAX_BODY_BYTES
        self.body_timeout = DEFAULT_BODY_TIMEOUT
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False
        self._runs: set[_Run] = set()
        self._stats_task: asyncio.Task | None = None
        self._routes: dict[str, tuple[str, Callable[..., Awaitable[None]]]] = {
            "/v1/completions": ("POST", self._completions),
            "/v1/chat/completions": ("POST", self._chat),
            "/v1/models": ("GET", self._models),
            "/tokenize": ("POST", self._tokenize),
            "/detokenize": ("POST", self._detokenize),
            "/health": ("GET", self._health),
            "/metrics": ("GET", self._metrics),
            "/version": ("GET", self._version),
            "/openapi.json": ("GET", self._openapi),
        }

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
                        from kern.errors import UsageError
                        from kern.kern_toml import TomlConfigError
                        from kern.model_config import CheckpointError

                        if isinstance(e, UsageError | CheckpointError | TomlConfigError):
                            log.error("%s", e)  # a user's mistake: one line
                        else:
                            traceback.print_exc()
                        await send({"type": "lifespan.startup.failed", "message": str(e)})
                        return
                if self.settings is not None and self.settings.stats_interval > 0:
                    stats = StatsLine(self.metrics, self.settings.stats_interval)
                    self._stats_task = self.loop.create_task(stats.run())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.drain()
                if self._stats_task is not None:
                    self._stats_task.cancel()
                if self.scheduler is not None:
                    await asyncio.to_thread(self.scheduler.stop)
                await send({"type": "lifespan.shutdown.complete"})
                return

    def start(self) -> Any:
        """Load the model and start the scheduler (blocking; call it off the event loop).
        Returns the engine. Raises ``UsageError`` / ``CheckpointError`` for a user's mistake."""
        if self.settings is None:
            self.settings = Settings.from_env()
        key = self.settings.api_key
        self.api_key = key.encode() if key else None
        self.max_body = self.settings.max_body
        self.body_timeout = self.settings.body_timeout
        # Built on the scheduler's own thread: every torch op runs there.
        self.scheduler = start_scheduler(self._load)
        return self.engine

    def _load(self) -> Scheduler:
        from kern.engine.load import Engine
        from kern.metrics import Metrics

        assert self.settings is not None and self.settings.target is not None
        target = self.settings.target
        engine = (self.load_engine or Engine.load)(target)
        self.engine = engine
        self.model_name = target.name
        self.tokenizer = engine.checkpoint.tokenizer
        self.vocab_size = engine.checkpoint.config.vocab_size
        self.max_model_len = engine.checkpoint.config.max_position_embeddings
        self.gen_defaults = sampling_defaults(target.checkpoint)
        self.reasoning = target.reasoning_parser is not None
        from kern.engine.structured import Grammars

        self.grammars = Grammars(self.tokenizer, self.vocab_size)
        self.metrics = Metrics(self.model_name, self.max_model_len)
        return engine.scheduler(self._deliver, metrics=self.metrics, on_crash=self._crashed)

    def drain(self) -> None:
        """Stop admitting and end every open generation (see the design notes). On the event
        loop's thread; idempotent."""
        self.draining = True
        for run in list(self._runs):
            run.shut_down()

    def _deliver(self, events: list[tuple[Request, Event]]) -> None:
        """From the scheduler thread, once per step."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(_dispatch, events)

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
        _RECORD.set(record)
        header = (b"x-request-id", record.id.encode())

        async def send_tagged(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        try:
            # Auth first, for every route but /health: without the key, a client learns
            # nothing, not even which routes exist.
            if path != "/health" and self.api_key is not None:
                self._authorize(scope)
            route = self._routes.get(path)
            if route is None and path.startswith("/v1/models/"):
                route = ("GET", self._model)
            if route is None:
                raise ApiError(404, f"no route {api.echo(path)}", type="not_found_error")
            method, handler = route
            allowed = "GET, HEAD" if method == "GET" else method
            if scope["method"] == "HEAD" and method == "GET":
                send_tagged = _headers_only(send_tagged)
            elif scope["method"] != method:
                raise ApiError(
                    405,
                    f"{path} takes {allowed}",
                    type="invalid_request_error",
                    headers=[(b"allow", allowed.encode())],
                )
            if self.scheduler is None:
                raise ApiError(503, "the model is loading", type="server_error")
            if self.draining and path != "/metrics":
                raise ApiError(503, "the server is shutting down", type="server_error")
            if self.scheduler.failed is not None and path != "/metrics":
                raise ApiError(
                    503, "the server is shutting down (its scheduler failed)", type="server_error"
                )
            if method == "POST":
                _require_json(scope)
            await handler(scope, receive, send_tagged)
        except ApiError as e:
            record.error = e.message
            await _respond(send_tagged, e.status, api.error_body(e), [*_JSON, *e.headers])
        except _Disconnected:
            record.error = "the client disconnected"
        except Exception as e:
            traceback.print_exc()
            err = ApiError(500, f"internal error: {type(e).__name__}", type="server_error")
            record.error = err.message
            await _respond(send_tagged, 500, api.error_body(err))
        finally:
            record.log()

    def _authorize(self, scope: Scope) -> None:
        assert self.api_key is not None
        for k, v in scope["headers"]:
            if k == b"authorization":
                scheme, _, token = v.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key):
                    return
                break
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
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise ApiError(413, f"body over {self.max_body} bytes", code="body_too_large")
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)

    # --- simple routes ----------------------------------------------------------------------

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _respond(send, 200, b"ok\n", [(b"content-type", b"text/plain")])

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        text = generate_latest(self.metrics.registry)
        await _respond(send, 200, text, [(b"content-type", CONTENT_TYPE_LATEST.encode())])

    async def _version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _respond(send, 200, api.encode({"version": __version__}))

    async def _openapi(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _respond(send, 200, api.encode(api.openapi()))

    def _card(self) -> api.ModelCard:
        return api.ModelCard(
            self.model_name,
            self.created,
            max_model_len=self.max_model_len,
            sampling_defaults=dict(self.gen_defaults),
        )

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _respond(send, 200, api.encode(api.ModelList([self._card()])))

    async def _model(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = scope["path"].removeprefix("/v1/models/")
        self._check_model(name)
        await _respond(send, 200, api.encode(self._card()))

    async def _tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = api.decode(await self._body(scope, receive), api.TokenizeRequest)
        self._check_model(body.model)
        if body.messages is not None:
            text, contents = self._render_chat(
                body.messages, body.add_generation_prompt, body.chat_template_kwargs, body.tools
            )
            ids = await self._encode(text, "messages", contents=contents)
        else:
            assert body.prompt is not None
            ids = await self._encode(
                body.prompt, "prompt", add_special_tokens=bool(body.add_special_tokens)
            )
        out = api.TokenizeResponse(ids, len(ids), self.max_model_len)
        await _respond(send, 200, api.encode(out))

    async def _detokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = api.decode(await self._body(scope, receive), api.DetokenizeRequest)
        self._check_model(body.model)
        self._check_ids(body.tokens, "tokens")
        out = api.DetokenizeResponse(self.tokenizer.decode(body.tokens))
        await _respond(send, 200, api.encode(out))

    # --- generation -------------------------------------------------------------------------

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"model {api.echo(model)} does not exist (this server serves "
                f"{api.echo(self.model_name)})",
                param="model",
                type="invalid_request_error",
                code="model_not_found",
            )

    def _check_ids(self, ids: list[int], param: str) -> None:
        for i, t in enumerate(ids):
            if t >= self.vocab_size:
                raise ApiError(
                    400,
                    f"token id {t} is not below the vocabulary size {self.vocab_size}",
                    param=f"{param}[{i}]",
                    code="invalid_value",
                )

    async def _encode(
        self,
        text: str,
        param: str,
        *,
        add_special_tokens: bool = False,
        contents: list[str] | None = None,
    ) -> list[int]:
        """Token ids of a prompt's text (a rendered chat prompt with its messages' ``contents``:
        their added-token text stays plain). Refuses, before tokenizing, a text too long to
        fit the context whatever it encodes to; tokenizes a long one on a worker thread, so
        the event loop keeps serving everyone else meanwhile."""
        from kern.tokenizer import ChatTemplateError

        size = len(text.encode("utf-8", "surrogatepass"))
        # No token covers more than max_token_bytes bytes of normalized text, and NFC at
        # most shrinks text threefold (decomposed Hangul): 4x that is a safe lower bound.
        least = size // (4 * self.tokenizer.max_token_bytes)
        if least > self.max_model_len:
            raise ApiError(
                400,
                f"the prompt is {size} bytes, at least {least} tokens: over the model's "
                f"context of {self.max_model_len} tokens",
                param=param,
                code="context_length_exceeded",
            )

        def encode() -> list[int]:
            if contents is not None:
                return self.tokenizer.encode_chat(text, contents)
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

        try:
            if len(text) > _THREAD_TEXT:
                return await asyncio.to_thread(encode)
            return encode()
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param=param) from None
        except Exception as e:  # e.g. a lone surrogate, which JSON allows and UTF-8 does not
            raise ApiError(400, f"cannot tokenize: {e}", param=param) from None

    def _render_chat(
        self,
        messages: list[api.ChatMessage],
        add_generation_prompt: bool | None,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[api.Tool] | None = None,
    ) -> tuple[str, list[str]]:
        """The chat prompt's text and the client's texts in it, in order (messages' contents
        and their calls' arguments: kept plain text by ``_encode``)."""
        from kern.tokenizer import ChatTemplateError

        dicts: list[dict[str, Any]] = []
        contents: list[str] = []
        for m in messages:
            d: dict[str, Any] = {"role": m.role, "content": m.text()}
            contents.append(d["content"])
            if m.name is not None:
                d["name"] = m.name
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                d["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": c.function.arguments},
                    }
                    for c in m.tool_calls
                ]
                contents += [c.function.arguments for c in m.tool_calls]
            dicts.append(d)
        kwargs = dict(template_kwargs or {})
        if tools:
            if "tools" not in (self.tokenizer.chat_template or ""):
                raise ApiError(
                    400, "this model's chat template does not render tools", param="tools"
                )
            kwargs["tools"] = [msgspec.to_builtins(t) for t in tools]
            for i, t in enumerate(kwargs["tools"]):
                if self.tokenizer.spells_control(msgspec.json.encode(t).decode()):
                    raise ApiError(
                        400,
                        f"tools[{i}] spells a control token of the tokenizer",
                        param=f"tools[{i}]",
                    )
        try:
            text = self.tokenizer.apply_chat_template(
                dicts, add_generation_prompt is not False, **kwargs
            )
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages") from None
        return text, contents

    def _decode(self, raw: bytes, type_: type) -> Any:
        body = api.decode(raw, type_)
        unknown = api.unknown_fields(raw, type_)
        if unknown:
            # Accepted, as OpenAI accepts them, but never silently: named in the log.
            log.warning(
                "request %s: ignoring unknown fields %s",
                (record.id if (record := _RECORD.get()) else "-"),
                ", ".join(api.echo(k) for k in unknown[:20]),
            )
        return body

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = self._decode(await self._body(scope, receive), api.CompletionRequest)
        self._check_model(body.model)
        prompts: list[list[int]] = []
        batch = body.prompts()
        for i, prompt in enumerate(batch):
            param = "prompt" if len(batch) == 1 else f"prompt[{i}]"
            if isinstance(prompt, str):
                prompts.append(await self._encode(prompt, param))
            else:
                self._check_ids(prompt, param)
                prompts.append(list(prompt))
        # OpenAI's default for completions is 16 tokens; null means the default.
        limit = 16 if body.max_tokens is None else body.max_tokens
        await self._generate(body, prompts, limit, body.logprobs, False, receive, send)

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = self._decode(await self._body(scope, receive), api.ChatCompletionRequest)
        self._check_model(body.model)
        text, contents = self._render_chat(
            body.messages, body.add_generation_prompt, body.chat_template_kwargs, body.tools
        )
        prompt_ids = await self._encode(text, "messages", contents=contents)
        limit = body.token_limit()
        opened = self.reasoning and opens_reasoning(text)
        await self._generate(
            body, [prompt_ids], limit, body.num_logprobs(), True, receive, send, opened
        )

    async def _grammar(self, body: Any, opened: bool) -> Any:
        """The compiled grammar of the request's response_format or tools, or None.
        ``opened``: the prompt opened a reasoning block."""
        from kern.engine.structured import StructuredOutputError

        think = ("must" if opened else "may") if self.reasoning else None
        tools = isinstance(body, api.ChatCompletionRequest) and body.tool_choice_name() != "none"
        fmt = body.response_format
        if fmt is not None and fmt.get("type") != "text" and tools:
            raise ApiError(
                400,
                "response_format cannot go with tools unless tool_choice is 'none'",
                param="response_format",
            )
        try:
            if tools:
                specs = [
                    {"name": t.function.name, "parameters": t.function.parameters}
                    for t in body.tools
                ]
                compiled = await asyncio.to_thread(
                    self.grammars.compile_tools,
                    specs,
                    body.tool_choice_name(),
                    body.parallel_tool_calls is not False,
                    think,
                )
            elif fmt is None:
                return None
            else:
                compiled = await asyncio.to_thread(self.grammars.compile, fmt, think)
        except StructuredOutputError as e:
            param = "tools" if tools else "response_format"
            raise ApiError(400, f"{param}: {e}", param=param) from None
        what = "tools" if tools else "a JSON response_format"
        if compiled is not None and body.ignore_eos:
            raise ApiError(
                400,
                f"ignore_eos cannot go with {what}: the grammar ends the answer",
                param="ignore_eos",
            )
        if compiled is not None and body.min_tokens:
            raise ApiError(
                400,
                f"min_tokens cannot go with {what}: the grammar decides where the answer ends",
                param="min_tokens",
            )
        return compiled

    def _sampling(self, body: Any, seed: int | None) -> SamplingParams:
        """The request's sampling parameters: what it set, else the checkpoint's
        generation_config.json default, else OpenAI's."""
        d = self.gen_defaults

        def pick(name: str, default: float) -> Any:
            value = getattr(body, name)
            return value if value is not None else d.get(name, default)

        bias = tuple((int(k), float(v)) for k, v in (body.logit_bias or {}).items())
        for token, _ in bias:
            if token >= self.vocab_size:
                raise ApiError(
                    400,
                    f"logit_bias: token id {token} is not below the vocabulary size "
                    f"{self.vocab_size}",
                    param="logit_bias",
                    code="invalid_value",
                )
        return SamplingParams(
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=max(int(pick("top_k", 0)), 0),
            min_p=pick("min_p", 0.0),
            presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            logit_bias=bias,
            seed=seed,
        )

    async def _generate(
        self,
        body: api.CompletionRequest | api.ChatCompletionRequest,
        prompts: list[list[int]],
        max_tokens: int | None,
        num_logprobs: int | None,
        chat: bool,
        receive: Receive,
        send: Send,
        opened: bool = False,
    ) -> None:
        sched = self.scheduler
        assert sched is not None
        n = body.n or 1
        for i, prompt_ids in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if not prompt_ids:
                raise ApiError(400, "the prompt encodes to no tokens", param=param)
            limit = sched.max_tokens_for(len(prompt_ids)) if max_tokens is None else max_tokens
            try:
                sched.check(len(prompt_ids), limit)
            except LimitError as e:
                raise ApiError(
                    400, str(e), param=e.param or param, code="context_length_exceeded"
                ) from None
        stop_ids = frozenset(body.stop_token_ids or ())
        self._check_ids(sorted(stop_ids), "stop_token_ids")
        stops = body.stop_strings()
        grammar = await self._grammar(body, opened)
        tools = chat and body.tool_choice_name() != "none"  # type: ignore[union-attr]
        queue: asyncio.Queue[Any] = asyncio.Queue()
        reqs = []
        choices = []
        for p, prompt_ids in enumerate(prompts):
            limit = sched.max_tokens_for(len(prompt_ids)) if max_tokens is None else max_tokens
            for j in range(n):
                index = p * n + j
                seed = body.seed
                if seed is not None and n > 1:
                    seed = (seed + j) % (1 << 63)
                reqs.append(
                    Request(
                        prompt_ids,
                        limit,
                        self._sampling(body, seed),
                        stop_ids=stop_ids,
                        ignore_eos=bool(body.ignore_eos),
                        num_logprobs=num_logprobs,
                        min_tokens=body.min_tokens or 0,
                        grammar=None if grammar is None else self.grammars.matcher(grammar),
                        sink=queue,
                        index=index,
                        counts_prompt=j == 0,
                    )
                )
                choices.append(
                    _Choice(
                        index,
                        self.tokenizer.stream(skip_special_tokens=True),
                        stops,
                        max((len(s) for s in stops), default=1) - 1,
                        include_stop=bool(body.include_stop_str_in_output),
                        split=(
                            Splitter(reasoning=self.reasoning, tools=tools, prompt_opened=opened)
                            if chat and (self.reasoning or tools)
                            else None
                        ),
                    )
                )
        run = _Run(self, body, chat, prompts, n, reqs, choices, queue)
        record = _RECORD.get()
        if record is not None:
            record.run = run
            if self.settings is not None and self.settings.log_prompts:
                record.prompt = self.tokenizer.decode(prompts[0])
        for r in reqs:
            sched.submit(r)
        self._runs.add(run)
        watcher = asyncio.create_task(_watch(receive, reqs, queue, sched))
        try:
            if body.stream:
                await run.stream(send)
            else:
                await run.collect(send)
        finally:
            self._runs.discard(run)
            watcher.cancel()
            for r in reqs:
                if r.finish_reason is None:
                    sched.abort(r)


def sampling_defaults(checkpoint: Path) -> dict[str, float]:
    """The sampling parameters a checkpoint's generation_config.json sets, by kern's names
    (vLLM serves these as the defaults of a request that leaves them unset). A file that is
    missing or unreadable sets none; values of the wrong type are left out."""
    import json

    file = Path(checkpoint) / "generation_config.json"
    try:
        gen = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(gen, dict):
        return {}
    out: dict[str, float] = {}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        value = gen.get(name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = value
    if gen.get("do_sample") is False:
        out["temperature"] = 0.0  # the checkpoint decodes greedily by default
    return out


class _Run:
    """One HTTP generation: its sequences' events turned into a response or a stream."""

    def __init__(
        self, app: App, body: Any, chat: bool, prompts, n: int, reqs, choices, queue
    ) -> None:
        self.app = app
        self.body = body
        self.chat = chat
        self.prompts: list[list[int]] = prompts
        self.n = n
        self.reqs: list[Request] = reqs
        self.choices: list[_Choice] = choices
        self.queue: asyncio.Queue[Any] = queue
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.shut = False

    def shut_down(self) -> None:
        """End this run now (the server drains): see :meth:`App.drain`."""
        self.shut = True
        self.queue.put_nowait(_SHUTDOWN)

    async def events(self):
        """Batches of (choice, text, finish) until every choice has its final event."""
        left = len(self.choices)
        while left:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            out = []
            for item in items:
                if item is _HANGUP:
                    raise _Disconnected
                if item is _SHUTDOWN:
                    for ch in self.choices:
                        if not ch.done and ch.finish is None:
                            ch.finish = "abort"
                            out.append((ch, ch.flush()[0], "abort"))
                        ch.done = True
                    left = 0
                    break
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
                        self.app.scheduler.abort(req, "stop")  # type: ignore[union-attr]
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

    def _token_ids(self, ch: _Choice) -> list[int] | None:
        return list(ch.ids) if self.body.return_token_ids else None

    async def collect(self, send: Send) -> None:
        async for batch in self.events():
            for ch, text, finish in batch:
                if ch.split is not None:
                    ch.parts(text, finish is not None)
                else:
                    ch.text.append(text)
        if self.shut:
            raise ApiError(503, "the server is shutting down", type="server_error")
        lp = self._lp()
        if self.chat:
            chat_choices = [
                api.ChatChoice(
                    c.index,
                    _message(c),
                    self._chat_logprobs(c.logprobs) if lp else None,
                    c.finish_reason(),  # type: ignore[arg-type]
                    c.stop_reason,
                    self._token_ids(c),
                )
                for c in self.choices
            ]
            out: Any = api.ChatCompletionResponse(
                self.id, self.created, self.app.model_name, chat_choices, self.usage()
            )
        else:
            comp_choices = [
                api.CompletionChoice(
                    c.index,
                    "".join(c.text),
                    self._completion_logprobs(c, 0, len(c.logprobs), 0) if lp else None,
                    c.finish,  # type: ignore[arg-type]
                    c.stop_reason,
                    self._token_ids(c),
                )
                for c in self.choices
            ]
            out = api.CompletionResponse(
                self.id, self.created, self.app.model_name, comp_choices, self.usage()
            )
        await _respond(send, 200, api.encode(out))

    def _lp(self) -> bool:
        return self.reqs[0].num_logprobs is not None

    async def stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        model = self.app.model_name
        lp = self._lp()
        offsets = [0] * len(self.choices)  # completions logprobs: text offset of the next entry
        if self.chat:
            first = [
                api.ChatChunkChoice(
                    c.index, api.Delta(role="assistant", content=""), None, None, None
                )
                for c in self.choices
            ]
            chunk = api.ChatCompletionChunk(self.id, self.created, model, first)
            await _send_sse(send, [api.encode(chunk)])
        async for batch in self.events():
            lines = []
            for ch, text, finish in batch:
                # Every logprob entry not sent yet, once each: a token that released no text
                # goes out with the next chunk, and the final chunk carries all the rest.
                start, end = ch.sent_logprobs, len(ch.logprobs)
                ch.sent_logprobs = end
                stop_reason = ch.stop_reason if finish else None
                if self.chat:
                    entries = self._chat_logprobs(ch.logprobs[start:end]) if lp else None
                    if ch.split is not None:
                        delta = _delta(ch, ch.parts(text, finish is not None))
                    else:
                        delta = api.Delta(content=text) if text else api.Delta()
                    cc = api.ChatChunkChoice(
                        ch.index,
                        delta,
                        entries,
                        ch.finish_reason() if finish else None,  # type: ignore[arg-type]
                        stop_reason,
                        self._token_ids(ch) if finish else None,
                    )
                    lines.append(
                        api.encode(api.ChatCompletionChunk(self.id, self.created, model, [cc]))
                    )
                else:
                    entries2 = None
                    if lp:
                        entries2 = self._completion_logprobs(ch, start, end, offsets[ch.index])
                        offsets[ch.index] += sum(len(p) for p in ch.pieces[start:end])
                    c2 = api.CompletionChoice(
                        ch.index,
                        text,
                        entries2,
                        finish,  # type: ignore[arg-type]
                        stop_reason,
                        self._token_ids(ch) if finish else None,
                    )
                    lines.append(
                        api.encode(api.CompletionResponse(self.id, self.created, model, [c2]))
                    )
            await _send_sse(send, lines)
        tail = []
        if include_usage:
            if self.chat:
                tail.append(
                    api.encode(
                        api.ChatCompletionChunk(self.id, self.created, model, [], self.usage())
                    )
                )
            else:
                tail.append(
                    api.encode(
                        api.CompletionResponse(self.id, self.created, model, [], self.usage())
                    )
                )
        body = b"".join(b"data: " + line + b"\n\n" for line in tail) + _DONE
        await send({"type": "http.response.body", "body": body, "more_body": False})

    def _display(self, token: int) -> tuple[str, bytes]:
        """A token's text for logprobs and its bytes. A token holding part of a UTF-8
        character is written ``bytes:\\xNN...``, as OpenAI does, so keys never collide."""
        raw = self.app.tokenizer.token_bytes(token)
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw

    def _completion_logprobs(
        self, ch: _Choice, start: int, end: int, offset: int
    ) -> api.CompletionLogprobs:
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

    def _chat_logprobs(self, entries) -> api.ChatLogprobs:
        content = []
        for tok, lp, top in entries:
            text, raw = self._display(tok)
            tops = []
            for i, v in top:
                t, b = self._display(i)
                tops.append(api.TopLogprob(t, v, list(b)))
            content.append(api.TokenLogprob(text, lp, list(raw), tops))
        return api.ChatLogprobs(content)


def _message(ch: _Choice) -> api.AssistantMessage:
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


def _delta(ch: _Choice, parts: Parts) -> api.Delta:
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


def _dispatch(events: list[tuple[Request, Event]]) -> None:
    for req, ev in events:
        req.sink.put_nowait((req, ev))


async def _watch(receive: Receive, reqs: list[Request], queue, sched: Scheduler) -> None:
    """Abort ``reqs`` when the client hangs up (the only way to learn it under ASGI 2.1)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            for r in reqs:
                sched.abort(r)
            queue.put_nowait(_HANGUP)
            return


def _require_json(scope: Scope) -> None:
    """POST bodies are JSON, and say so: a form or ``text/plain`` POST is what a web page can
    send cross-site without a CORS preflight, so accepting it would let any page drive a
    server that has no key."""
    for k, v in scope["headers"]:
        if k == b"content-type":
            media = v.split(b";", 1)[0].strip().lower()
            if media == b"application/json" or (
                media.startswith(b"application/") and media.endswith(b"+json")
            ):
                return
            break
    raise ApiError(
        415,
        "a POST body must be JSON sent with Content-Type: application/json",
        code="unsupported_media_type",
    )


def _headers_only(send: Send) -> Send:
    """``send`` for a HEAD request: the GET response's status and headers, no body."""

    async def send_head(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            message = {"type": "http.response.body", "body": b"", "more_body": False}
        await send(message)

    return send_head


async def _respond(send: Send, status: int, body: bytes, headers=None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers or _JSON})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _send_sse(send: Send, lines: list[bytes]) -> None:
    if lines:
        body = b"".join(b"data: " + line + b"\n\n" for line in lines)
        await send({"type": "http.response.body", "body": body, "more_body": True})


app = App()
