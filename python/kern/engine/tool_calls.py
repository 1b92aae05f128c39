"""tool_choice "auto" held lazily: the answer is free text until the chat format's trigger
(``calls_open``), then the union of the tools' own grammars, each compiled and cached alone.

Design notes
------------
* Why: one structural tag for a coding agent's tool set does not scale. Claude Code's 21
  tools (24 KB of parameter schemas as the tag holds them) compile in 0.14 s with xgrammar
  0.2.8 on the tiny vocabulary, but the compiled grammar is 447 MB as JSON (26 s to write, 8.5
  s to read back), and any change to the list (12 tools, then 21, then a subagent's subset)
  is a new grammar. Each tool's call compiled alone is small, and is cached by its source
  (its name and schema in the format): a changed list compiles only the tools not seen
  before. Figures and the command that measured them: docs/serve.md, "Grammar budgets".
* Where: formats whose calls are each one tag starting with a fixed trigger
  (``ChatFormat.calls_lazy``: qwen3). Others (kimi_k2's calls sit in a section), and
  tool_choice "required" or a named function, keep the whole structural tag
  (kern.engine.structured).
* Before a call the text is tracked over the tokens' bytes (``Grammars.token_bytes``), the
  trigger found across token boundaries. A token that would complete the trigger and go on
  past it is banned, so a call always starts at a token boundary, where the tools' matchers
  start (fed the trigger with ``accept_string``). The whole grammar allows such a token when
  what follows it starts a call; that is the one way the masks differ (compared token by
  token in tests/test_tool_calls.py). A tokenizer with the trigger as one token (Qwen3's)
  loses nothing.
* After the trigger: one xgrammar ``GrammarMatcher`` per tool still possible, the mask the OR
  of theirs; one that refuses the token drops out. A finished call goes back to free text
  with parallel calls, else only end of sequence may follow (``stop_after_first``). A step's
  mask on the tiny vocabulary, Claude Code's 21 tools: 12 us in free text (the whole tag's
  13), 76 us right after the trigger (one mask per candidate; the whole tag's 15), 22 us
  once the name has left one (16). The candidates are all live only until the name.
* With a reasoning parser the trigger does not count inside the block: the prompt opened it
  (the answer starts inside), or the answer may start with it. In that second case both
  readings stay until one dies, as xgrammar's parser keeps every parse: the mask is the
  union of the branches'. The block ends at its ``close`` and ``gap``; end of sequence only
  in free text or after a finished call.
* Free-text masks depend only on where the text is in the markers: computed once per such
  state and tokenizer (one pass over the vocabulary), cached. The UTF-8 second-byte rule is
  kern.engine.masks.Matcher's; ids past the tokenizer's vocabulary and tokens without
  bytes are never allowed there, as in xgrammar.
* Speculative decoding never drafts for a request with a grammar (kern.engine.drafters), so
  the matcher needs what the sampler and the request use and no more: ``apply``, ``accept``
  and ``done``.
"""

from __future__ import annotations

import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from kern.chat_formats import ChatFormat, Reasoning
from kern.engine.masks import ban_second_bytes, lead_byte
from kern.engine.structured import Grammars, StructuredOutputError

__all__ = ["ToolCallMatcher", "ToolSet", "submit_tools"]

# A place in the text before a call: ("open", k) k bytes of the reasoning block's opener
# written at the answer's start; ("think", k) inside the block, k bytes of its close and gap
# matched; ("free", k) free text, k bytes of the trigger matched; ("end", 0) only end of
# sequence may come.
State = tuple[str, int]
# What running a token's bytes from a state can give besides a state: the trigger, ending
# exactly with the token.
CALL = ("call", 0)
END: State = ("end", 0)


