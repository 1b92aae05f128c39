"""Splits a chat answer's text, as it streams, into reasoning, content and tool calls.

Design notes
------------
* One splitter per choice, fed the text the answer releases (after stop strings are cut), so a
  streamed answer and a whole one split the same way: ``collect`` feeds it everything, then
  ``final``; ``stream`` feeds it chunk by chunk. Text that may begin a tag is held back until
  the next piece (or the end) decides, as stop strings are.
* What the markers are is the target's chat formats' (kern.chat_formats): the reasoning
  parser's block and the tool parser's blocks of calls; the splitter finds them.
* Reasoning (a reasoning parser on, per target): its open marker at the very start of the
  answer, or one the prompt opened and did not close (templates that end the generation prompt
  with it), starts reasoning; its close marker ends it. An answer cut off while reasoning is
  all reasoning. Anything else is content.
* Tool calls (on when a request has tools and tool_choice is not "none"): a block from the
  format's ``calls_open`` to its ``calls_close`` is handed to the format's ``parse``. A block
  it does not take stays content, verbatim, as does one the model ended unclosed. One cut off
  by ``max_tokens`` is not content (clients took its markup for the answer): it is kept in
  ``Splitter.cut`` and the answer's finish reason, length, says it was cut. Whitespace
  between and after calls is dropped; any other text there stays content.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kern.chat_formats import ChatFormat, Reasoning, ToolCall

__all__ = ["Parts", "Splitter"]


@dataclass
class Parts:
    """What a piece of text released: reasoning text, content text and whole tool calls."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def _held(buf: str, tag: str) -> int:
    """How many characters at the end of ``buf`` may begin ``tag``."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if tag.startswith(buf[-k:]):
            return k
    return 0


class Splitter:
    def __init__(
        self,
        *,
        reasoning: Reasoning | None,
        tools: ChatFormat | None,
        prompt_opened: bool = False,
    ) -> None:
        """``reasoning``: the reasoning parser's block, None when off; ``tools``: the format
        the answer's tool calls are in, None when the request's tools are off."""
        self.reasoning = reasoning
        self.tools = tools
        # "start": may still begin with a reasoning block; "think"; "text"; "call": in a block
        # of calls.
        self.state = "think" if reasoning and prompt_opened else "start" if reasoning else "text"
        self.buf = ""
        self.calls = 0
        self.blank = ""  # whitespace after a tool call, kept until text follows it
        self.fresh = False  # nothing but whitespace since the last call
        self.cut = ""  # a block of calls max_tokens cut off (see the design notes)

    def feed(self, text: str, final: bool = False, cut: bool = False) -> Parts:
        """What ``text`` releases; ``final``: the answer's end, ``cut`` by its length."""
        out = Parts()
        self.buf += text
        while True:
            before = (self.state, len(self.buf))
            getattr(self, "_" + self.state)(out, final)
            if (self.state, len(self.buf)) == before:
                break
        if final and cut and self.state == "call":
            self.cut, self.buf = self.buf, ""
        if final:
            self._content(out, self.buf)
            self.buf = ""
            self.blank = ""
        return out

    def _start(self, out: Parts, final: bool) -> None:
        assert self.reasoning is not None
        opener = self.reasoning.open
        if self.buf.startswith(opener):
            self.buf = self.buf[len(opener) :]
            self.state = "think"
        elif final or not opener.startswith(self.buf):
            self.state = "text"

    def _think(self, out: Parts, final: bool) -> None:
        assert self.reasoning is not None
        close = self.reasoning.close
        at = self.buf.find(close)
        if at >= 0:
            out.reasoning += self.buf[:at]
            self.buf = self.buf[at + len(close) :]
            self.state = "text"
            return
        keep = 0 if final else _held(self.buf, close)
        out.reasoning += self.buf[: len(self.buf) - keep]
        self.buf = self.buf[len(self.buf) - keep :]

    def _text(self, out: Parts, final: bool) -> None:
        if self.tools is None:
            self._content(out, self.buf)
            self.buf = ""
            return
        at = self.buf.find(self.tools.calls_open)
        if at >= 0:
            self._content(out, self.buf[:at])
            self.blank = ""  # whitespace before a call goes with it
            self.buf = self.buf[at:]
            self.state = "call"
            return
        keep = 0 if final else _held(self.buf, self.tools.calls_open)
        self._content(out, self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep :]

    def _call(self, out: Parts, final: bool) -> None:
        assert self.tools is not None
        opener, close = self.tools.calls_open, self.tools.calls_close
        at = self.buf.find(close)
        if at < 0:
            return  # the end (final) leaves the unfinished block as content
        block = self.buf[: at + len(close)]
        self.buf = self.buf[at + len(close) :]
        self.state = "text"
        calls = self.tools.parse(block[len(opener) : -len(close)])
        if calls is None:
            self._content(out, block)
        else:
            out.calls += calls
            self.calls += len(calls)
            self.fresh = True

    def _content(self, out: Parts, text: str) -> None:
        if not text:
            return
        if self.calls:
            # After a call, leading whitespace is dropped and trailing whitespace held:
            # dropped before the next call or at the end.
            if self.fresh:
                text = text.lstrip()
                if not text:
                    return
                self.fresh = False
            text = self.blank + text
            stripped = text.rstrip()
            self.blank = text[len(stripped) :]
            text = stripped
        out.content += text
