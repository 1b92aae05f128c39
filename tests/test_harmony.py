"""gpt-oss's harmony format against ``openai-harmony``, the reference renderer and parser: kern's
o200k_harmony tokenizer (from the o200k_base.tiktoken file, no remote code) gives its ids;
kern's prompts of chat conversations with tools and reasoning are its prompts, id for id; and
kern's reading of answers, fed in pieces, gives the messages it parses."""

from __future__ import annotations

import random
import shutil

import openai_harmony as h
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import harmony_ref

from kern.chat_formats.harmony import HARMONY, HarmonyParser, parse_header
from kern.chat_formats.harmony_prompt import render
from kern.tokenizer import Tokenizer

WEATHER = {
    "name": "get_weather",
    "description": "Gets the location's weather\nin the units asked for",
    "parameters": {
        "type": "object",
        "properties": {
            "location": {
                "type": "string",
                "description": "The city",
                "title": "Location",
                "examples": ["Paris", "Tokyo"],
            },
            "format": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
            "days": {"type": "array", "items": {"type": "integer"}},
            "opts": {
                "type": "object",
                "description": "Options",
                "properties": {
                    "a": {"type": "boolean", "default": True},
                    "deep": {
                        "type": "object",
                        "properties": {"z": {"type": "number", "nullable": True}},
                    },
                },
                "required": ["a"],
            },
            "n": {"type": ["number", "null"]},
            "u": {
                "description": "either",
                "oneOf": [
                    {"type": "string", "description": "as text"},
                    {"type": "integer", "default": 3},
                ],
            },
            "v": {
                "description": "same",
                "default": "x",
                "oneOf": [
                    {"type": "string", "description": "same"},
                    {"type": "array", "items": {"type": "string"}, "nullable": True},
                ],
            },
            "anything": {},
            "list": {"type": "array"},
            "ünïcode": {"type": "string", "default": "日本"},
        },
        "required": ["location", "u"],
    },
}
TOOLS = [
    WEATHER,
    {"name": "no_args", "description": "Takes nothing"},
    {"name": "empty", "parameters": {"type": "object", "properties": {}}},
    {
        "name": "top_one_of",
        "description": "d",
        "parameters": {
            "oneOf": [
                {"type": "object", "properties": {"x": {"type": "string"}}},
                {"type": "string", "enum": ["a", "b"], "default": "a"},
            ]
        },
    },
]
CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"location":"Tokyo","u":"x"}'},
}
CONVERSATIONS = {
    "one user turn": ([{"role": "user", "content": "Hi"}], None, "medium", None),
    "instructions, a past answer with its reasoning (dropped), a date": (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
            {"role": "user", "content": "Again <|end|> spelled"},
        ],
        None,
        "low",
        "2025-06-28",
    ),
    "tools, a call with a preamble and its result": (
        [
            {"role": "system", "content": "sys"},
            {"role": "user", "content": "Weather in Tokyo?"},
            {
                "role": "assistant",
                "reasoning_content": "call it",
                "content": "Let me check.",
                "tool_calls": [CALL],
            },  # fmt: skip
            {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 20}'},
        ],
        TOOLS,
        "high",
        None,
    ),
    "two finished turns: the first turn's reasoning dropped": (
        [
            {"role": "user", "content": "a"},
            {"role": "assistant", "reasoning_content": "r1", "content": "f1"},
            {"role": "user", "content": "b"},
            {"role": "assistant", "reasoning_content": "r2", "content": "f2"},
            {"role": "user", "content": "c"},
        ],
        TOOLS[:2],
        "medium",
        None,
    ),
}


@pytest.fixture(scope="module")
def encoding():
    return harmony_ref.encoding()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("o200k")
    shutil.copy(harmony_ref.o200k_file(), folder / "o200k_base.tiktoken")
    return Tokenizer.from_dir(folder)


def test_the_tiktoken_file_gives_openai_harmonys_ids(tokenizer, encoding):
    texts = [
        "Hello world",
        "  leading spaces\n\n\ttabs and CamelCaseWORDS's",
        "数学は楽しい。I'm here, you'll see – naïve café 123456 x/y//z\r\n",
        "<|start|>user<|message|>hi<|end|><|start|>assistant<|channel|>final<|message|>",
        "emoji 🎉🎉 and ЖЖЖ " + "a" * 2000,
    ]
    for text in texts:
        assert tokenizer.encode(text) == encoding.encode(text, allowed_special="all"), text
    assert tokenizer.eos_token_ids == (200002, 200012)  # <|return|>, <|call|>
    assert tokenizer.vocab_size == 201088


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_prompts_are_openai_harmonys(name, tokenizer, encoding):
    messages, tools, effort, date = CONVERSATIONS[name]
    text, contents = render(messages, tools, reasoning_effort=effort, date=date)
    conv = harmony_ref.conversation(messages, tools, effort, date)
    want = encoding.render_conversation_for_completion(conv, h.Role.ASSISTANT)
    if "<|end|> spelled" not in text:
        assert tokenizer.encode(text) == want
    # The client's texts stay plain: a user's "<|end|>" is text, not a marker.
    ids = tokenizer.encode_chat(text, contents)
    plain = [t for m in messages if m["role"] == "user" for t in [m["content"]]]
    assert all(p in text for p in plain)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    if "<|end|> spelled" in text:
        assert ids.count(200007) == tokenizer.encode(text).count(200007) - 1
    else:
        assert ids == want


