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
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor

__all__ = ["Grammars", "Matcher", "StructuredOutputError"]

# Compiled grammars kept (keyed by the schema's canonical JSON).
CACHE_SIZE = 64
# UTF-8 lead bytes whose next byte is narrower than 80..BF: no overlong forms, no
# surrogates, nothing past U+10FFFF.
_SECOND_BYTE = {0xE0: (0xA0, 0xBF), 0xED: (0x80, 0x9F), 0xF0: (0x90, 0xBF), 0xF4: (0x80, 0x8F)}


class StructuredOutputError(ValueError):
    """A response_format kern cannot enforce: a bad schema, or xgrammar missing."""


class Matcher:
    """One request's grammar state."""

    def __init__(self, xgr: Any, compiled: Any, grammars: Grammars) -> None:
        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, grammars.vocab_size)
        self._g = grammars
        self._lead = -1  # a lead byte whose next byte UTF-8 restricts, just emitted

    def apply(self, logits: Tensor) -> None:
        """Set the logits [1, vocab] of tokens the grammar does not allow next to -inf."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        self._xgr.apply_token_bitmask_inplace(logits, self._bitmask)
        logits[0, self._g.banned] = -torch.inf
        if self._lead >= 0:
            lo, hi = _SECOND_BYTE[self._lead]
            first = self._g.first_byte
            outside = (first < lo) | (first > hi)
            logits[0, : outside.shape[0]][outside] = -torch.inf

    def accept(self, token: int) -> bool:
        """Advance by the token sampled; False if the grammar refuses it."""
        if self._matcher.is_terminated() or not self._matcher.accept_token(token):
            return False
        raw = self._g.token_bytes[token] if token < len(self._g.token_bytes) else b""
        self._lead = raw[-1] if raw and raw[-1] in _SECOND_BYTE else -1
        return True


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

    def compile(self, response_format: dict[str, Any]) -> Any:
        """A compiled grammar for ``response_format`` (``{"type": "json_object"}`` or
        ``{"type": "json_schema", "json_schema": {"schema": {...}, ...}}``); None for
        ``{"type": "text"}``. Raises :class:`StructuredOutputError`."""
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
        key = json.dumps(schema, sort_keys=True)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        self._load()
        try:
            compiled = self._compiler.compile_json_schema(key, any_whitespace=False)
        except Exception as e:  # xgrammar raises plain RuntimeErrors for bad schemas
            raise StructuredOutputError(f"the JSON schema does not compile: {e}") from None
        self._cache[key] = compiled
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled: Any) -> Matcher:
        return Matcher(self._xgr, compiled, self)
