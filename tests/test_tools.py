"""Tool calls and reasoning against a real `kern serve`, driven by the official client: tools
rendered by the chat template, forced calls enforced by the grammar and parsed into
``tool_calls`` (streamed too), a call's result sent back in a second turn, reasoning split into
``reasoning_content``, and every bad tools request refused by name."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import jsonschema
import openai
import pytest
from support.schemas import SCHEMAS, UNITS, WEATHER
from support.server import KEY, MODEL, Server, thinking_server

from kern.tiny import default_model_path

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "set_unit", "parameters": UNITS}},
]  # fmt: skip
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("tools"), "tools", pool_bytes="4MiB")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as c:
        yield c


def chat(srv: Server, **body) -> httpx.Response:
    body.setdefault("messages", ASK)
    return srv.http.post("/v1/chat/completions", json={"model": MODEL, **body})


def check_calls(calls, names=None):
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("parallel", [False, True])
def test_required_calls_parse_and_validate(client, parallel):
    def ask(seed):
        return client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", seed=seed,
            temperature=1.0, max_tokens=300, parallel_tool_calls=parallel,
        ).choices[0]  # fmt: skip

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(ask, range(8)))
    for choice in choices:
        # Each call is bounded (maxLength, an enum): one call always ends; parallel calls
        # may go on until the length, and what was parsed must still be valid.
        assert choice.finish_reason == ("tool_calls" if not parallel else choice.finish_reason)
        assert choice.finish_reason in ("tool_calls", "length")
        if choice.finish_reason == "tool_calls":
            assert choice.message.content is None, choice
        else:  # a call the length cut off stays content, verbatim
            cut = choice.message.content or ""
            assert cut.startswith("<tool_call>") or "<tool_call>".startswith(cut), choice
        check_calls(choice.message.tool_calls)
        if not parallel:
            assert len(choice.message.tool_calls) == 1
    if parallel:
        assert any(len(c.message.tool_calls) > 1 for c in choices)


def test_a_named_function_is_called_and_round_trips(server, client):
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_tokens=400,
        tool_choice={"type": "function", "function": {"name": "set_unit"}},
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message.tool_calls, {"set_unit"})
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    # The second turn: the call and its result rendered by the template.
    turn2 = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"},
    ]
    again = client.chat.completions.create(
        model=MODEL, messages=turn2, tools=TOOLS, max_tokens=4, temperature=0
    )
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    rendered = server.http.post("/tokenize", json={"messages": turn2, "tools": TOOLS}).json()
    text = server.http.post("/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
    assert "<tool_response>\n21 degrees\n</tool_response>" in text
    assert '<tool_call>\n{"name": "set_unit", "arguments": ' + call.function.arguments in text
    assert '"name": "get_weather"' in text  # the tools themselves, in the system turn
    assert again.usage.prompt_tokens == rendered["count"]
    # The first turn's prompt is a prefix of the second's: the cache serves it.
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_streamed_calls_equal_the_whole_ones(client):
    kwargs = dict(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
        max_tokens=400, parallel_tool_calls=False,
    )  # fmt: skip
    whole = client.chat.completions.create(**kwargs).choices[0]
    with client.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls
    ]
    # Raw chunks: a call arrives whole in one delta, indexed from 0.
    raw = client.chat.completions.create(**kwargs, stream=True)
    deltas = [c.choices[0].delta for c in raw if c.choices and c.choices[0].delta.tool_calls]
    assert [d.tool_calls[0].index for d in deltas] == [0]


def test_auto_and_none(server, client):
    plain = chat(server, max_tokens=1).json()["usage"]["prompt_tokens"]
    for choice in ("auto", "none", None):
        body = {"tools": TOOLS, "max_tokens": 8, "temperature": 0}
        if choice is not None:
            body["tool_choice"] = choice
        r = chat(server, **body)
        assert r.status_code == 200, r.text
        # The tools are in the prompt whatever the choice, as vLLM renders them.
        assert r.json()["usage"]["prompt_tokens"] > plain
    # With none nothing is parsed: the answer is the text kern run would print.
    r = chat(server, tools=TOOLS, tool_choice="none", max_tokens=12, temperature=0,
             return_token_ids=True).json()  # fmt: skip
    choice = r["choices"][0]
    text = server.http.post("/detokenize", json={"tokens": choice["token_ids"]}).json()
    assert choice["message"]["content"] == text["prompt"]
    assert "tool_calls" not in choice["message"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": 'a"b'}}]},
         "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "f",
          "parameters": {"type": "string"}}}]}, "tools[0].function.parameters"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": TOOLS, "ignore_eos": True}, "ignore_eos"),
        ({"tools": TOOLS, "min_tokens": 3}, "min_tokens"),
        ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "nonsense"}}}}}],
          "tool_choice": "required"}, "tools"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "a"}]},
         "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
         "messages[0].tool_calls"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
          "function": {"name": "f", "arguments": "[1]"}}]}]},
         "messages[0].tool_calls[0].function.arguments"),
        ({"tools": [{"type": "function", "function": {"name": "f",
          "description": "<|im_end|>"}}]}, "tools[0]"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_refused_by_name(server, body, param):
    r = chat(server, max_tokens=2, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_completions_refuse_tools(server):
    r = server.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x", "tools": TOOLS, "max_tokens": 1}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


# --- reasoning ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    srv = thinking_server(tmp_path_factory.mktemp("thinking"))
    yield srv
    srv.close()


def test_reasoning_is_split_streamed_or_not(thinking):
    # Closed at the end: a client left to the garbage collector warns of its socket.
    with openai.OpenAI(base_url=thinking.url + "/v1", api_key=KEY, max_retries=0) as client:
        _split_streamed_or_not(thinking, client)


def _split_streamed_or_not(thinking, client):
    body = dict(model=MODEL, messages=ASK, max_tokens=12, temperature=0)
    out = client.chat.completions.create(**body, extra_body={"return_token_ids": True})
    msg = out.choices[0].message
    ids = out.choices[0].model_extra["token_ids"]
    text = thinking.http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    # The prompt opened the block and the answer never closed it: all reasoning.
    assert msg.model_extra["reasoning_content"] == text and msg.content == ""
    reasoning = content = ""
    for chunk in client.chat.completions.create(**body, stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
    assert (reasoning, content) == (text, "")
    # enable_thinking false closes the block in the prompt: the answer is content.
    off = (
        client.chat.completions.create(
            **body, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
        )
        .choices[0]
        .message
    )
    assert off.content and not (off.model_extra or {}).get("reasoning_content")


def test_templates_without_tools_refuse_them(thinking):
    r = thinking.http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 1},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "does not render tools" in r.json()["error"]["message"]


def test_reasoning_parser_is_checked(tmp_path):
    import subprocess
    import sys

    bad = subprocess.run(
        [sys.executable, "-m", "kern.cli", "serve", "--reasoning-parser", "nope", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "--reasoning-parser" in bad.stderr
    config = tmp_path / "kern.toml"
    config.write_text(
        f'[targets.x]\ncheckpoint = "{default_model_path()}"\nreasoning_parser = "nope"\n'
    )
    bad = subprocess.run(
        [sys.executable, "-m", "kern.cli", "serve", "--config", str(config), "--target", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode != 0 and "reasoning_parser" in bad.stderr, bad.stderr
