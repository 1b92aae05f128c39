"""gpt-oss's harmony format: the answer is a run of messages, each a header (its channel, its
recipient, its content type) and a body, ``<|channel|>analysis<|message|>...<|end|>
<|start|>assistant<|channel|>final<|message|>...<|return|>``; reasoning is the ``analysis``
channel, the answer proper ``final``, and a tool call a ``commentary`` message to
``functions.NAME`` whose body is its arguments, ended by ``<|call|>``. The prompt side is
:mod:`kern.chat_formats.harmony_prompt`.

Design notes
------------
* :class:`HarmonyParser` reads the answer's text as it streams (special tokens kept: every
  marker is one) and says what each piece is: reasoning (``analysis``), content (``final``,
  a ``commentary`` message to no one, a message with no channel), or a whole call. A header is
  read as openai-harmony reads one: the channel is the word after ``<|channel|>``; of the
  words left, ``to=X`` is the recipient and a word starting with ``<|constrain|>`` (or any
  last word after a recipient) the content type; the role word (``assistant``) is dropped.
* A call is taken when its recipient is ``functions.NAME`` and its body is a JSON object; any
  other message to a recipient (a built-in tool kern does not declare), or one whose body is
  not an object, stays content, verbatim, as the other formats keep a block they cannot
  parse. Calls get ids ``call_<n>`` (harmony writes none).
* ``<|return|>`` and ``<|call|>`` end a generation (they are end-of-sequence ids), so the text
  usually stops before them; ``<|end|>`` ends a message and the next one opens with
  ``<|start|>``. Text before a marker that may still be one is held back until the next
  piece decides, as stop strings are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kern.chat_formats.base import ChatFormat, Reasoning, ToolCall, arguments_format, json_object
from kern.chat_formats.harmony_prompt import (
    CALL,
    CHANNEL,
    CONSTRAIN,
    END,
    MESSAGE,
    RETURN,
    START,
    render,
)

__all__ = ["HARMONY", "Harmony", "HarmonyParser", "Header", "Released"]

_ENDS = (END, RETURN, CALL)


@dataclass(frozen=True)
class Header:
    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None


def parse_header(text: str) -> Header | None:
    """A message header's fields (the text between ``<|start|>`` and ``<|message|>``); None
    when it is not a header openai-harmony would read."""
    channel = None
    at = text.find(CHANNEL)
    if at >= 0:
        rest = text[at + len(CHANNEL) :]
        end = next((i for i, c in enumerate(rest) if c.isspace() or c == "<"), len(rest))
        if end == 0:
            return None
        channel = rest[:end]
        text = text[:at] + rest[end:]
    text = text.strip().replace(CONSTRAIN, " " + CONSTRAIN).strip()
    parts = text.split()
    if parts and parts[0] == "assistant":
        parts = parts[1:]
    recipient = content_type = None
    if parts:
        last = parts.pop()
        if last.startswith("to="):
            recipient = last[3:]
        elif not parts and not last.startswith(CONSTRAIN):
            recipient = last
        else:
            content_type = last
            if parts:
                raw = parts.pop()
                recipient = raw[3:] if raw.startswith("to=") else raw
    if parts:
        return None
    return Header(channel, recipient, content_type)


@dataclass
class Released:
    """What a piece of answer text released."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def _held(buf: str) -> int:
    """How many characters at the end of ``buf`` may begin a marker."""
    for k in range(min(len(buf), 9), 0, -1):
        tail = buf[-k:]
        if any(m.startswith(tail) for m in (*_ENDS, START, MESSAGE)):
            return k
    return 0


REASONING = Reasoning(open=f"{CHANNEL}analysis{MESSAGE}", close=END, gap="")


