"""Structured output: ``response_format`` JSON (any object, or a JSON schema) enforced by a
token mask before sampling, with xgrammar.

Design notes
------------
* xgrammar because vLLM and SGLang use it: a grammar compiles once per schema (cached here),
  then a per-request matcher fills the bitmask of tokens that keep the output a valid prefix,
  in microseconds per step. llguidance would serve as well; xgrammar has the larger user base.
  It is an optional dependency (``pip install kern[structured]``): without it a request that
  asks for structured output is refused naming the package, never served unconstrained.
* The vocabulary is handed over as the tokenizer's byte-level token strings, so the mask is
  exact for every token, partial UTF-8 characters included; ids the model has past the
  tokenizer's vocabulary are never allowed.
* JSON is compiled without free whitespace (``", "`` and ``": "`` separators): a random-weight
  model given free whitespace can emit it forever. xgrammar 0.2.8's string rule admits raw
  control characters (U+0000-U+001F), which JSON forbids unescaped (``json.loads`` refused 8
  of 40 outputs of the tiny model): tokens holding such bytes are banned as well, which only
  removes what the grammar should not have allowed (no whitespace but the space is needed).
* xgrammar 0.2.8 also lets a string hold UTF-16 surrogates encoded as UTF-8 (``ED A0..BF ..``,
  seen in 1 of 60 tiny-model answers), which no UTF-8 decoder accepts, and which then
  decode to U+FFFD. After a lead byte whose next byte UTF-8 restricts (E0, ED, F0, F4), the
  matcher also bans tokens whose first byte is outside the allowed range.
* A matcher is a request's state (``Request.grammar``): the sampler masks the row with it, the
  scheduler feeds it each token produced. The grammar ends with an end-of-sequence token, so
  a finished JSON ends the answer with ``stop``.
* The mask touches its own row only: a constrained answer is the same alone and in a batch.
* Tool calls (:meth:`Grammars.compile_tools`) are an xgrammar structural tag in the target's
  chat format (kern.chat_formats, each format's notes say what it enforces): ``required``
  one or more calls (one when parallel_tool_calls is false), a named function exactly one
  call of it, ``auto`` free text in which a call, once opened, must be a call of one of the
  tools. The arguments follow each tool's parameters schema, with at most one whitespace
  character between JSON tokens (free whitespace again). Newlines are part of the formats,
  so these grammars do not ban control-character tokens: xgrammar's JSON string rule
  already excludes raw control characters here. In a format whose calls are one tag each
  (``ChatFormat.calls_lazy``), ``auto`` is held lazily instead, one grammar per tool, each
  cached alone (kern.engine.tool_calls): an agent's tool list changes from request to
  request, and one tag for all of it is a large grammar.
* Compiles run where :class:`Grammars` is given a budget (the server): each first in a
  process of its own that is killed past the time budget, a source over the size budget
  refused before it is compiled (kern.engine.grammar_compile); one that compiled there
  within the budget is compiled again here, on one compile thread, since the compiled
  grammar does not cross the process boundary well (Claude Code's 21 tools as one tag: 447
  MB as JSON, 26 s to write and 8.5 s to read). Neither takes the engine's thread or the
  event loop (xgrammar's compile releases the GIL). :meth:`Grammars.submit` returns a
  future; compiled grammars are cached (and so are refusals: a schema sent again is refused
  without compiling it again). Measured on 2 cores (``python -m kern.bench.tool_grammars``,
  docs/serve.md): one tool's tag 20-30 ms that way, Claude Code's 21 tools as one tag 0.34
  s (40.7 s when the grammar came back as JSON, refused at the default 5 s budget), a
  cached one about 50 us. Without a budget (test harnesses, benchmarks) a compile runs in
  the caller's thread.
* With a reasoning parser on, a constrained answer may start with its reasoning block and the
  blank line after it (kern.chat_formats.Reasoning.grammar), and must when the prompt opened
  one: the constraint holds for the answer, not the reasoning, as in vLLM.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kern.chat_formats import DEFAULT, ChatFormat, json_format
from kern.engine.grammar_compile import (
    CompileFailed,
    CompilePool,
    CompilerUnavailable,
    CompileTimeout,
    GrammarBudget,
    build_grammar,
    reason,
)
from kern.engine.masks import BATCH_THREADS, Matcher

__all__ = [
    "GrammarBudget",
    "GrammarUnavailable",
    "Grammars",
    "Matcher",
    "Source",
    "StructuredOutputError",
]

log = logging.getLogger("kern")

# Compiled grammars kept, keyed by the schema's JSON in the request's own key order: the order
# of ``properties`` is the order the answer's keys come in (as OpenAI and vLLM keep it), so two
# schemas that differ only in order are two grammars. Room for a few agents' tool sets, one
# grammar per tool (kern.engine.tool_calls), within CACHE_BYTES of compiled grammars (xgrammar's
# own count: Claude Code's 21 tools, 3.9 MB as one tag on the tiny vocabulary, 4.1 MB apart).
CACHE_SIZE = 256
CACHE_BYTES = 1 << 30
# Sources refused (over a budget, or not compiling) kept, by their SHA-256.
REFUSED_SIZE = 256


class StructuredOutputError(ValueError):
    """A response_format or tools kern cannot enforce: a bad schema, one over a grammar budget,
    or xgrammar missing. ``reason``: what is wrong with the source, without naming it (a
    refusal is remembered by the source, whatever names it); ``param``: the request's field at
    fault where it is narrower than the server's default."""

    def __init__(self, message: str, *, reason: str = "", param: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or message
        self.param = param


class GrammarUnavailable(RuntimeError):
    """The grammar compiler process could not compile anything (not the request's fault)."""


@dataclass(frozen=True)
class Source:
    """What to compile: ``kind`` "json_schema" or "structural_tag", ``key`` its JSON (and the
    cache's key), ``what`` its name in an error, and whether control-character tokens are
    banned beside the grammar."""

    kind: str
    key: str
    what: str
    ban_controls: bool


class Grammars:
    """Compiles response formats for one tokenizer and model vocabulary; with a ``budget``,
    in the compiler process and within it (see the design notes)."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, budget: GrammarBudget | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.budget = budget
        self._xgr: Any = None
        self._info: Any = None
        self._compiler: Any = None
        self._pool: CompilePool | None = None
        # Compiles in this process of sources the compiler process has checked: one at a time,
        # off the event loop, the engine's thread and the pool's reader.
        self._thread: ThreadPoolExecutor | None = None
        # Compiles started (not answered from the cache or the refusals): what tests count.
        self.compiles = 0
        self.banned = torch.empty(0, dtype=torch.long)
        self.token_bytes: list[bytes] = []
        self.first_byte = torch.empty(0, dtype=torch.int16)
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_bytes = 0
        # Compiles under way, by key: a second request for the same source waits on the first.
        self._pending: dict[str, Future[Any]] = {}
        self._refused: OrderedDict[bytes, str] = OrderedDict()
        self.batch: Any = None

    @property
    def xgr(self) -> Any:
        """The xgrammar module (imported on first use)."""
        return self._load()

    def _load(self) -> Any:
        with self._lock:
            if self._xgr is None:
                self._xgr = self._setup()
        return self._xgr

    def _setup(self) -> Any:
        try:
            import xgrammar
        except ImportError:
            raise StructuredOutputError(
                "structured output needs the xgrammar package (pip install 'kern[structured]')"
            ) from None
        backend = self.tokenizer.backend
        vocab = backend.get_vocab(with_added_tokens=True)
        encoded = [""] * (max(vocab.values()) + 1)
        for token, i in vocab.items():
            encoded[i] = token
        self._info = xgrammar.TokenizerInfo(
            encoded,
            vocab_type=xgrammar.VocabType.BYTE_LEVEL,
            vocab_size=self.vocab_size,
            stop_token_ids=list(self.tokenizer.eos_token_ids),
        )
        if self.budget is None:
            self._compiler = xgrammar.GrammarCompiler(self._info, cache_enabled=False)
        else:
            # One thread, as in the compiler process: a checked compile takes one core at most.
            self._compiler = xgrammar.GrammarCompiler(
                self._info, max_threads=1, cache_enabled=False
            )
            self._pool = CompilePool(self._info.serialize_json(), self.budget)
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="kern-grammar")
        # Fills every row's mask in one call (C++ threads; the masks do not depend on how many).
        self.batch = xgrammar.BatchGrammarMatcher(BATCH_THREADS)
        eos = set(self.tokenizer.eos_token_ids)
        self.token_bytes = [self.tokenizer.token_bytes(i) for i in range(len(encoded))]
        banned = [
            i
            for i, raw in enumerate(self.token_bytes)
            if i not in eos and any(b < 0x20 for b in raw)
        ]
        self.banned = torch.tensor(banned, dtype=torch.long)
        # -1 for tokens with no bytes (or that are not text): never a continuation.
        self.first_byte = torch.tensor(
            [raw[0] if raw and i not in eos else -1 for i, raw in enumerate(self.token_bytes)],
            dtype=torch.int16,
        )
        return xgrammar

    def compile(self, response_format: dict[str, Any], think: dict[str, Any] | None = None) -> Any:
        """A compiled grammar for ``response_format`` (see :meth:`source`); None for
        ``{"type": "text"}``. Blocks until compiled. Raises :class:`StructuredOutputError`."""
        source = self.source(response_format, think)
        return None if source is None else self.submit(source).result()

    def submit_format(
        self, response_format: dict[str, Any], think: dict[str, Any] | None = None
    ) -> Future[Any] | None:
        """:meth:`submit` of :meth:`source`: None for ``{"type": "text"}``."""
        source = self.source(response_format, think)
        return None if source is None else self.submit(source)

    def compile_tools(
        self,
        tools: list[dict[str, Any]],
        choice: str,
        parallel: bool,
        think: dict[str, Any] | None,
        chat_format: ChatFormat = DEFAULT,
    ) -> Any:
        """The grammar of :meth:`tools_source`, compiled (blocks). Raises
        :class:`StructuredOutputError`."""
        return self.submit(self.tools_source(tools, choice, parallel, think, chat_format)).result()

    def source(
        self, response_format: dict[str, Any], think: dict[str, Any] | None = None
    ) -> Source | None:
        """What to compile for ``response_format`` (``{"type": "json_object"}`` or
        ``{"type": "json_schema", "json_schema": {"schema": {...}, ...}}``); None for
        ``{"type": "text"}``. ``think``: None, or the reasoning block the answer may (or must)
        start with (kern.chat_formats.Reasoning.grammar). Raises
        :class:`StructuredOutputError` (the size budget too)."""
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            schema: Any = {"type": "object"}
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise StructuredOutputError("json_schema must be an object with a 'schema' object")
            schema = spec.get("schema", {})
        else:
            raise StructuredOutputError(
                f"type {kind!r} is not one of 'text', 'json_object', 'json_schema'"
            )
        if think is not None:
            return self._tag(_after(think, json_format(schema)), "the JSON schema")
        return self._source("json_schema", schema, "the JSON schema", ban_controls=True)

    def tools_source(
        self,
        tools: list[dict[str, Any]],
        choice: str,
        parallel: bool,
        think: dict[str, Any] | None,
        chat_format: ChatFormat = DEFAULT,
    ) -> Source:
        """What to compile for an answer to a request with ``tools`` (``{"name",
        "parameters"}`` each) and tool_choice ``choice``: "auto", "required" or a tool's name,
        its calls written in ``chat_format`` (kern.chat_formats); ``think`` as for
        :meth:`source`. Raises :class:`StructuredOutputError`."""
        chosen = [t for t in tools if choice in ("auto", "required") or t["name"] == choice]
        calls = chat_format.grammar(chosen, choice, parallel)
        return self._tag(_after(think, calls), "a tool's parameters schema")

    def _tag(self, fmt: dict[str, Any], what: str) -> Source:
        return self.tag_source(fmt, what)

    def tag_source(self, fmt: dict[str, Any], what: str) -> Source:
        """What to compile for the structural tag's element ``fmt``, named ``what`` in an
        error. Raises :class:`StructuredOutputError` (the size budget too)."""
        tag = {"type": "structural_tag", "format": fmt}
        return self._source("structural_tag", tag, what, ban_controls=False)

    def _source(self, kind: str, value: Any, what: str, *, ban_controls: bool) -> Source:
        try:
            key = json.dumps(value)
        except RecursionError:
            raise StructuredOutputError(f"{what} is nested too deeply") from None
        limit = self.budget.max_bytes if self.budget is not None else None
        if limit is not None and len(key) > limit:
            raise StructuredOutputError(
                f"{what} is {len(key)} bytes as JSON, over the grammar size budget of {limit} "
                "bytes (the server's grammar_max_bytes)"
            )
        return Source(kind, key, what, ban_controls)

    def warm(self) -> None:
        """Get ready for the first grammar: xgrammar imported and the vocabulary read here,
        the compiler process started (2-3 s, on the 2-core test machine, that a coding
        agent's first request would otherwise wait). Best effort: what fails here fails the
        first compile again, and that says why."""
        try:
            self._load()
            if self._pool is not None:
                self._pool.start()
        except (StructuredOutputError, OSError) as e:
            log.debug("grammars not made ready at start: %s", e)

    def submit(self, source: Source) -> Future[Any]:
        """A future of ``source``'s compiled grammar: done at once when cached (or compiled
        here, without a budget), else once the compiler process has checked it and this
        process's compile thread has compiled it. It fails with
        :class:`StructuredOutputError` (the time budget too) or :class:`GrammarUnavailable`."""
        self._load()
        digest = hashlib.sha256(source.key.encode()).digest()
        with self._lock:
            if source.key in self._cache:
                self._cache.move_to_end(source.key)
                return _done(self._cache[source.key])
            if digest in self._refused:
                return _done(error=_refusal(source, self._refused[digest]))
            if source.key in self._pending:
                return self._pending[source.key]
            outer: Future[Any] = Future()
            self._pending[source.key] = outer
            self.compiles += 1
        if self._pool is None:
            self._landed(source, outer, self._compile_here(source))
        else:
            self._pool.submit(source.kind, source.key).add_done_callback(
                lambda checked: self._checked(source, outer, checked)
            )
        return outer

    def _checked(self, source: Source, outer: Future[Any], checked: Future[float]) -> None:
        """The compiler process's answer (its reader thread): a source that compiled there
        within the budget is compiled again on this process's compile thread (no grammar
        crosses the process boundary: see kern.engine.grammar_compile); a refusal is final."""
        if checked.exception() is not None or self._thread is None:
            self._landed(source, outer, checked)
            return
        try:
            self._thread.submit(lambda: self._landed(source, outer, self._compile_here(source)))
        except RuntimeError:  # closed: the server is stopping
            self._landed(source, outer, _done(error=CompilerUnavailable("closed")))

    def _compile_here(self, source: Source) -> Future[Any]:
        try:
            grammar = build_grammar(self._xgr, source.kind, source.key)
            return _done(self._compiler.compile_grammar(grammar))
        except Exception as e:  # xgrammar raises plain RuntimeErrors for bad schemas
            return _done(error=CompileFailed(reason(e)))

    def _landed(self, source: Source, outer: Future[Any], inner: Future[Any]) -> None:
        """Complete ``outer`` from the compile ``inner`` (this process's compile, or the
        compiler process's refusal): the grammar cached, or the refusal said and
        remembered."""
        error: BaseException | None = None
        compiled: Any = None
        try:
            compiled = (inner.result(), source.ban_controls)
        except CompileFailed as e:
            error = _refusal(source, f"does not compile: {e}")
        except CompileTimeout as e:
            assert self.budget is not None
            error = _refusal(
                source,
                f"did not compile within the grammar time budget of {self.budget.timeout:g} s "
                f"of CPU (the server's grammar_timeout; killed at {e})",
            )
        except CompilerUnavailable as e:
            error = GrammarUnavailable(f"the grammar compiler failed: {e}")
        with self._lock:
            self._pending.pop(source.key, None)
            if isinstance(error, StructuredOutputError):
                self._refused[hashlib.sha256(source.key.encode()).digest()] = error.reason
                if len(self._refused) > REFUSED_SIZE:
                    self._refused.popitem(last=False)
            elif error is None:
                self._cache[source.key] = compiled
                self._cache_bytes += _size(compiled)
                while len(self._cache) > CACHE_SIZE or self._cache_bytes > CACHE_BYTES:
                    self._cache_bytes -= _size(self._cache.popitem(last=False)[1])
        if error is None:
            outer.set_result(compiled)
        else:
            outer.set_exception(error)

    def close(self) -> None:
        """End the compiler process, if one runs, and the compile thread."""
        if self._pool is not None:
            self._pool.close()
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)

    def matcher(self, compiled: Any) -> Any:
        """A request's grammar state for ``compiled`` (a future's result): a :class:`Matcher`,
        or what a lazily held tool set makes (kern.engine.tool_calls.ToolSet.matcher)."""
        if isinstance(compiled, tuple):
            return Matcher(self._xgr, compiled, self)
        return compiled.matcher()


def _after(think: dict[str, Any] | None, answer: dict[str, Any]) -> dict[str, Any]:
    """``answer``, after the reasoning block ``think`` if there is one."""
    if think is None:
        return answer
    return {"type": "sequence", "elements": [think, answer]}


def _size(compiled: tuple[Any, bool]) -> int:
    return int(getattr(compiled[0], "memory_size_bytes", 0))


def _refusal(source: Source, why: str) -> StructuredOutputError:
    return StructuredOutputError(f"{source.what} {why}", reason=why)


def _done(value: Any = None, *, error: BaseException | None = None) -> Future[Any]:
    future: Future[Any] = Future()
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)
    return future