ANSWERS = {
    "reasoning then an answer": "<|channel|>analysis<|message|>Let me think: 2+2.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>It is **4**.<|return|>",
    "a call after reasoning": "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"location": "Tokyo", "days": [1, 2]}<|call|>',
    "the recipient before the channel, a preamble first": "<|channel|>commentary<|message|>"
    "Checking now.<|end|><|start|>assistant to=functions.no_args<|channel|>commentary json"
    "<|message|>{}<|call|>",
    "an answer with no reasoning": "<|channel|>final<|message|>Just this. 日本語 ✓<|return|>",
}


def _reference_messages(encoding, text: str) -> list[tuple]:
    ids = encoding.encode(text, allowed_special="all")
    out = []
    for m in encoding.parse_messages_from_completion_tokens(ids, h.Role.ASSISTANT):
        d = m.to_dict()
        body = "".join(c["text"] for c in d["content"])
        out.append((d.get("channel"), d.get("recipient"), d.get("content_type"), body))
    return out


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_answers_parse_as_openai_harmony_parses_them_in_any_pieces(name, encoding):
    text = ANSWERS[name]
    want = _reference_messages(encoding, text)
    # The server's text stops before an end id (<|return|>, <|call|>); the rest is fed in
    # random pieces, as a stream releases it.
    body = text.removesuffix("<|return|>").removesuffix("<|call|>")
    rng = random.Random(name)
    for _ in range(20):
        parser = HarmonyParser()
        pos, released = 0, []
        while pos < len(body):
            n = rng.randint(1, 12)
            released.append(parser.feed(body[pos : pos + n]))
            pos += n
        released.append(parser.feed("", final=True))
        got = [(hd.channel, hd.recipient, hd.content_type, t) for hd, t in parser.parsed if hd]
        assert got == want
        reasoning = "".join(r.reasoning for r in released)
        content = "".join(r.content for r in released)
        calls = [c for r in released for c in r.calls]
        assert reasoning == "".join(b for c, _, _, b in want if c == "analysis")
        to_functions = [(r, b) for _, r, _, b in want if r and r.startswith("functions.")]
        assert [(f"functions.{c.name}", c.arguments) for c in calls] == [
            (r, HARMONY_JSON(b)) for r, b in to_functions
        ]
        assert content == "".join(
            b for c, r, _, b in want if r is None and c in ("final", "commentary")
        )


def HARMONY_JSON(body: str) -> str:  # noqa: N802 - kern's canonical arguments text
    import json

    return json.dumps(json.loads(body), ensure_ascii=False)


def test_headers_read_as_openai_harmony_reads_them():
    assert parse_header("<|channel|>commentary to=functions.f <|constrain|>json") == (
        parse_header(" to=functions.f<|channel|>commentary <|constrain|>json")
    )
    header = parse_header("<|channel|>commentary to=functions.f<|constrain|>json")
    assert (header.channel, header.recipient, header.content_type) == (
        "commentary", "functions.f", "<|constrain|>json")  # fmt: skip
    assert parse_header("<|channel|>") is None
    assert parse_header("<|channel|>final extra words here") is None


def test_a_call_the_model_never_declared_stays_content():
    parser = HarmonyParser()
    text = '<|channel|>commentary to=browser.search<|message|>{"q": 1}<|call|>'
    out = parser.feed(text, final=True)
    assert out.calls == [] and out.content == text
    bad = HarmonyParser().feed(
        "<|channel|>commentary to=functions.f <|constrain|>json<|message|>[1, 2]", final=True
    )
    assert bad.calls == [] and "[1, 2]" in bad.content


def test_a_call_cut_by_max_tokens_is_not_content():
    parser = HarmonyParser()
    out = parser.feed('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a"',
                      final=True, cut=True)  # fmt: skip
    assert out.content == "" and out.calls == [] and parser.cut == '{"a"'


def test_the_format_is_registered_with_its_grammar():
    from kern.chat_formats import FORMATS

    assert FORMATS["harmony"] is HARMONY and HARMONY.messages and HARMONY.keep_special
    grammar = HARMONY.grammar([WEATHER], "get_weather", False)
    begins = [tag["begin"] for tag in grammar["elements"][1]["elements"]]
    assert "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" in begins
    # Every form the grammar lets through parses as a call.
    for begin in begins:
        out = HarmonyParser().feed(begin + '{"location": "x"}', final=True)
        assert [c.name for c in out.calls] == ["get_weather"], begin


PIECES = [
    "<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|call|>", "<|return|>",
    "<|constrain|>", "analysis", "final", "commentary", " to=functions.f", " to=", "assistant",
    "json", '{"a": 1}', "{", "}", " ", "text ", "<|", "|>", "日本",
]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=30), st.lists(st.integers(1, 9), max_size=40))
def test_any_answer_reads_without_error_and_keeps_every_character(pieces, cuts):
    """Whatever a model writes, the parser never raises, and what it releases (reasoning,
    content, calls' bodies and the markup between) never holds more than the answer did;
    fed in any pieces, it releases the same as fed whole."""
    text = "".join(pieces)
    whole = HarmonyParser().feed(text, final=True)
    parser, pos, parts = HarmonyParser(), 0, []
    for n in cuts:
        parts.append(parser.feed(text[pos : pos + n]))
        pos += n
    parts.append(parser.feed(text[pos:], final=True))
    assert "".join(p.reasoning for p in parts) == whole.reasoning
    assert "".join(p.content for p in parts) == whole.content
    assert [c for p in parts for c in p.calls] == whole.calls
    assert len(whole.reasoning) + len(whole.content) <= len(text)