class HarmonyParser:
    """Reads an answer's text, piece by piece (see the module notes). Its ``reasoning`` and
    ``state`` answer what a server asks of any splitter: the reasoning's close marker, and
    whether the answer may still be reasoning ("start", "think") or not ("text")."""

    reasoning = REASONING

    def __init__(self, *, calls: bool = True) -> None:
        """``calls``: take messages to ``functions.NAME`` as calls (off: tool_choice none, or
        no tools; they stay content, verbatim)."""
        self.take_calls = calls
        # "header" (after <|start|>, or at the answer's start), "body", "between" (after a
        # message's end, before the next <|start|>).
        self.at = "header"
        self.messages = 0  # bodies opened
        self.buf = ""
        self.header: Header | None = None
        self.header_text = ""
        self.calls = 0
        self.cut = ""  # a call max_tokens cut off
        # The open message's body so far, in pieces (joined once, when it closes).
        self.pieces: list[str] = []
        # Every message read whole: its header (None: unreadable) and body.
        self.parsed: list[tuple[Header | None, str]] = []
        self.thinking = False  # in an analysis message's body

    def feed(self, text: str, final: bool = False, cut: bool = False) -> Released:
        out = Released()
        self.buf += text
        while True:
            before = (self.at, len(self.buf))
            getattr(self, "_" + self.at)(out, final)
            if (self.at, len(self.buf)) == before:
                break
        if final:
            self._finish(out, cut)
        return out

    def _header(self, out: Released, final: bool) -> None:
        at = self.buf.find(MESSAGE)
        if at < 0:
            return
        self.header_text = self.buf[:at]
        self.header = parse_header(self.header_text)
        self.buf = self.buf[at + len(MESSAGE) :]
        self.pieces = []
        self.at = "body"
        self.messages += 1
        self.thinking = self.header is not None and self.header.channel == "analysis"

    def _body(self, out: Released, final: bool) -> None:
        ends = [(self.buf.find(m), m) for m in _ENDS]
        at, marker = min(((i, m) for i, m in ends if i >= 0), default=(-1, ""))
        if at >= 0:
            self._text(out, self.buf[:at])
            self._close(out, marker)
            self.buf = self.buf[at + len(marker) :]
            self.at = "between"
            self.thinking = False
            return
        keep = 0 if final else _held(self.buf)
        self._text(out, self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep :]

    def _between(self, out: Released, final: bool) -> None:
        at = self.buf.find(START)
        # Text outside any message is the answer's, as it stands.
        if at >= 0:
            out.content += self.buf[:at]
            self.buf = self.buf[at + len(START) :]
            self.at = "header"
            return
        keep = 0 if final else _held(self.buf)
        out.content += self.buf[: len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep :]

    def _recipient(self) -> str | None:
        return None if self.header is None else self.header.recipient

    def _text(self, out: Released, text: str) -> None:
        if not text:
            return
        self.pieces.append(text)
        if self.header is None:  # an unreadable header: the whole message is content
            out.content += text
        elif self._recipient() is not None:
            pass  # a call: released whole or not at all, when it closes
        elif self.thinking:
            out.reasoning += text
        else:
            out.content += text

    def _close(self, out: Released, marker: str) -> None:
        body = "".join(self.pieces)
        self.pieces = []
        self.parsed.append((self.header, body))
        recipient = self._recipient()
        if recipient is None:
            return
        name = recipient[len("functions.") :] if recipient.startswith("functions.") else ""
        args = json_object(body) if name and self.take_calls else None
        if args is None:  # not a call kern declared: its message, verbatim
            out.content += f"{self.header_text}{MESSAGE}{body}{marker}"
        else:
            out.calls.append(ToolCall(f"call_{self.calls}", name, args))
            self.calls += 1

    @property
    def state(self) -> str:
        if self.thinking:
            return "think"
        return "start" if self.at == "header" and not self.messages else "text"

    def _finish(self, out: Released, cut: bool) -> None:
        if self.at == "body":
            if self._recipient() is not None and cut:
                self.cut = "".join(self.pieces)
            elif self._recipient() is not None or self.pieces:
                # the end id (<|call|>, <|return|>) that closed it is not in the text
                self._close(out, "")
            self.at = "between"
            self.thinking = False
        elif self.at == "header" and self.buf:
            out.content += self.buf  # an answer that never opened a message body
        self.buf = ""


class Harmony(ChatFormat):
    """The harmony format's tool calls for ``tool_parser = "harmony"`` (gpt-oss); its answers
    are read by :class:`HarmonyParser`, its prompts rendered by ``harmony_prompt``."""

    name = "harmony"
    calls_open = f"{CHANNEL}commentary to=functions."
    calls_close = CALL
    summary = "harmony commentary messages to functions.NAME"
    keep_special = True
    reasoning = REASONING
    answer_parser = HarmonyParser
    # The whole answer is messages: kern.server reads it with HarmonyParser, and renders the
    # prompt with harmony_prompt.render instead of the checkpoint's template.
    messages = True

    def render(self, messages: list[dict[str, Any]], **kwargs: Any) -> tuple[str, list[str]]:
        """The prompt of ``messages`` and the client's texts in it (``harmony_prompt.render``)."""
        return render(messages, **kwargs)

    def parse(self, text: str) -> list[ToolCall] | None:
        """One call's text between ``calls_open`` and ``calls_close`` (``NAME
        <|constrain|>json<|message|>ARGS``), read as :class:`HarmonyParser` reads it."""
        return HarmonyParser().feed(self.calls_open + text, final=True).calls or None

    def grammar(self, tools: list[dict[str, Any]], choice: str, parallel: bool) -> dict[str, Any]:
        """An answer that may reason first (an ``analysis`` message), then: for a named tool
        or ``required``, one call (``<|call|>`` ends the generation, so one call a turn); for
        ``auto``, a ``final`` answer or one call."""
        calls = [self._call(t) for t in tools]
        call: dict[str, Any] = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
        if choice == "auto":
            final = {"type": "sequence", "elements": [
                {"type": "const_string", "value": f"{CHANNEL}final{MESSAGE}"},
                {"type": "any_text"},
            ]}  # fmt: skip
            call = {"type": "or", "elements": [call, final]}
        think = {
            "type": "optional",
            "content": {
                "type": "tag",
                "begin": f"{CHANNEL}analysis{MESSAGE}",
                "content": {"type": "any_text"},
                "end": f"{END}{START}assistant",
            },
        }
        return {"type": "sequence", "elements": [think, call]}

    def _call(self, tool: dict[str, Any]) -> dict[str, Any]:
        """A call of ``tool`` in any header form gpt-oss writes one in: the recipient after
        the channel (OpenAI's examples, with or without a space before ``<|constrain|>``) or
        before it (as openai-harmony renders a call), ``<|constrain|>json`` or ``json``."""
        to = f"to=functions.{tool['name']}"
        begins = [
            f"{CHANNEL}commentary {to} {CONSTRAIN}json{MESSAGE}",
            f"{CHANNEL}commentary {to}{CONSTRAIN}json{MESSAGE}",
            f" {to}{CHANNEL}commentary {CONSTRAIN}json{MESSAGE}",
            f" {to}{CHANNEL}commentary json{MESSAGE}",
        ]
        content = arguments_format(tool)
        tags = [{"type": "tag", "begin": b, "content": content, "end": CALL} for b in begins]
        return {"type": "or", "elements": tags}


HARMONY = Harmony()
