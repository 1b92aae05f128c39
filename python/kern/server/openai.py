"""The OpenAI routes of a loaded model: a request body becomes token ids, ``SamplingParams``
and scheduler ``Request``s, whose events a run (kern.server.responses) renders.

The handlers are built once the model has loaded, from what was loaded (the scheduler, the
tokenizer, the grammars and the model's facts), and never reach back into the app: the app
reads the body and routes, the handlers answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import TypeVar

from kern.chat_formats import DEFAULT, ChatFormat, Reasoning
from kern.engine.params import SamplingParams
from kern.engine.request import LimitError, Request
from kern.engine.scheduler import Scheduler
from kern.engine.structured import Grammars, GrammarUnavailable, StructuredOutputError
from kern.engine.tool_calls import submit_tools
from kern.server import api
from kern.server.api import ApiError
from kern.server.http import Receive, Send, respond
from kern.server.logs import RECORD
from kern.server.prompts import Prompts
from kern.server.responses import ChatRun, CompletionRun, Item, Run
from kern.server.splitter import Splitter
from kern.server.text import Choice
from kern.tokenizer import Tokenizer

__all__ = ["OpenAI"]

log = logging.getLogger("kern")

T = TypeVar("T")
Body = api.CompletionRequest | api.ChatCompletionRequest


class OpenAI:
    """The handlers of ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``,
    ``/tokenize`` and ``/detokenize`` for one loaded model. Each takes the request's body (read
    by the app) and answers on ``send``; a client's mistake raises ``ApiError``."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        grammars: Grammars,
        *,
        model_name: str,
        aliases: tuple[str, ...] = (),
        vocab_size: int,
        max_model_len: int,
        sampling_defaults: dict[str, float],
        reasoning: Reasoning | None,
        chat_format: ChatFormat = DEFAULT,
        log_prompts: bool,
        created: int,
        allow_unknown_fields: bool = False,
        hosted_tools: str = "refuse",
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.model_name = model_name
        # Every name a request may send (kern serve --served-model-name, repeated): answers
        # report the first, model_name.
        self.model_names = tuple(dict.fromkeys((model_name, *aliases)))
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        # The checkpoint's generation_config.json defaults (kern.checkpoint.sampling_defaults).
        self.sampling_defaults = sampling_defaults
        # The target's reasoning parser's block (None: off), and the chat format its answers'
        # tool calls are in (kern.chat_formats).
        self.reasoning = reasoning
        self.chat_format = chat_format
        # The first prompt's text goes into the request's log line.
        self.log_prompts = log_prompts
        self.created = created
        # Unknown request fields: dropped and named in a warning instead of a 400 naming them
        # (the default, OpenAI's and Anthropic's way): kern.server.api.decode.
        self.allow_unknown_fields = allow_unknown_fields
        # Vendor-hosted tools in a request: "refuse" (a 400 naming them) or "drop" (a warning).
        self.hosted_tools = hosted_tools
        self.prompts = Prompts(tokenizer, vocab_size=vocab_size, max_model_len=max_model_len)
        # The generations in flight: the server's drain ends them (shut_down).
        self.runs: set[Run] = set()

    def shut_down(self) -> None:
        """End every open generation: streams end with ``abort``, whole answers get a 503."""
        for run in list(self.runs):
            run.shut_down()

    # --- models and tokens ------------------------------------------------------------------

    def _card(self, name: str) -> api.ModelCard:
        return api.ModelCard(
            name,
            self.created,
            max_model_len=self.max_model_len,
            sampling_defaults=dict(self.sampling_defaults),
        )

    async def models(self, send: Send) -> None:
        cards = [self._card(name) for name in self.model_names]
        await respond(send, 200, api.encode(api.ModelList(cards)))

    async def model(self, name: str, send: Send) -> None:
        self.check_model(name)
        await respond(send, 200, api.encode(self._card(name)))

    async def tokenize(self, raw: bytes, send: Send) -> None:
        body = self._decode(raw, api.TokenizeRequest)
        self.check_model(body.model)
        special = bool(body.add_special_tokens)
        if body.messages is not None:
            text, contents = self.prompts.render(body, harmony=self.chat_format.messages)
            ids = await self.prompts.encode(
                text, "messages", contents=contents, add_special_tokens=special
            )
        else:
            assert body.prompt is not None
            ids = await self.prompts.encode(body.prompt, "prompt", add_special_tokens=special)
        out = api.TokenizeResponse(ids, len(ids), self.max_model_len)
        if body.return_token_strs:
            out.token_strs = [self.tokenizer.id_to_token(i) or "" for i in ids]
        await respond(send, 200, api.encode(out))

    async def detokenize(self, raw: bytes, send: Send) -> None:
        body = self._decode(raw, api.DetokenizeRequest)
        self.check_model(body.model)
        self.prompts.check_ids(body.tokens, "tokens")
        out = api.DetokenizeResponse(self.tokenizer.decode(body.tokens))
        await respond(send, 200, api.encode(out))

    # --- generation -------------------------------------------------------------------------

    async def completions(self, raw: bytes, receive: Receive, send: Send) -> None:
        body = self._decode(raw, api.CompletionRequest)
        self.check_model(body.model)
        if body.reasoning_effort is not None:  # a completion's prompt is the client's text
            raise ApiError(400, "reasoning_effort applies to chat", param="reasoning_effort")
        prompts: list[list[int]] = []
        batch = body.prompts()
        for i, prompt in enumerate(batch):
            param = "prompt" if len(batch) == 1 else f"prompt[{i}]"
            if isinstance(prompt, str):
                prompts.append(
                    await self.prompts.encode(
                        prompt, param, add_special_tokens=bool(body.add_special_tokens)
                    )
                )
            else:
                self.prompts.check_ids(prompt, param)
                prompts.append(list(prompt))
        # OpenAI's default for completions is 16 tokens; null means the default.
        limit = 16 if body.max_tokens is None else body.max_tokens
        await self._generate(
            body, prompts, limit, body.logprobs, receive, send, run=CompletionRun, split=None
        )

    async def chat(self, raw: bytes, receive: Receive, send: Send) -> None:
        body = self._decode(raw, api.ChatCompletionRequest)
        self.check_model(body.model)
        await self.chat_body(body, receive, send)

    async def chat_prompt(self, body: api.ChatCompletionRequest) -> tuple[str, list[int]]:
        """The rendered prompt of a chat request and its token ids."""
        text, contents = self.prompts.render(body, harmony=self.chat_format.messages)
        ids = await self.prompts.encode(
            text, "messages", contents=contents, add_special_tokens=bool(body.add_special_tokens)
        )
        return text, ids

    async def chat_body(
        self,
        body: api.ChatCompletionRequest,
        receive: Receive,
        send: Send,
        run: Callable[..., Run] = ChatRun,
    ) -> None:
        """Generate for a checked chat request and answer with ``run``'s rendering: chat
        completions, and the Anthropic and Responses protocols, which are translated into one
        (kern.server.anthropic_messages, kern.server.openai_responses)."""
        text, prompt_ids = await self.chat_prompt(body)
        limit = body.token_limit()
        opened = self.reasoning is not None and self.reasoning.opened_by(text)
        tools = body.tool_choice_name() != "none"
        messages = self.chat_format.messages  # the answer is the format's messages (harmony)
        split = None
        if messages:
            split = partial(self.chat_format.answer_parser, calls=tools)
        elif self.reasoning or tools:
            calls = self.chat_format if tools else None
            split = partial(Splitter, reasoning=self.reasoning, tools=calls, prompt_opened=opened)
        await self._generate(
            body,
            [prompt_ids],
            limit,
            body.num_logprobs(),
            receive,
            send,
            run=run,
            split=split,
            opened=opened,
            # The format's call markers may be special tokens: left out, no call would parse.
            keep_special=(tools or messages) and self.chat_format.keep_special,
        )

    def check_model(self, model: str | None) -> None:
        """A 404 unless ``model`` is left out or names a served model."""
        if model is not None and model not in self.model_names:
            raise ApiError(
                404,
                f"model {api.echo(model)} does not exist (this server serves "
                f"{', '.join(api.echo(name) for name in self.model_names)})",
                param="model",
                type="invalid_request_error",
                code="model_not_found",
            )

    def _decode(self, raw: bytes, type_: type[T]) -> T:
        return api.decode(raw, type_, allow_unknown=self.allow_unknown_fields)

    async def _grammar(self, body: Body, opened: bool) -> object | None:
        """The compiled grammar of the request's response_format or tools, or None.
        ``opened``: the prompt opened a reasoning block."""
        think = None if self.reasoning is None else self.reasoning.grammar(opened)
        tools = isinstance(body, api.ChatCompletionRequest) and body.tool_choice_name() != "none"
        fmt = body.response_format
        if fmt is not None and fmt.get("type") != "text" and self.chat_format.messages:
            msg = "a harmony answer's JSON would sit in its final message, not held yet"
            raise ApiError(400, f"response_format: {msg}", param="response_format")
        if fmt is not None and fmt.get("type") != "text" and tools:
            raise ApiError(
                400,
                "response_format cannot go with tools unless tool_choice is 'none'",
                param="response_format",
            )
        if tools:
            assert isinstance(body, api.ChatCompletionRequest) and body.tools is not None
            specs = [
                {"name": t.function.name, "parameters": t.function.parameters} for t in body.tools
            ]
            choice, parallel = body.tool_choice_name(), body.parallel_tool_calls is not False
            submit: Callable[[], Future[object] | None] = partial(
                submit_tools,
                self.grammars,
                specs,
                choice,
                parallel,
                self.reasoning,
                opened,
                self.chat_format,
            )
        elif fmt is None:
            return None
        else:
            submit = partial(self.grammars.submit_format, fmt, think)

        try:
            # The source is built (and its size checked) off the event loop; the compile runs
            # in the compiler process (kern.engine.grammar_compile), waited on without a thread.
            future = await asyncio.to_thread(submit)
            compiled = None if future is None else await asyncio.wrap_future(future)
        except StructuredOutputError as e:
            param = e.param or ("tools" if tools else "response_format")
            raise ApiError(400, f"{param}: {e}", param=param) from None
        except GrammarUnavailable as e:
            raise ApiError(503, str(e), type="server_error") from None
        what = "tools" if tools else "a JSON response_format"
        # allowed_token_ids: two masks whose intersection may be empty, nothing left to sample.
        for param, given, why in (
            ("ignore_eos", body.ignore_eos, "the grammar ends the answer"),
            ("min_tokens", body.min_tokens, "the grammar decides where the answer ends"),
            (
                "allowed_token_ids",
                body.allowed_token_ids is not None,
                "the grammar decides what may come",
            ),
        ):
            if compiled is not None and given:
                raise ApiError(400, f"{param} cannot go with {what}: {why}", param=param)
        return compiled

    def _sampling(self, body: Body, seed: int | None) -> SamplingParams:
        """The request's sampling parameters: what it set, else the checkpoint's
        generation_config.json default, else OpenAI's."""
        d = self.sampling_defaults

        def pick(name: str, default: float) -> float:
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
        allowed = None
        if body.allowed_token_ids is not None:
            self.prompts.check_ids(body.allowed_token_ids, "allowed_token_ids")
            allowed = frozenset(body.allowed_token_ids)
        return SamplingParams(
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=max(int(pick("top_k", 0)), 0),
            min_p=pick("min_p", 0.0),
            presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            logit_bias=bias,
            allowed_token_ids=allowed,
            seed=seed,
        )

    async def _generate(
        self,
        body: Body,
        prompts: list[list[int]],
        max_tokens: int | None,
        num_logprobs: int | None,
        receive: Receive,
        send: Send,
        *,
        run: Callable[..., Run],
        split: Callable[[], Splitter] | None,
        opened: bool = False,  # the prompt opened a reasoning block
        keep_special: bool = False,  # special tokens' text stays (the format's call markers)
    ) -> None:
        """Check the limits, submit ``n`` sequences per prompt, answer with ``run``'s rendering
        of their events; ``split`` makes each choice's splitter (chat)."""
        sched = self.scheduler
        n = body.n or 1
        self._check_limits(prompts, max_tokens, chat=run is not CompletionRun)
        stop_ids = frozenset(body.stop_token_ids or ())
        self.prompts.check_ids(sorted(stop_ids), "stop_token_ids")
        # The ids whose token ends a choice: their text is left out unless asked for.
        ends = stop_ids if body.ignore_eos else stop_ids | sched.eos
        if keep_special and body.skip_special_tokens:
            name = self.chat_format.name
            msg = f"true would drop the {name} tool-call markers (special tokens) from the text"
            raise ApiError(400, f"skip_special_tokens: {msg}", param="skip_special_tokens")
        skip_special = body.skip_special_tokens is not False and not keep_special
        stops = body.stop_strings()
        grammar = await self._grammar(body, opened)
        queue: asyncio.Queue[Item] = asyncio.Queue()
        reqs, choices = [], []
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
                        priority=body.priority or 0,
                    )
                )
                choices.append(
                    Choice(
                        index,
                        self.tokenizer.stream(skip_special_tokens=skip_special),
                        stops,
                        max((len(s) for s in stops), default=1) - 1,
                        include_stop=bool(body.include_stop_str_in_output),
                        stop_tokens=ends,
                        split=None if split is None else split(),
                    )
                )
        rendering = run(
            body,
            prompts,
            n,
            reqs,
            choices,
            queue,
            model_name=self.model_name,
            tokenizer=self.tokenizer,
            abort=sched.abort,
        )
        await self._answer(rendering, receive, send)

    def _check_limits(self, prompts: list[list[int]], max_tokens: int | None, chat: bool) -> None:
        """A 400 for a prompt that is empty or whose answer would not fit (``max_tokens``
        None: as many as fit); ``chat``: the prompt is the messages."""
        sched = self.scheduler
        for i, prompt_ids in enumerate(prompts):
            param = "messages" if chat else "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if not prompt_ids:
                raise ApiError(400, "the prompt encodes to no tokens", param=param)
            limit = sched.max_tokens_for(len(prompt_ids)) if max_tokens is None else max_tokens
            try:
                sched.check(len(prompt_ids), limit)
            except LimitError as e:
                code = "context_length_exceeded"
                raise ApiError(400, str(e), param=e.param or param, code=code) from None

    async def _answer(self, rendering: Run, receive: Receive, send: Send) -> None:
        """Submit ``rendering``'s requests and answer with it, its watcher on ``receive``
        beside it; what has not finished when it returns is aborted."""
        sched, reqs = self.scheduler, rendering.reqs
        record = RECORD.get()
        if record is not None:
            record.run = rendering
            if self.log_prompts:
                record.prompt = self.tokenizer.decode(rendering.prompts[0])
        for r in reqs:
            sched.submit(r)
        self.runs.add(rendering)
        watcher = asyncio.create_task(rendering.watch(receive))
        try:
            if rendering.body.stream:
                await rendering.stream(send)
            else:
                await rendering.collect(send)
        finally:
            self.runs.discard(rendering)
            watcher.cancel()
            for r in reqs:
                if r.finish_reason is None:
                    sched.abort(r)
