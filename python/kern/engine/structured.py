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
* Tool calls (:meth:`Grammars.compile_tools`) are an xgrammar structural tag in Qwen3's
  convention: ``required`` is one or more ``<tool_call>`` blocks (one when
  parallel_tool_calls is false), a named function exactly one block of it, ``auto`` free text
  in which a block, once opened, must be a call of one of the tools. The arguments follow each
  tool's parameters schema, with at most one whitespace character between JSON tokens (free
  whitespace again). Newlines are part of the convention, so these grammars do not ban
  control-character tokens: xgrammar's JSON string rule already excludes raw control
  characters here.
* In Kimi K2's convention (``tool_parser = "kimi_k2"``) the calls are one section:
  ``<|tool_calls_section_begin|>``, per call ``<|tool_call_begin|>functions.NAME:`` an index,
  ``<|tool_call_argument_begin|>``, the arguments and ``<|tool_call_end|>``, then
  ``<|tool_calls_section_end|>``; ``auto`` holds a section, once opened, to calls of the tools.
  The markers are special tokens of Kimi's tokenizer. xgrammar matches text, and the
  vocabulary handed over holds every added token as its text (special or not, none is left
  out), so the grammar allows a marker's token as well as the marker spelt in pieces.
* With a reasoning parser on, a constrained answer may start with a ``<think>...</think>``
  block followed by a blank line (and must, when the prompt opened one): the constraint holds
  for the answer, not the reasoning, as in vLLM.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor

__all__ = ["Grammars", "Matcher", "StructuredOutputError"]

# Compiled grammars kept, keyed by the schema's JSON in the request's own key order: the order
# of ``properties`` is the order the answer's keys come in (as OpenAI and vLLM keep it), so two
# schemas that differ only in order are two grammars.
CACHE_SIZE = 64
# xgrammar 0.2.8 writes the characters of a length-bounded JSON string (maxLength) as
# [^"\\\r\n]: raw control characters pass, which JSON forbids (seen: a tool call's
# arguments with \x0e in a string). Its unbounded strings exclude them; so do these.
_LOOSE_CHARS = r"[^\"\\\r\n]"
_STRICT_CHARS = r"[^\0-\x1f\"\\]"
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ", re.MULTILINE)
# Whitespace characters allowed between JSON tokens in a structural tag's JSON.
TAG_WHITESPACE = 1
# UTF-8 lead bytes whose next byte is narrower than 80..BF: no overlong forms, no
# surrogates, nothing past U+10FFFF.
_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}
# Kimi K2's tool-call markers (kern.server.splitter reads them; the engine imports no server).
KIMI_SECTION_BEGIN, KIMI_SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
KIMI_ARGUMENTS = "<|tool_call_argument_begin|>"
# A Kimi call's index (calls counted over the conversation): bounded, so that a model the
# grammar holds cannot write digits forever.
KIMI_INDEX = "(0|[1-9][0-9]{0,5})"


# Threads xgrammar fills a step's masks with: one took 0.72 ms per batch-32 step, two 2.7 ms, on
# the 2-core machine this was measured on (32 JSON-schema rows of the tiny vocabulary).
BATCH_THREADS = 1


class StructuredOutputError(ValueError):
    """A response_format kern cannot enforce: a bad schema, or xgrammar missing."""


class Matcher:
    """One request's grammar state."""

    def __init__(self, xgr: Any, compiled: Any, grammars: Grammars) -> None:
        self._xgr = xgr
        grammar, self._ban_controls = compiled
        self._matcher = xgr.GrammarMatcher(grammar)
        self._g = grammars
        self._lead = -1  # a lead byte whose next byte UTF-8 restricts, just emitted

    def apply(self, logits: Tensor) -> None:
        """Set the logits [1, vocab] of tokens the grammar does not allow next to -inf."""
        apply_all(logits, [(0, self)])

    @property
    def done(self) -> bool:
        """The grammar has ended (its end-of-sequence token was accepted)."""
        return bool(self._matcher.is_terminated())

    def _extra(self, row: Tensor) -> None:
        """What this matcher bans beyond xgrammar's mask and the control tokens, in ``row``
        [vocab]."""
        if self._lead >= 0:
            lo, hi = _SECOND_BYTE[self._lead]
            first = self._g.first_byte
            outside = (first < lo) | (first > hi)
            row[: outside.shape[0]][outside] = -torch.inf

    def accept(self, token: int) -> bool:
        """Advance by the token sampled; False if the grammar refuses it."""
        if self._matcher.is_terminated() or not self._matcher.accept_token(token):
            return False
        raw = self._g.token_bytes[token] if token < len(self._g.token_bytes) else b""
        self._lead = raw[-1] if raw and raw[-1] in _SECOND_BYTE else -1
        return True


