"""The agent protocols against a real `kern serve`, driven by the official SDKs: Anthropic's
Messages API (``anthropic``: ``messages.create``, ``messages.stream``, tool use, thinking,
``count_tokens``) and OpenAI's Responses API (``openai``: ``responses.create``,
``responses.stream``, function calls, json_schema, stored responses). The main server decodes
at rows 5 (n-gram speculative rows, several tokens per step); every streamed answer equals
the whole one, and greedy answers equal kern run's on the same prompt ids. It runs with the
reasoning parser on, so tool calls are split beside reasoning as agents see them."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from support.schemas import WEATHER as CITY
from support.server import KEY, MODEL, Server, thinking_server

from kern.checkpoint.load import load_checkpoint
from kern.engine.generate import generate
from kern.tiny import default_model_path

ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(
        tmp_path_factory.mktemp("agents"),
        "agents",
        pool_bytes="16MiB",
        model=default_model_path(),
        # Both parsers at once (reasoning and tools): a tool call must still never stream
        # as text.
        extra=("--rows", "5", "--reasoning-parser", "qwen3"),
    )
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    srv = thinking_server(tmp_path_factory.mktemp("agents-thinking"))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def ckpt():
    return load_checkpoint(default_model_path())


_CLIENTS: list = []


def claude(srv: Server) -> anthropic.Anthropic:
    _CLIENTS.append(anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0))
    return _CLIENTS[-1]


def oai(srv: Server) -> openai.OpenAI:
    _CLIENTS.append(openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0))
    return _CLIENTS[-1]


@pytest.fixture(autouse=True)
def _close_clients():
    yield
    while _CLIENTS:
        _CLIENTS.pop().close()


def prompt_ids(srv: Server, messages, **kw) -> list[int]:
    r = srv.http.post("/tokenize", json={"model": MODEL, "messages": messages, **kw})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def kern_run(ckpt, srv: Server, messages, steps: int) -> tuple[list[int], str]:
    """kern run's greedy ids for the chat prompt of ``messages`` (cut at end-of-sequence, as
    the server stops) and their text."""
    ids = generate(ckpt, prompt_ids(srv, messages), steps, page_tokens=16, threads=2).ids
    eos = set(ckpt.tokenizer.eos_token_ids)
    for n, t in enumerate(ids):
        if t in eos:
            ids = ids[: n + 1]
            break
    return ids, ckpt.tokenizer.decode(ids, skip_special_tokens=True)


def sse(srv: Server, path: str, body: dict) -> list[tuple[str, dict]]:
    """A stream's (event, data) pairs, read raw."""
    events = []
    with srv.http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name, (name, data)
                events.append((name, data))
    return events


# --- Anthropic Messages ---------------------------------------------------------------------


