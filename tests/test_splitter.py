"""kern.server.splitter: a chat answer split into reasoning, content and tool calls (in Qwen3's
chat format, kern.chat_formats.qwen3), the same streamed in any pieces as whole."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from kern.chat_formats.qwen3 import QWEN3
from kern.server.splitter import Splitter

CALL = '<tool_call>\n{"name": "get", "arguments": {"city": "Paris"}}\n</tool_call>'


def split(text: str, *, cuts=(), reasoning=False, tools=False, opened=False):
    think, calls = QWEN3.reasoning if reasoning else None, QWEN3 if tools else None
    s = Splitter(reasoning=think, tools=calls, prompt_opened=opened)
    reasoning_text, content, calls = "", "", []
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(text)), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    for i, piece in enumerate(pieces):
        parts = s.feed(piece, final=i == len(pieces) - 1)
        reasoning_text += parts.reasoning
        content += parts.content
        calls += [(c.name, json.loads(c.arguments)) for c in parts.calls]
    return reasoning_text, content, calls


def test_reasoning_block_then_content():
    assert split("<think>\nhmm\n</think>\n\nHi", reasoning=True) == ("\nhmm\n", "\n\nHi", [])
    # Not at the start: content, tags and all.
    assert split("Hi <think>x</think>", reasoning=True) == ("", "Hi <think>x</think>", [])
    # Parser off: all content.
    assert split("<think>x</think>y") == ("", "<think>x</think>y", [])
    # Cut off while reasoning: all reasoning.
    assert split("<think>abc </thi", reasoning=True) == ("abc </thi", "", [])


def test_a_prompt_that_opened_the_block():
    assert QWEN3.reasoning is not None
    opens = QWEN3.reasoning.opened_by
    assert opens("<|im_start|>assistant\n<think>\n")
    assert not opens("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not opens("no tags")
    assert split("why</think>\n\nok", reasoning=True, opened=True) == ("why", "\n\nok", [])


def test_tool_calls():
    text = "Let me look." + CALL + "\n" + CALL.replace("Paris", "Rome") + "\n"
    reasoning, content, calls = split(text, tools=True)
    assert content == "Let me look."
    assert calls == [("get", {"city": "Paris"}), ("get", {"city": "Rome"})]
    # Text after the calls stays content, whitespace around it does not.
    assert split(CALL + "\n done \n", tools=True)[1] == "done"
    # Tools off: the block is content.
    assert split(CALL)[1] == CALL


def test_broken_calls_stay_content():
    bad = "<tool_call>\n{not json}\n</tool_call>"
    assert split(bad, tools=True) == ("", bad, [])
    extra = '<tool_call>{"name": "f", "arguments": {}, "x": 1}</tool_call>'
    assert split(extra, tools=True) == ("", extra, [])
    not_object = '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'
    assert split(not_object, tools=True) == ("", not_object, [])
    cut = CALL[:30]
    assert split(cut, tools=True) == ("", cut, [])


def test_reasoning_then_calls():
    text = "<think>plan</think>\n\n" + CALL
    assert split(text, reasoning=True, tools=True) == (
        "plan",
        "\n\n",
        [("get", {"city": "Paris"})],
    )


TEXTS = [
    "<think>\nhmm </think>\n\nHi" + CALL + "\n" + CALL + " tail",
    "<thin" + CALL + "<tool_call>oops</tool_call></think>",
    "plain text with < and <tool and </think",
    "<think>never closed <tool_call>",
]


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(TEXTS),
    st.lists(st.integers(min_value=1, max_value=200), max_size=12),
    st.booleans(),
    st.booleans(),
    st.booleans(),
)
def test_any_pieces_split_as_the_whole(text, cuts, reasoning, tools, opened):
    whole = split(text, reasoning=reasoning, tools=tools, opened=opened)
    assert split(text, cuts=cuts, reasoning=reasoning, tools=tools, opened=opened) == whole
    # Nothing is lost but whitespace around calls and the tags themselves.
    r, c, calls = whole
    if not calls and not reasoning:
        assert c == text
