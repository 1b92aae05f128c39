"""gpt-oss served in harmony, over real HTTP with the official ``openai`` client: ``kern serve
--model DIR`` on a gpt_oss folder picks the harmony format with no flag; the reasoning comes
back as ``reasoning_content`` and the answer as content, whole and streamed alike; a call on
the ``commentary`` channel comes back as ``tool_calls`` and round-trips; what a harmony prompt
does not take is refused by name. The models are scripted (tests/support/scripted_harmony.py),
so each answer is known."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from support.scripted_harmony import make_scripted_harmony
from support.server import KEY, MODEL, Server

from kern.chat_formats.harmony_prompt import render
from kern.tokenizer import Tokenizer

THINK, ANSWER = "Let me think: 2 + 2.", "It is 4."
ARGS = '{"city": "Paris"}'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def answering(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("harmony-answer")
    pieces = [
        "<|channel|>analysis<|message|>",
        THINK,
        "<|end|><|start|>assistant<|channel|>final<|message|>",
        ANSWER,
    ]
    model = make_scripted_harmony(tmp / "model", pieces, "<|return|>")
    server = Server(tmp, "answer", pool_bytes="16MiB", model=model)
    yield server, model
    _close(server)


@pytest.fixture(scope="module")
def calling(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("harmony-call")
    pieces = [
        "<|channel|>analysis<|message|>",
        "Need the weather.",
        "<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather ",
        "<|constrain|>json<|message|>",
        ARGS,
    ]
    model = make_scripted_harmony(tmp / "model", pieces, "<|call|>")
    server = Server(tmp, "call", pool_bytes="16MiB", model=model)
    yield server, model
    _close(server)


def _client(server: Server) -> openai.OpenAI:
    """The server's one openai client (closed with the server: no socket left open)."""
    client = getattr(server, "openai_client", None)
    if client is None:
        client = server.openai_client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    return client


def _close(server: Server) -> None:
    client = getattr(server, "openai_client", None)
    if client is not None:
        client.close()
    server.close()


def test_reasoning_and_answer_whole_and_streamed(answering):
    server, _ = answering
    client = _client(server)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=32)
    msg = r.choices[0].message
    assert (msg.content, msg.model_extra["reasoning_content"]) == (ANSWER, THINK)
    assert r.choices[0].finish_reason == "stop" and not msg.tool_calls
    content, reasoning = [], []
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=32, stream=True
    )
    for chunk in stream:
        delta = chunk.choices[0].delta
        content.append(delta.content or "")
        reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
    assert ("".join(content), "".join(reasoning)) == (ANSWER, THINK)


def test_a_call_comes_back_as_tool_calls_and_round_trips(calling):
    server, model = calling
    client = _client(server)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=32)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Paris"
    }
    assert choice.message.model_extra["reasoning_content"] == "Need the weather."
    assert not choice.message.content
    turn = [
        *messages,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    again = client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, max_tokens=32)
    assert again.choices[0].message.tool_calls[0].function.name == "get_weather"
    # The prompt the server rendered is harmony's, id for id.
    with httpx.Client() as http:
        ids = http.post(
            server.url + "/tokenize",
            json={"messages": turn, "tools": TOOLS},
            headers={"authorization": f"Bearer {KEY}"},
        ).json()["tokens"]
    tok = Tokenizer.from_dir(model)
    turn[1]["reasoning_content"] = "Need the weather."
    text, contents = render(turn, [t["function"] for t in TOOLS])
    assert ids == tok.encode_chat(text, contents)
    assert "<|start|>functions.get_weather to=assistant<|channel|>commentary" in text


def test_streamed_call(calling):
    server, _ = calling
    stream = _client(server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        max_tokens=32,
        stream=True,
    )
    calls, finish = [], None
    for chunk in stream:
        choice = chunk.choices[0]
        calls += choice.delta.tool_calls or []
        finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert [c.function.name for c in calls if c.function.name] == ["get_weather"]
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"city": "Paris"}


def test_without_tools_a_call_stays_text(calling):
    server, _ = calling
    r = _client(server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        tool_choice="none",
        max_tokens=32,
    )
    msg = r.choices[0].message
    assert not msg.tool_calls and ARGS in msg.content and "functions.get_weather" in msg.content