def test_messages_greedy_is_kern_run_whole_and_streamed(server, ckpt):
    client = claude(server)
    messages = [{"role": "user", "content": "Once upon a time"}]
    ids, text = kern_run(ckpt, server, messages, 24)
    msg = client.messages.create(model=MODEL, max_tokens=24, messages=messages, extra_body=GREEDY)
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == text
    assert msg.usage.output_tokens == len(ids)
    assert msg.stop_reason == ("max_tokens" if len(ids) == 24 else "end_turn")
    assert msg.role == "assistant" and msg.model == MODEL and msg.id.startswith("msg_")
    prompt = len(prompt_ids(server, messages))
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == prompt
    with client.messages.stream(
        model=MODEL, max_tokens=24, messages=messages, extra_body=GREEDY
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.content[0].text == text
    assert final.stop_reason == msg.stop_reason
    # The same prompt again is a prefix hit, reported as a cache read.
    assert final.usage.cache_read_input_tokens > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt
    server.assert_no_leak()


def test_messages_event_sequence(server):
    body = {"model": MODEL, "max_tokens": 8, "stream": True, "messages": ASK, **GREEDY}
    events = sse(server, "/v1/messages?beta=true", body)
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names[1] == "content_block_start" and names[-3] == "content_block_stop"
    assert set(names[2:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "max_tokens" and delta["usage"]["output_tokens"] == 8


def test_messages_system_and_turns_render_as_chat(server):
    client = claude(server)
    turns = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
    ]
    got = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=turns)
    chat = [{"role": "system", "content": "Be brief."}, *turns[:1]]
    chat += [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Weather?"}]
    assert got.input_tokens == len(prompt_ids(server, chat))
    msg = client.messages.create(
        model=MODEL, max_tokens=4, system=[{"type": "text", "text": "Be brief."}], messages=turns
    )
    prompt = len(prompt_ids(server, chat))
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == prompt


def test_messages_stop_sequences(server, ckpt):
    client = claude(server)
    messages = [{"role": "user", "content": "Once upon a time"}]
    _, text = kern_run(ckpt, server, messages, 24)
    stop = text[6:9]
    assert stop and text.find(stop) == 6
    msg = client.messages.create(
        model=MODEL, max_tokens=24, messages=messages, stop_sequences=[stop], extra_body=GREEDY
    )
    assert msg.content[0].text == text[:6]
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    with client.messages.stream(
        model=MODEL, max_tokens=24, messages=messages, stop_sequences=[stop], extra_body=GREEDY
    ) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == text[:6] and final.stop_sequence == stop


TOOLS = [{"name": "get_weather", "description": "Forecast", "input_schema": CITY}]


def test_messages_tool_use_round_trip(server):
    client = claude(server)
    # One call (no parallel calls): the tiny model would repeat calls up to max_tokens.
    choice = {"type": "any", "disable_parallel_tool_use": True}
    body = dict(model=MODEL, max_tokens=300, messages=ASK, tools=TOOLS, tool_choice=choice)
    msg = client.messages.create(**body, extra_body=GREEDY)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert uses and msg.stop_reason == "tool_use"
    for use in uses:
        assert use.name == "get_weather" and use.id
        jsonschema.validate(use.input, CITY)
    with client.messages.stream(**body, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert [
        (b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in final.content
    ] == [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in msg.content]
    assert final.stop_reason == "tool_use"
    # A tool call is never streamed as text.
    events = sse(server, "/v1/messages", {**body, "stream": True, **GREEDY})
    assert not any(
        d["delta"].get("type") == "text_delta" and "<tool_call>" in d["delta"]["text"]
        for n, d in events
        if n == "content_block_delta"
    )
    # The next turn answers the call with a tool_result.
    turn = [
        *ASK,
        {"role": "assistant", "content": [u.model_dump(exclude_none=True) for u in uses]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": u.id, "content": "sunny"} for u in uses
            ],
        },
    ]
    again = client.messages.create(
        model=MODEL, max_tokens=6, messages=turn, tools=TOOLS, tool_choice={"type": "none"}
    )
    assert again.content[0].type == "text" and again.stop_reason in ("max_tokens", "end_turn")
    counted = client.messages.count_tokens(model=MODEL, messages=turn, tools=TOOLS)
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == counted.input_tokens
    # The named tool, and auto, are served as well.
    named = client.messages.create(
        **{
            **body,
            "tool_choice": {
                "type": "tool",
                "name": "get_weather",
                "disable_parallel_tool_use": True,
            },
        },
        extra_body=GREEDY,
    )
    assert any(b.type == "tool_use" for b in named.content)
    server.assert_no_leak()


def test_messages_thinking_blocks(thinking):
    client = claude(thinking)
    body = dict(model=MODEL, max_tokens=12, messages=ASK, extra_body=GREEDY)
    msg = client.messages.create(**body)
    # The prompt opened a <think> block the answer never closes: all thinking.
    assert [b.type for b in msg.content] == ["thinking"] and msg.content[0].thinking
    with client.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert final.content[0].thinking == msg.content[0].thinking
    off = client.messages.create(**body, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]
    # A budget caps the thinking: the answer ends with max_tokens soon after it.
    capped = client.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 5},
        extra_body=GREEDY,
    )
    assert capped.stop_reason == "max_tokens" and 5 <= capped.usage.output_tokens < 60
    hidden = client.messages.create(**body, thinking={"type": "adaptive", "display": "omitted"})
    assert hidden.content[0].type == "thinking" and hidden.content[0].thinking == ""


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        ({"container": "x"}, "container"),
        ({"max_tokens": None}, "max_tokens"),
        ({"messages": [*ASK, {"role": "assistant", "content": "Sure"}]}, "prefill"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
        ({"tool_choice": {"type": "any"}}, "needs tools"),
        ({"thinking": {"type": "enabled", "budget_tokens": 5000}}, "below max_tokens"),
        ({"thinking": {"type": "disabled", "budget_tokens": 5}}, "goes with type 'enabled'"),
        ({"temperature": 1.5}, "temperature"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "role"),
    ],
)  # fmt: skip
def test_messages_bad_requests_are_refused_in_anthropics_shape(server, body, says):
    full = {"model": MODEL, "max_tokens": 4, "messages": ASK, **body}
    full = {k: v for k, v in full.items() if v is not None}
    r = server.http.post("/v1/messages", json=full)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert says in err["error"]["message"], err


def test_messages_auth_headers(server):
    body = {"model": MODEL, "max_tokens": 2, "messages": ASK}
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    ok = httpx.post(server.url + "/v1/messages?beta=true", json=body, headers=headers)
    assert ok.status_code == 200, ok.text
    bad = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": "nope"})
    assert bad.status_code == 401
    assert bad.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "missing or wrong API key"},
    }
    wrong = anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0)
    _CLIENTS.append(wrong)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    with pytest.raises(anthropic.NotFoundError):
        claude(server).messages.create(model="claude-x", max_tokens=2, messages=ASK)