def apply_all(logits: Tensor, rows: list[tuple[int, Matcher]]) -> None:
    """Mask rows of ``logits`` [N, vocab], each ``(row, matcher)`` by its matcher: one bitmask
    filled row by row and applied in one call. Each
    row's mask is its matcher's alone, so a row's result does not depend on the others."""
    if not rows:
        return
    first = rows[0][1]
    bitmask = first._xgr.allocate_token_bitmask(logits.shape[0], first._g.vocab_size)
    first._g.batch.batch_fill_next_token_bitmask(
        [m._matcher for _, m in rows], bitmask, [k for k, _ in rows]
    )
    first._xgr.apply_token_bitmask_inplace(logits, bitmask, indices=[k for k, _ in rows])
    banning = [k for k, m in rows if m._ban_controls]
    if banning:
        banned = first._g.banned
        logits[torch.tensor(banning).unsqueeze(1), banned.unsqueeze(0)] = -torch.inf
    for k, m in rows:
        if m._lead >= 0:
            m._extra(logits[k])


class Grammars:
    """Compiles response formats for one tokenizer and model vocabulary."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._xgr: Any = None
        self._compiler: Any = None
        self.banned = torch.empty(0, dtype=torch.long)
        self.token_bytes: list[bytes] = []
        self.first_byte = torch.empty(0, dtype=torch.int16)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self.batch: Any = None

    def _load(self) -> Any:
        if self._xgr is None:
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
            info = xgrammar.TokenizerInfo(
                encoded,
                vocab_type=xgrammar.VocabType.BYTE_LEVEL,
                vocab_size=self.vocab_size,
                stop_token_ids=list(self.tokenizer.eos_token_ids),
            )
            self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
            # Fills every row's mask in one call (C++ threads; the masks do not depend on
            # how many).
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
            self._xgr = xgrammar
        return self._xgr

    def compile(self, response_format: dict[str, Any], think: str | None = None) -> Any:
        """A compiled grammar for ``response_format`` (``{"type": "json_object"}`` or
        ``{"type": "json_schema", "json_schema": {"schema": {...}, ...}}``); None for
        ``{"type": "text"}``. ``think``: None, or "may"/"must" start with a reasoning block.
        Raises :class:`StructuredOutputError`."""
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
            return self._tag(_sequence(think, _json(schema)), "the JSON schema")
        key = json.dumps(schema)

        def build() -> Any:
            grammar = self._xgr.Grammar.from_json_schema(key, any_whitespace=False)
            return self._compiler.compile_grammar(self._strict(grammar))

        return self._cached(key, build, "the JSON schema", ban_controls=True)

    def compile_tools(
        self,
        tools: list[dict[str, Any]],
        choice: str,
        parallel: bool,
        think: str | None,
        tool_parser: str = "qwen3",
    ) -> Any:
        """The grammar of an answer to a request with ``tools`` (``{"name", "parameters"}``
        each) and tool_choice ``choice``: "auto", "required" or a tool's name, its calls
        written in ``tool_parser``'s convention ("qwen3" or "kimi_k2", kern.server.splitter).
        Raises :class:`StructuredOutputError`."""
        chosen = [t for t in tools if choice in ("auto", "required") or t["name"] == choice]
        build = _kimi_calls if tool_parser == "kimi_k2" else _qwen3_calls
        return self._tag(
            _sequence(think, build(chosen, choice, parallel)), "a tool's parameters schema"
        )

    def _tag(self, fmt: dict[str, Any], what: str) -> Any:
        key = json.dumps({"type": "structural_tag", "format": fmt})

        def build() -> Any:
            grammar = self._xgr.Grammar.from_structural_tag(key)
            return self._compiler.compile_grammar(self._strict(grammar))

        return self._cached(key, build, what, ban_controls=False)

    def _strict(self, grammar: Any) -> Any:
        """``grammar`` with xgrammar's loose JSON string characters made strict (see the
        design notes)."""
        text = str(grammar)
        if _LOOSE_CHARS not in text:
            return grammar
        return self._xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHARS, _STRICT_CHARS))

    def _cached(self, key: str, build: Any, what: str, *, ban_controls: bool) -> Any:
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        self._load()
        try:
            compiled = (build(), ban_controls)
        except Exception as e:  # xgrammar raises plain RuntimeErrors for bad schemas
            # xgrammar's messages start with a time and its source file: keep the reason.
            reason = _XGR_PREFIX.sub("", str(e)).strip()
            raise StructuredOutputError(f"{what} does not compile: {reason}") from None
        self._cache[key] = compiled
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled: Any) -> Matcher:
        return Matcher(self._xgr, compiled, self)


def _json(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": TAG_WHITESPACE}


def _sequence(think: str | None, answer: dict[str, Any]) -> dict[str, Any]:
    """``answer``, after a reasoning block that ``think`` says may ("may") or must ("must",
    the prompt opened it) come first."""
    if think is None:
        return answer
    if think == "must":
        block: dict[str, Any] = {"type": "tag", "begin": "", "content": {"type": "any_text"},
                                 "end": "</think>\n\n"}  # fmt: skip
    else:
        block = {
            "type": "optional",
            "content": {"type": "tag", "begin": "<think>", "content": {"type": "any_text"},
                        "end": "</think>\n\n"},
        }  # fmt: skip
    return {"type": "sequence", "elements": [block, answer]}


def _arguments(tool: dict[str, Any]) -> dict[str, Any]:
    return _json(tool.get("parameters") or {"type": "object"})


def _qwen3_calls(tools: list[dict[str, Any]], choice: str, parallel: bool) -> dict[str, Any]:
    """Calls as ``<tool_call>`` blocks, one per call, a newline between them."""
    tags = [
        {
            "type": "tag",
            "begin": '<tool_call>\n{"name": ' + json.dumps(t["name"]) + ', "arguments": ',
            "content": _arguments(t),
            "end": "}\n</tool_call>",
        }
        for t in tools
    ]
    if choice == "auto":
        return {
            "type": "triggered_tags",
            "triggers": ["<tool_call>"],
            "tags": tags,
            "stop_after_first": not parallel,
        }
    if choice == "required":
        return {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": not parallel,
        }
    return tags[0]


def _kimi_calls(tools: list[dict[str, Any]], choice: str, parallel: bool) -> dict[str, Any]:
    """Calls in one Kimi tool-calls section: each ``functions.NAME:INDEX`` and its arguments
    between Kimi's markers (see the design notes)."""
    tags = [
        {
            "type": "tag",
            "begin": KIMI_CALL_BEGIN + "functions." + t["name"] + ":",
            "content": {
                "type": "sequence",
                "elements": [
                    {"type": "regex", "pattern": KIMI_INDEX},
                    {"type": "const_string", "value": KIMI_ARGUMENTS},
                    _arguments(t),
                ],
            },
            "end": KIMI_CALL_END,
        }
        for t in tools
    ]
    calls: dict[str, Any] = tags[0]
    if choice in ("auto", "required"):
        calls = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": "",
            "at_least_one": True,
            "stop_after_first": not parallel,
        }
    if choice == "auto":
        section = {"type": "tag", "begin": KIMI_SECTION_BEGIN, "content": calls,
                   "end": KIMI_SECTION_END}  # fmt: skip
        return {
            "type": "triggered_tags",
            "triggers": [KIMI_SECTION_BEGIN],
            "tags": [section],
            "stop_after_first": not parallel,
            # A call outside a section would not parse: the text may not open one.
            "excludes": [KIMI_CALL_BEGIN],
        }
    return {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": KIMI_SECTION_BEGIN},
            calls,
            {"type": "const_string", "value": KIMI_SECTION_END},
        ],
    }