def test_reasoning_effort_is_taken_and_what_harmony_does_not_take_is_refused(answering):
    server, _ = answering
    client = _client(server)
    messages = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=32, reasoning_effort="low"
    )
    assert r.choices[0].message.content == ANSWER
    refusals = [
        (dict(reasoning_effort="minimal"), "reasoning_effort"),
        (dict(extra_body={"chat_template_kwargs": {"enable_thinking": False}}), "enable_thinking"),
    ]
    for kwargs, name in refusals:
        with pytest.raises(openai.BadRequestError, match=name):
            client.chat.completions.create(model=MODEL, messages=messages, **kwargs)
    with pytest.raises(openai.BadRequestError, match="reasoning_effort applies to chat"):
        client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=4, extra_body={"reasoning_effort": "low"}
        )


def test_responses_api_reasoning_items_and_function_calls(answering, calling):
    server, _ = answering
    r = _client(server).responses.create(model=MODEL, input="What is 2 + 2?", max_output_tokens=32)
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "message"], kinds
    assert r.output[0].content[0].text == THINK and r.output_text == ANSWER
    server, _ = calling
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    r = _client(server).responses.create(
        model=MODEL, input="Weather?", tools=tools, max_output_tokens=32
    )
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}


def test_messages_api_thinking_and_tool_use(answering, calling):
    import anthropic

    server, _ = answering
    with anthropic.Anthropic(base_url=server.url, api_key=KEY) as client:
        r = client.messages.create(
            model=MODEL, max_tokens=32, messages=[{"role": "user", "content": "2 + 2?"}]
        )
    blocks = [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in r.content]
    assert blocks == [("thinking", THINK), ("text", ANSWER)]
    server, _ = calling
    tool = {"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}
    with anthropic.Anthropic(base_url=server.url, api_key=KEY) as client:
        r = client.messages.create(
            model=MODEL,
            max_tokens=32,
            tools=[tool],
            messages=[{"role": "user", "content": "Weather?"}],
        )
    (use,) = [b for b in r.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    assert r.stop_reason == "tool_use"


def test_the_other_apis_take_an_effort_for_the_system_message(answering):
    import anthropic

    server, model = answering
    r = _client(server).responses.create(
        model=MODEL, input="Hi", reasoning={"effort": "high"}, max_output_tokens=32
    )
    assert r.output_text == ANSWER
    with anthropic.Anthropic(base_url=server.url, api_key=KEY) as client:
        r = client.messages.create(
            model=MODEL,
            max_tokens=32,
            messages=[{"role": "user", "content": "Hi"}],
            extra_body={"output_config": {"effort": "low"}},
        )
    assert r.content[-1].text == ANSWER
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        _client(server).responses.create(
            model=MODEL, input="Hi", reasoning={"effort": "minimal"}, max_output_tokens=8
        )


def test_tool_choice_grammars_hold_the_harmony_answers(answering, calling):
    """required and a named tool: an optional analysis message, then the call; auto: then a
    call or a final message. Each compiles, and lets through the answers the models write."""
    server, _ = calling
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}, "auto"):
        r = _client(server).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather?"}],
            tools=TOOLS,
            tool_choice=choice,
            max_tokens=32,
        )
        assert r.choices[0].finish_reason == "tool_calls", choice
        assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {
            "city": "Paris"
        }
    server, _ = answering
    r = _client(server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "2 + 2?"}],
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=32,
    )
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (ANSWER, "stop")
    with pytest.raises(openai.BadRequestError, match="response_format"):
        _client(server).chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "2 + 2?"}],
            response_format={"type": "json_object"},
        )


def test_the_other_apis_stream_reasoning_and_calls(answering, calling):
    import anthropic

    server, _ = answering
    events = list(
        _client(server).responses.create(
            model=MODEL, input="2 + 2?", max_output_tokens=32, stream=True
        )
    )
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, text) == (THINK, ANSWER)
    with anthropic.Anthropic(base_url=server.url, api_key=KEY) as client:
        with client.messages.stream(
            model=MODEL, max_tokens=32, messages=[{"role": "user", "content": "2 + 2?"}]
        ) as stream:
            final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[1].text == ANSWER
    server, _ = calling
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    events = list(
        _client(server).responses.create(
            model=MODEL, input="Weather?", tools=tools, max_output_tokens=32, stream=True
        )
    )
    done = [e.item for e in events if e.type == "response.output_item.done"]
    (call,) = [item for item in done if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