# --- OpenAI Responses -----------------------------------------------------------------------


def test_responses_greedy_is_kern_run_whole_and_streamed(server, ckpt):
    client = oai(server)
    messages = [{"role": "user", "content": "Once upon a time"}]
    ids, text = kern_run(ckpt, server, messages, 24)
    resp = client.responses.create(
        model=MODEL, input="Once upon a time", max_output_tokens=24, temperature=0
    )
    assert resp.output_text == text and resp.usage.output_tokens == len(ids)
    assert resp.status == ("incomplete" if len(ids) == 24 else "completed")
    assert resp.usage.input_tokens == len(prompt_ids(server, messages))
    deltas = []
    with client.responses.stream(
        model=MODEL, input="Once upon a time", max_output_tokens=24, temperature=0
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert "".join(deltas) == text and final.output_text == text
    assert final.status == resp.status and final.usage.input_tokens_details.cached_tokens > 0
    # Stored: retrievable, and a next turn continues it.
    assert client.responses.retrieve(resp.id).output_text == text
    follow = client.responses.create(
        model=MODEL,
        input="And then?",
        previous_response_id=resp.id,
        instructions="Be brief.",
        max_output_tokens=4,
    )
    chat = [
        {"role": "system", "content": "Be brief."},
        *messages,
        {"role": "assistant", "content": text},
        {"role": "user", "content": "And then?"},
    ]
    assert follow.usage.input_tokens == len(prompt_ids(server, chat))
    server.assert_no_leak()


def test_responses_items_as_input(server):
    client = oai(server)
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
    ]
    resp = client.responses.create(model=MODEL, input=items, max_output_tokens=3, store=False)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert resp.usage.input_tokens == len(prompt_ids(server, chat))
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)


def test_responses_function_call_round_trip(server):
    client = oai(server)
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY}]
    body = dict(
        model=MODEL,
        input="Weather in Paris for 3 days?",
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=300,
        temperature=0,
    )
    resp = client.responses.create(**body)
    calls = [o for o in resp.output if o.type == "function_call"]
    assert calls and resp.output_text == ""
    for call in calls:
        assert call.name == "get_weather" and call.call_id
        jsonschema.validate(json.loads(call.arguments), CITY)
    kinds = []
    with client.responses.stream(**body) as stream:
        for event in stream:
            kinds.append(event.type)
            assert event.type != "response.output_text.delta"
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    assert [(o.name, o.arguments) for o in final.output if o.type == "function_call"] == [
        (c.name, c.arguments) for c in calls
    ]
    nxt = [
        {"role": "user", "content": "Weather in Paris for 3 days?"},
        *[c.model_dump(exclude_none=True) for c in calls],
        *[{"type": "function_call_output", "call_id": c.call_id, "output": "sunny"} for c in calls],
    ]
    again = client.responses.create(model=MODEL, input=nxt, tools=tools, max_output_tokens=4)
    assert again.status in ("completed", "incomplete")
    server.assert_no_leak()


def test_responses_json_schema(server):
    client = oai(server)
    schema = {
        "type": "object",
        "properties": {"zeta": {"type": "integer"}, "alpha": {"type": "boolean"}},
        "required": ["zeta", "alpha"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "pair", "schema": schema, "strict": True}}
    body = dict(model=MODEL, input="Give a pair", text=fmt, max_output_tokens=200)
    resp = client.responses.create(**body, temperature=0)
    jsonschema.validate(json.loads(resp.output_text), schema)
    with client.responses.stream(**body, temperature=0) as stream:
        final = stream.get_final_response()
    assert final.output_text == resp.output_text


def test_responses_reasoning_items(thinking):
    client = oai(thinking)
    body = dict(model=MODEL, input="Weather?", max_output_tokens=12, temperature=0)
    resp = client.responses.create(**body)
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    text = resp.output[0].content[0].text
    assert text and resp.usage.output_tokens_details.reasoning_tokens == 12
    reasoning = []
    with client.responses.stream(**body) as stream:
        for event in stream:
            if event.type == "response.reasoning_text.delta":
                reasoning.append(event.delta)
            assert event.type != "response.output_text.delta"
    assert "".join(reasoning) == text
    off = client.responses.create(**body, reasoning={"effort": "none"})
    assert [o.type for o in off.output] == ["message"] and off.output_text


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input_image"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "web_search"),
        ({"previous_response_id": "resp_nope"}, "not stored"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"reasoning": {"effort": "high"}}, "effort"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
    ],
)  # fmt: skip
def test_responses_bad_requests_are_refused_by_name(server, body, says):
    r = server.http.post(
        "/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2, **body}
    )
    assert r.status_code in (400, 404), r.text
    assert says in r.json()["error"]["message"], r.json()
