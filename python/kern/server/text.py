"""A choice's text: one sequence's tokens detokenized as they come, cut at stop strings, with
what may begin a stop string held back until it cannot (see kern.server's design notes). The
token that ends a sequence (a ``stop_token_ids`` id, or end of sequence) adds no text unless
``include_stop_str_in_output`` asks for it, as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field

from kern.chat_formats import ToolCall
from kern.server.splitter import Parts, Splitter
from kern.tokenizer import TextStream
from kern.tokenizer.token_bytes import ByteLedger

__all__ = ["Choice", "LogprobItem"]

# A produced token's logprob entry: (token id, its logprob, the top (id, logprob) pairs).
LogprobItem = tuple[int, float, list[tuple[int, float]]]


@dataclass
class Choice:
    """The text side of one sequence: detokenizer, stop strings and what was produced."""

    index: int
    stream: TextStream
    stops: list[str]
    # Characters held back while text may begin a stop string: the longest one's, less one.
    hold: int
    include_stop: bool = False
    # Ids that end the sequence (its stop ids, and end of sequence unless ignored): their
    # text is left out unless ``include_stop``.
    stop_tokens: frozenset[int] = frozenset()
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
    logprobs: list[LogprobItem] = field(default_factory=list)
    # Logprob entries already sent in a stream.
    sent_logprobs: int = 0
    # A completions stream: the text offset of the next logprob entry it sends (counted as
    # entries go out: the end's flush may lengthen a piece already sent).
    sent_offset: int = 0
    # Chat answers with a reasoning parser or tools: splits the text (kern.server.splitter).
    split: Splitter | None = None
    reasoning: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    # With logprobs: the bytes each token adds to the text (kern.tokenizer.token_bytes).
    ledger: ByteLedger | None = None

    def parts(self, text: str, final: bool) -> Parts:
        """``text`` split; kept for the whole answer."""
        assert self.split is not None
        parts = self.split.feed(text, final, cut=final and self.finish == "length")
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
        text, stopped = self._feed(token)
        if self.ledger is not None:
            self.ledger.released(len(text))
        return text, stopped

    def _feed(self, token: int) -> tuple[str, bool]:
        self.ids.append(token)
        if token in self.stop_tokens and not self.include_stop:
            # It ends the sequence: nothing of it, and no stop string can begin in it.
            self.pieces.append("")
            if self.ledger is not None:
                self.ledger.add(token, "", left_out=True)
            return "", False
        piece = self.stream.step(token)
        self.pieces.append(piece)
        if self.ledger is not None:
            self.ledger.add(token, piece)
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
        out = (buf, False) if cut is None else (cut, True)
        if self.ledger is not None:
            self.ledger.flush(rest)
            self.ledger.released(len(out[0]))
        return out

    def _stop_at(self, buf: str) -> str | None:
        """``buf`` up to the first stop string in it (through it with include_stop), or
        None; records the string as the stop reason."""
        found = [(i, -len(s), s) for s in self.stops if (i := buf.find(s)) >= 0]
        if not found:
            return None
        i, _, stop = min(found)
        self.stop_reason = stop
        return buf[: i + len(stop)] if self.include_stop else buf[:i]