def submit_tools(
    grammars: Grammars,
    tools: list[dict[str, Any]],
    choice: str,
    parallel: bool,
    reasoning: Reasoning | None,
    opened: bool,
    chat_format: ChatFormat,
) -> Future[Any]:
    """A future of what constrains an answer to a request with ``tools`` (``{"name",
    "parameters"}`` each) and tool_choice ``choice`` (see
    :meth:`Grammars.tools_source`): a :class:`ToolSet` for "auto" in a ``calls_lazy`` format,
    else the whole structural tag's compiled grammar. ``reasoning``: the reasoning block, or
    None; ``opened``: the prompt opened it. Either goes to :meth:`Grammars.matcher`. Raises,
    or the future fails with, :class:`StructuredOutputError` (for one tool: naming it) or
    GrammarUnavailable."""
    think = None if reasoning is None else reasoning.grammar(opened)
    # Built either way: the size budget holds for the whole list.
    whole = grammars.tools_source(tools, choice, parallel, think, chat_format)
    if choice != "auto" or not chat_format.calls_lazy or not tools:
        return grammars.submit(whole)
    sources = [
        grammars.tag_source(chat_format.call_grammar(t), "a tool's parameters schema")
        for t in tools
    ]
    futures = [grammars.submit(s) for s in sources]
    outer: Future[Any] = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def landed(_: Future[Any]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        for i, f in enumerate(futures):
            error = f.exception()
            if isinstance(error, StructuredOutputError):
                name = tools[i]["name"]
                error = StructuredOutputError(
                    f"the parameters schema of tool {name!r} {error.reason}",
                    reason=error.reason,
                    param=f"tools[{i}].function.parameters",
                )
            if error is not None:
                outer.set_exception(error)
                return
        compiled = tuple(f.result()[0] for f in futures)
        outer.set_result(
            ToolSet(grammars, chat_format.calls_open, compiled, parallel, reasoning, opened)
        )

    for f in futures:
        f.add_done_callback(landed)
    return outer


@dataclass(frozen=True)
class ToolSet:
    """tool_choice "auto" over ``tools`` (each one's compiled call grammar, from
    ``trigger`` on), held lazily (see the design notes)."""

    grammars: Grammars
    trigger: str
    tools: tuple[Any, ...]
    parallel: bool
    reasoning: Reasoning | None
    opened: bool

    def matcher(self) -> ToolCallMatcher:
        return ToolCallMatcher(self)


class ToolCallMatcher:
    """One request's state under a :class:`ToolSet`: the branches the answer may still be on,
    each a text :data:`State` or a :class:`_Call`."""

    def __init__(self, tools: ToolSet) -> None:
        self._tools = tools
        self._g = tools.grammars
        self._text = _text(tools)
        self._branches: list[State | _Call] = [("free", 0)]
        if tools.reasoning is not None:
            self._branches = [("think", 0)] if tools.opened else [("open", 0), ("free", 0)]
        self._lead = -1
        self._done = False

    @property
    def done(self) -> bool:
        """The answer has ended (its end-of-sequence token was accepted)."""
        return self._done

    def apply(self, logits: Tensor) -> None:
        """Set the logits [1, vocab] of tokens no branch allows next to -inf."""
        mask: Tensor | None = None
        for b in self._branches:
            m = b.mask() if isinstance(b, _Call) else self._text.mask(b)
            mask = m.clone() if mask is None else mask.bitwise_or_(m)
        assert mask is not None
        self._g.xgr.apply_token_bitmask_inplace(logits, mask.unsqueeze(0))
        if self._lead >= 0:
            ban_second_bytes(logits[0], self._lead, self._g.first_byte)

    def accept(self, token: int) -> bool:
        """Advance by the token sampled; False if no branch allows it."""
        if self._done:
            return False
        if token in self._text.eos:
            self._done = any(b == END or b[0] == "free" for b in self._text_states())
            return self._done
        raw = self._g.token_bytes[token] if token < len(self._g.token_bytes) else b""
        if not raw:
            return False
        after = ("free", 0) if self._tools.parallel else END
        branches: list[State | _Call] = []
        for b in self._branches:
            if isinstance(b, _Call):
                live, finished = b.accept(token)
                branches += [b] if live else []
                branches += [after] if finished else []
                continue
            state = self._text.run(b, raw)
            if state == CALL:
                branches.append(_Call(self._tools))
            elif state is not None:
                branches.append(state)
        if not branches:
            return False
        # Two readings that reach the same text state are one from here on.
        self._branches = [
            b for i, b in enumerate(branches) if isinstance(b, _Call) or b not in branches[:i]
        ]
        self._lead = lead_byte(self._g.token_bytes, token)
        return True

    def _text_states(self) -> list[State]:
        return [b for b in self._branches if not isinstance(b, _Call)]


class _Call:
    """A call under way: a matcher per tool it may still be a call of."""

    def __init__(self, tools: ToolSet) -> None:
        self._g = tools.grammars
        xgr = self._g.xgr
        self._live = []
        for compiled in tools.tools:
            m = xgr.GrammarMatcher(compiled)
            if m.accept_string(tools.trigger):
                self._live.append(m)

    def mask(self) -> Tensor:
        """The OR of the live matchers' bitmasks [words]."""
        xgr = self._g.xgr
        masks = xgr.allocate_token_bitmask(len(self._live), self._g.vocab_size)
        for i, m in enumerate(self._live):
            m.fill_next_token_bitmask(masks, i)
        out = masks[0]
        for row in masks[1:]:
            out.bitwise_or_(row)
        return out

    def accept(self, token: int) -> tuple[bool, bool]:
        """Feed ``token`` to the live matchers: whether a call is still under way, and whether
        one finished with it."""
        live = [m for m in self._live if m.accept_token(token)]
        self._live = [m for m in live if not m.is_completed()]
        return bool(self._live), len(live) > len(self._live)


class _Text:
    """The text before a call, for one tokenizer, trigger and reasoning block: how a token's
    bytes move a :data:`State`, and each state's mask (cached)."""

    def __init__(self, grammars: Grammars, trigger: str, reasoning: Reasoning | None) -> None:
        self._g = grammars
        self.trigger = trigger.encode()
        self.open = b"" if reasoning is None else reasoning.open.encode()
        self.end = b"" if reasoning is None else (reasoning.close + reasoning.gap).encode()
        self.eos = frozenset(grammars.tokenizer.eos_token_ids)
        self._masks: dict[State, Tensor] = {}
        self._lock = threading.Lock()

    def run(self, state: State, data: bytes) -> State | None:
        """The state after ``data`` from ``state``: :data:`CALL` if the trigger ends exactly
        with it, None if the text may not go that way (the trigger inside it, or a reading
        ``data`` breaks)."""
        kind, k = state
        if kind == "open":
            text = self.open[:k] + data
            if len(text) < len(self.open):
                return ("open", len(text)) if self.open.startswith(text) else None
            if not text.startswith(self.open):
                return None
            return self.run(("think", 0), text[len(self.open) :])
        if kind == "think":
            text = self.end[:k] + data
            i = text.find(self.end)
            if i < 0:
                return ("think", _overlap(text, self.end))
            return self.run(("free", 0), text[i + len(self.end) :])
        if kind == "free":
            text = self.trigger[:k] + data
            i = text.find(self.trigger)
            if i < 0:
                return ("free", _overlap(text, self.trigger))
            # The trigger must end with the token: the calls' matchers start at its end.
            return CALL if i + len(self.trigger) == len(text) else None
        return None  # "end": only end of sequence

    def mask(self, state: State) -> Tensor:
        """The bitmask [words] of the tokens allowed at ``state`` (computed once)."""
        with self._lock:
            mask = self._masks.get(state)
            if mask is None:
                mask = self._masks[state] = self._compute(state)
        return mask

    def _compute(self, state: State) -> Tensor:
        allowed = torch.zeros(self._g.vocab_size, dtype=torch.bool)
        if state != END:
            ok = [
                i
                for i, raw in enumerate(self._g.token_bytes)
                if raw and i not in self.eos and self.run(state, raw) is not None
            ]
            allowed[torch.tensor(ok, dtype=torch.long)] = True
        if state == END or state[0] == "free":
            allowed[[i for i in self.eos if i < allowed.shape[0]]] = True
        return _pack(allowed, self._g.xgr.get_bitmask_shape(1, self._g.vocab_size)[1])


def _overlap(text: bytes, marker: bytes) -> int:
    """The length of the longest end of ``text`` that starts ``marker`` (shorter than it)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _pack(allowed: Tensor, words: int) -> Tensor:
    """``allowed`` [vocab] bools as xgrammar's bitmask [words] (bit i of word i // 32). The
    bits past the vocabulary are set, as xgrammar's own masks have them: xgrammar 0.2.8's CPU
    apply writes past the logits row for a clear one (a heap corruption, seen with a
    518-token vocabulary)."""
    bits = torch.ones(words * 32, dtype=torch.int64)
    bits[: allowed.shape[0]] = allowed.to(torch.int64)
    packed = (bits.view(words, 32) << torch.arange(32)).sum(1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


# Each Grammars' (tokenizer's) text automata, by trigger and reasoning block.
_TEXTS: weakref.WeakKeyDictionary[Grammars, dict[Any, _Text]] = weakref.WeakKeyDictionary()
_TEXTS_LOCK = threading.Lock()


def _text(tools: ToolSet) -> _Text:
    key = (tools.trigger, tools.reasoning)
    with _TEXTS_LOCK:
        texts = _TEXTS.setdefault(tools.grammars, {})
        if key not in texts:
            texts[key] = _Text(tools.grammars, tools.trigger, tools.reasoning)
        return texts[key]
