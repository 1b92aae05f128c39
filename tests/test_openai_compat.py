"""OpenAI compatibility against a real `kern serve`: every request field of the `openai`
package's own schemas is implemented or refused by name, nulls mean "unset", batch prompts,
the sampling parameters vLLM users send, stop reasons, and logprobs that reassemble the
answer, streamed or not."""

from __future__ import annotations

import concurrent.futures
import json
import sys
import typing

import httpx
import openai
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params
from support.server import KEY, MODEL, Server

from kern.server import api
from kern.tiny import make_tiny


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("compat"), "compat", pool_bytes="4MiB")
    yield srv
    srv.close()


def complete(srv: Server, **body) -> httpx.Response:
    return srv.http.post("/v1/completions", json={"model": MODEL, **body})


def chat(srv: Server, **body) -> httpx.Response:
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return srv.http.post("/v1/chat/completions", json={"model": MODEL, **body})


# --- every field: implemented, or refused by name ---------------------------------------------

# A value that asks for something (not the field's default), for each field of OpenAI's
# request schemas.
SAMPLES: dict[str, object] = {
    "audio": {"voice": "alloy", "format": "mp3"},
    "best_of": 2,
    "echo": True,
    "frequency_penalty": 0.5,
    "function_call": "auto",
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "logit_bias": {"50": 5},
    "logprobs": 2,
    "max_completion_tokens": 3,
    "max_tokens": 3,
    "metadata": {"team": "a"},
    "modalities": ["text", "audio"],
    "moderation": {"enabled": True},
    "n": 2,
    "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "x"},
    "presence_penalty": 0.5,
    "prompt_cache_key": "conversation-1",
    "prompt_cache_options": {"mode": "explicit"},
    "prompt_cache_retention": "24h",
    "reasoning_effort": "high",
    "response_format": {"type": "json_object"},
    "safety_identifier": "user-1",
    "seed": 7,
    "service_tier": "flex",
    "stop": ["\n"],
    "store": True,
    "stream_options": {"include_usage": True},
    "suffix": "tail",
    "temperature": 0.5,
    "tool_choice": "required",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "top_logprobs": 2,
    "top_p": 0.5,
    "user": "user-1",
    "verbosity": "low",
    "web_search_options": {},
}
# What kern implements (or, for identifiers, accepts as asking for no behaviour).
IMPLEMENTED = {
    "frequency_penalty", "logit_bias", "logprobs", "max_completion_tokens", "max_tokens",
    "metadata", "n", "presence_penalty", "prompt_cache_key", "safety_identifier", "seed",
    "stop", "stream_options", "temperature", "top_logprobs", "top_p", "user",
    # Without tools it asks for nothing, as in OpenAI's API.
    "parallel_tool_calls",
    "response_format",
}  # fmt: skip
# Implemented on chat completions, refused on completions (tests/test_tools.py has the rest).
CHAT_ONLY = {"tools", "tool_choice"}


def _fields(params_module) -> list[str]:
    names = set(typing.get_type_hints(params_module.CompletionCreateParamsBase))
    return sorted(names - {"model", "prompt", "messages"})


@pytest.mark.parametrize(
    "route,field",
    [("completions", f) for f in _fields(completion_params)]
    + [("chat", f) for f in _fields(chat_params)],
)
def test_every_openai_field_is_implemented_or_refused(server, route, field):
    assert field in SAMPLES, f"a new field in the openai package: {field}"
    body: dict = {"max_tokens": 2, field: SAMPLES[field]}
    if field == "max_completion_tokens":
        del body["max_tokens"]
    if field in ("stream_options",):
        body["stream"] = True
    if field == "top_logprobs":
        body["logprobs"] = True
    if route == "chat" and field == "logprobs":
        body["logprobs"] = True
    if route == "chat" and field == "tool_choice":
        body["tools"] = SAMPLES["tools"]
    r = complete(server, prompt="hi", **body) if route == "completions" else chat(server, **body)
    if field in IMPLEMENTED or (route == "chat" and field in CHAT_ONLY):
        assert r.status_code == 200, (field, r.text)
    else:
        assert r.status_code == 400, (field, r.text)
        err = r.json()["error"]
        assert field in err["message"] and err["param"] == field, err


def test_refused_fields_accept_their_defaults_and_null(server):
    defaults = {"best_of": 1, "echo": False, "suffix": "", "tools": [], "tool_choice": "none",
                "response_format": {"type": "text"}, "store": False, "modalities": ["text"],
                "service_tier": "auto", "parallel_tool_calls": True}  # fmt: skip
    for field, value in defaults.items():
        for v in (value, None):
            r = complete(server, prompt="hi", max_tokens=1, **{field: v})
            assert r.status_code == 200, (field, v, r.text)


def test_unknown_fields_are_refused_by_name(server):
    r = complete(server, prompt="hi", max_tokens=1, frobnicate=3, other={"x": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "frobnicate" and err["code"] == "unknown_parameter", err
    assert "'frobnicate', 'other'" in err["message"]
    for path, body in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ("/tokenize", {"prompt": "x"}),
        ("/detokenize", {"tokens": [72]}),
    ]:
        r = server.http.post(path, json={"model": MODEL, **body, "frobnicate": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "frobnicate", (path, r.text)


def test_unknown_fields_are_accepted_and_logged_when_allowed(tmp_path):
    # KERN_ALLOW_UNKNOWN_FIELDS=1 (read from the environment under hypercorn): vLLM's way.
    command = [sys.executable, "-m", "hypercorn", "kern.app:app", "--bind", "127.0.0.1:{port}"]
    srv = Server(tmp_path, "lenient", pool_bytes="2MiB", command=command,
                 env={"KERN_ALLOW_UNKNOWN_FIELDS": "1"})  # fmt: skip
    try:
        r = complete(srv, prompt="hi", max_tokens=1, frobnicate=3, other={"x": 1})
        assert r.status_code == 200, r.text
        assert "dropped unknown fields 'frobnicate', 'other'" in srv.output()
    finally:
        srv.close()


# --- shapes ---------------------------------------------------------------------------------


def test_null_means_unset(server):
    nulls = {f: None for f in ("temperature", "top_p", "n", "stream", "logprobs", "top_k",
                               "seed", "stop", "presence_penalty", "user", "min_p",
                               "stream_options", "ignore_eos", "return_token_ids")}  # fmt: skip
    r = complete(server, prompt="hi", max_tokens=2, **nulls)
    assert r.status_code == 200, r.text
    r = chat(server, max_tokens=2, max_completion_tokens=None, top_logprobs=None, **nulls)
    assert r.status_code == 200, r.text
    # max_tokens null on completions means OpenAI's 16.
    r = complete(server, prompt="hi", max_tokens=None, ignore_eos=True, temperature=0)
    assert r.json()["usage"]["completion_tokens"] == 16


def test_stream_options_without_stream(server):
    r = complete(server, prompt="hi", stream_options={"include_usage": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_batch_prompts(server):
    greedy = {"temperature": 0, "max_tokens": 4, "return_token_ids": True}
    singles = [complete(server, prompt=p, **greedy).json() for p in ("one", "two words")]
    r = complete(server, prompt=["one", "two words"], n=2, **greedy)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    for i, choice in enumerate(out["choices"]):
        assert choice["text"] == singles[i // 2]["choices"][0]["text"]
    assert out["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    ids = [s["choices"][0]["token_ids"] for s in singles]
    r = complete(server, prompt=[[72, 105], [72, 105, 33]], **greedy)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    for bad in ([["a"], "b"], ["ok", 3], [[]], [""]):
        r = complete(server, prompt=bad, max_tokens=1)
        assert r.status_code == 400, (bad, r.text)
    assert ids  # the singles answered


def test_models_by_id(server):
    r = server.http.get(f"/v1/models/{MODEL}")
    assert r.status_code == 200 and r.json()["id"] == MODEL
    assert server.http.get("/v1/models/other").status_code == 404


# --- sampling parameters --------------------------------------------------------------------


def _ids(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_logit_bias_penalties_and_min_tokens(server):
    base = {"prompt": "the cat", "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    plain = _ids(complete(server, **base))
    forced = _ids(complete(server, **base, logit_bias={"77": 100}))
    assert set(forced) == {77}
    banned = _ids(complete(server, **base, logit_bias={str(plain[0]): -100}))
    assert banned[0] != plain[0]
    for penalty in ({"presence_penalty": 2}, {"frequency_penalty": 2},
                    {"repetition_penalty": 5.0}):  # fmt: skip
        got = _ids(complete(server, **base, **penalty))
        assert got != plain or len(set(plain)) == len(plain), penalty
        # Penalised answers repeat no more than the plain one.
        assert len(set(got)) >= len(set(plain)), (penalty, got, plain)
    for bad in (
        {"presence_penalty": 2.5},
        {"repetition_penalty": 0},
        {"logit_bias": {"x": 1}},
        {"logit_bias": {"1": 101}},
        {"min_p": 1.5},
        {"logit_bias": {"99999999": 1}},
    ):
        assert complete(server, **base, **bad).status_code == 400, bad


def test_penalties_are_batch_invariant_and_seeded(server):
    base = {"max_tokens": 10, "return_token_ids": True, "presence_penalty": 1.0,
            "frequency_penalty": 0.5, "repetition_penalty": 1.3, "logit_bias": {"50": 3},
            "min_p": 0.05, "min_tokens": 4}  # fmt: skip
    cases = [{"prompt": f"batch {i}", "temperature": 0.8, "seed": i} for i in range(6)]
    cases += [{"prompt": f"greedy {i}", "temperature": 0} for i in range(6)]
    alone = [_ids(complete(server, **base, **c)) for c in cases]
    again = [_ids(complete(server, **base, **c)) for c in cases]
    assert again == alone  # seeded sampling reproducible with every processor on
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        burst = list(pool.map(lambda c: _ids(complete(server, **base, **c)), cases))
    assert burst == alone


def test_min_tokens_holds_back_the_end(server):
    r = complete(server, prompt="hi", max_tokens=8, temperature=0, return_token_ids=True)
    first = _ids(r)
    stop_id = first[2]
    early = complete(server, prompt="hi", max_tokens=8, temperature=0, stop_token_ids=[stop_id])
    held = complete(
        server, prompt="hi", max_tokens=8, temperature=0, stop_token_ids=[stop_id], min_tokens=6
    )
    assert early.json()["usage"]["completion_tokens"] <= 3
    assert held.json()["usage"]["completion_tokens"] >= 6


def test_an_empty_stop_string_and_min_tokens_over_max_tokens_are_refused(server):
    for stop in ("", ["x", ""]):
        r = complete(server, prompt="hi", max_tokens=4, stop=stop)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text
        assert "empty string" in r.json()["error"]["message"]
    r = complete(server, prompt="hi", max_tokens=4, min_tokens=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
    r = chat(server, max_completion_tokens=4, min_tokens=10)
    assert r.status_code == 400 and "min_tokens (10) is over max_tokens (4)" in r.text
    assert complete(server, prompt="hi", max_tokens=4, min_tokens=4).status_code == 200


def test_stop_reason_and_include_stop_str(server):
    base = {"prompt": "one two", "max_tokens": 16, "temperature": 0, "return_token_ids": True}
    full = complete(server, **base).json()["choices"][0]
    text = full["text"]
    assert full["stop_reason"] is None
    stop = text[3:5]
    cut = complete(server, **base, stop=[stop]).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert cut["text"] == text[: text.index(stop)]
    kept = complete(server, **base, stop=[stop], include_stop_str_in_output=True).json()
    assert kept["choices"][0]["text"] == text[: text.index(stop) + len(stop)]
    tok = full["token_ids"][2]
    by_id = complete(server, **base, stop_token_ids=[tok]).json()["choices"][0]
    assert by_id["finish_reason"] == "stop" and by_id["stop_reason"] == tok
    streamed = server.http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "stream": True,
            "max_tokens": 16,
            "temperature": 0,
            "stop": [stop],
        },  # fmt: skip
    )
    finals = [
        c for line in streamed.text.splitlines() if line.startswith("data: {")
        for c in json.loads(line[6:])["choices"] if c.get("finish_reason")
    ]  # fmt: skip
    assert len(finals) == 1 and "stop_reason" in finals[0]


def test_generation_config_defaults(tmp_path):
    folder = make_tiny("qwen3", tmp_path / "m", seed=1)
    gen = json.loads((folder / "generation_config.json").read_text())
    gen.update(temperature=0.0, top_k=20, repetition_penalty=1.1)
    (folder / "generation_config.json").write_text(json.dumps(gen))
    srv = Server(tmp_path, "gen", pool_bytes="2MiB", model=folder)
    try:
        card = srv.http.get(f"/v1/models/{MODEL}").json()
        assert card["sampling_defaults"] == {"temperature": 0.0, "top_k": 20,
                                             "repetition_penalty": 1.1}  # fmt: skip
        base = {"model": MODEL, "prompt": "hello", "max_tokens": 8, "return_token_ids": True}
        unset = srv.http.post("/v1/completions", json=base).json()["choices"][0]["token_ids"]
        explicit = srv.http.post(
            "/v1/completions", json={**base, "temperature": 0, "repetition_penalty": 1.1}
        ).json()["choices"][0]["token_ids"]
        assert unset == explicit  # the checkpoint's greedy default with its penalty
    finally:
        srv.close()


def test_chat_template_kwargs_reach_the_template(server):
    msgs = [{"role": "user", "content": "hi"}]
    plain = server.http.post("/tokenize", json={"messages": msgs}).json()["tokens"]
    off = server.http.post(
        "/tokenize", json={"messages": msgs, "chat_template_kwargs": {"enable_thinking": False}}
    ).json()["tokens"]
    assert len(off) > len(plain) and off[: len(plain)] == plain
    r = chat(server, max_tokens=2, chat_template_kwargs={"enable_thinking": False})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(off)
    r = chat(server, max_tokens=2, chat_template_kwargs={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


# --- logprobs -------------------------------------------------------------------------------


def _stream_events(srv: Server, path: str, body: dict) -> list[dict]:
    with srv.http.stream("POST", path, json={**body, "stream": True}) as r:
        return [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]


def test_completion_logprobs_reassemble_the_answer(server):
    # A prompt whose answer holds multi-byte characters split across tokens.
    body = {"model": MODEL, "prompt": "你好 ✓ 世界", "max_tokens": 40, "temperature": 0,
            "logprobs": 5, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    whole = server.http.post("/v1/completions", json=body).json()["choices"][0]
    lp = whole["logprobs"]
    n = len(whole["token_ids"])
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == n
    assert "".join(lp["tokens"]) == whole["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    for top in lp["top_logprobs"]:
        assert len(top) == 5  # byte tokens get distinct keys, nothing overwritten
    events = _stream_events(server, "/v1/completions", body)
    streamed: dict[str, list] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    tops = []
    for e in events:
        for c in e["choices"]:
            if c.get("logprobs"):
                for k in streamed:
                    streamed[k] += c["logprobs"][k]
                tops += c["logprobs"]["top_logprobs"]
    assert streamed["token_logprobs"] == lp["token_logprobs"]  # one entry per token, equal
    assert streamed["tokens"] == lp["tokens"] and streamed["text_offset"] == lp["text_offset"]
    assert tops == lp["top_logprobs"]


def test_chat_logprobs_bytes_are_the_tokens_bytes(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "你好 世界 ✓"}],
            "max_tokens": 30, "temperature": 0, "logprobs": True, "top_logprobs": 3,
            "ignore_eos": True}  # fmt: skip
    whole = server.http.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = whole["logprobs"]["content"]
    # The answer's text leaves out special tokens; their entries keep their own bytes.
    special = {"<|im_end|>", "<|im_start|>", "<|endoftext|>"}
    text = bytes(b for e in content if e["token"] not in special for b in e["bytes"])
    assert text.decode("utf-8", "replace") == whole["message"]["content"]
    for e in content:
        assert len({t["token"] for t in e["top_logprobs"]}) == 3
    streamed = [
        e2
        for ev in _stream_events(server, "/v1/chat/completions", body)
        for c in ev["choices"]
        if c.get("logprobs")
        for e2 in c["logprobs"]["content"]
    ]
    assert streamed == content


def test_the_official_client_reads_it_all(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(
        model=MODEL, prompt=["a", "b"], max_tokens=3, temperature=None, logprobs=2,
        presence_penalty=0.5, extra_body={"min_p": 0.1, "top_k": 5},
    )  # fmt: skip
    assert len(out.choices) == 2 and out.choices[0].logprobs is not None
    with pytest.raises(openai.BadRequestError, match="functions"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            functions=SAMPLES["functions"],  # type: ignore[arg-type]
        )
    assert api.UNSUPPORTED  # the refused list the docs name


# --- structured output ----------------------------------------------------------------------

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "ok"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        },
        "required": ["color", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"x": {"type": "number", "minimum": -5, "maximum": 5}},
            "required": ["x"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
]


def _json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}


def test_json_schema_outputs_validate_every_time(server):
    import jsonschema

    for k, schema in enumerate(SCHEMAS):
        for seed in range(20):
            r = chat(
                server,
                messages=[{"role": "user", "content": f"give me json {seed}"}],
                response_format=_json_format(schema),
                temperature=1.0,
                seed=seed,
                max_tokens=400,
            )
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "stop", (k, seed, choice)
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_json_object_and_completions(server):
    for seed in range(5):
        r = complete(
            server, prompt="{", response_format={"type": "json_object"}, seed=seed,
            temperature=1.0, max_tokens=300,
        )  # fmt: skip
        assert r.status_code == 200, r.text
        assert isinstance(json.loads(r.json()["choices"][0]["text"]), dict)


def test_constrained_answers_are_batch_invariant(server):
    cases = [
        {"messages": [{"role": "user", "content": f"q{i}"}], "seed": i, "temperature": 0.9,
         "response_format": _json_format(SCHEMAS[i % 3]), "max_tokens": 300,
         "presence_penalty": 0.3 if i % 2 else 0, "return_token_ids": True}
        for i in range(9)
    ]  # fmt: skip

    def ids(c):
        r = chat(server, **c)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    alone = [ids(c) for c in cases]
    with concurrent.futures.ThreadPoolExecutor(9) as pool:
        burst = list(pool.map(ids, cases))
    assert burst == alone


def test_bad_response_formats(server):
    for fmt, bad in [
        ({"type": "xml"}, "type"),
        ({"type": "json_schema", "json_schema": {"schema": {"type": "wizard"}}}, "compile"),
        ({"type": "json_schema", "json_schema": "nope"}, "json_schema"),
    ]:
        r = chat(server, max_tokens=2, response_format=fmt)
        assert r.status_code == 400, (fmt, r.text)
        err = r.json()["error"]
        assert err["param"] == "response_format" and bad in err["message"], err
    r = chat(server, max_tokens=2, response_format={"type": "json_object"}, ignore_eos=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos"


def test_the_official_client_parses_a_pydantic_model(server):
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=8)
        age: int = Field(ge=0, le=120)
        admin: bool

    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    for seed in range(5):
        out = client.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": "a person"}],
            response_format=Person,
            seed=seed,
            max_tokens=300,
        )
        person = out.choices[0].message.parsed
        assert isinstance(person, Person), out


def test_json_schema_keeps_the_property_order(server):
    # Keys come in the schema's own order (OpenAI's and vLLM's), and a schema that differs
    # only in order is its own grammar, not the other's cached one.
    def schema(names):
        props = {"zeta": {"type": "integer", "minimum": 0, "maximum": 9},
                 "alpha": {"type": "boolean"}}  # fmt: skip
        return {"type": "object", "properties": {k: props[k] for k in names},
                "required": list(names), "additionalProperties": False}  # fmt: skip

    for names in (("zeta", "alpha"), ("alpha", "zeta")):
        r = chat(server, response_format=_json_format(schema(names)), temperature=0,
                 max_tokens=100)  # fmt: skip
        assert r.status_code == 200, r.text
        assert list(json.loads(r.json()["choices"][0]["message"]["content"])) == list(names)
        tool = {"type": "function", "function": {"name": "f", "parameters": schema(names)}}
        r = chat(server, tools=[tool], temperature=0, max_tokens=100,
                 tool_choice={"type": "function", "function": {"name": "f"}})  # fmt: skip
        assert r.status_code == 200, r.text
        calls = r.json()["choices"][0]["message"]["tool_calls"]
        assert list(json.loads(calls[0]["function"]["arguments"])) == list(names)


# --- vLLM's request fields ------------------------------------------------------------------

IM_START = 510  # a special token of the tiny tokenizer (not its end of sequence)


def test_vllm_fields_refused_by_name_unless_default(server):
    refused = [
        ("completions", "bad_words", ["x"]),
        ("chat", "bad_words", ["x"]),
        ("completions", "spaces_between_special_tokens", False),
        ("completions", "return_tokens_as_token_ids", True),
        ("chat", "chat_template", "{{ messages }}"),
        ("chat", "echo", True),
    ]
    for route, field, value in refused:
        body = {"max_tokens": 2, field: value}
        r = (
            complete(server, prompt="hi", **body)
            if route == "completions"
            else chat(server, **body)
        )
        assert r.status_code == 400, (route, field, r.text)
        assert r.json()["error"]["param"] == field and field in r.json()["error"]["message"]
    defaults = {"bad_words": [], "spaces_between_special_tokens": True,
                "return_tokens_as_token_ids": False, "skip_special_tokens": True,
                "add_special_tokens": False, "priority": 0}  # fmt: skip
    for field, value in defaults.items():
        for v in (value, None):
            assert complete(server, prompt="hi", max_tokens=1, **{field: v}).status_code == 200
            assert chat(server, max_tokens=1, **{field: v}).status_code == 200
    for v in (False, None):
        assert chat(server, max_tokens=1, echo=v).status_code == 200
    assert chat(server, max_tokens=1, chat_template=None).status_code == 200


def test_allowed_token_ids_and_skip_special_tokens(server):
    base = {"prompt": "the cat", "max_tokens": 8, "return_token_ids": True, "ignore_eos": True}
    for extra in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        got = _ids(complete(server, **base, **extra, allowed_token_ids=[50, 77, 300]))
        assert set(got) <= {50, 77, 300} and len(got) == 8
    # Only a special token: its text is left out by default (vLLM's), kept when asked.
    only = {**base, "temperature": 0, "allowed_token_ids": [IM_START]}
    out = complete(server, **only).json()["choices"][0]
    assert out["token_ids"] == [IM_START] * 8 and out["text"] == ""
    kept = complete(server, **only, skip_special_tokens=False).json()["choices"][0]
    assert kept["text"] == "<|im_start|>" * 8
    r = chat(server, max_tokens=3, ignore_eos=True, allowed_token_ids=[IM_START],
             skip_special_tokens=False, stream=True)  # fmt: skip
    deltas = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    text = "".join(c["delta"].get("content") or "" for d in deltas for c in d["choices"])
    assert text == "<|im_start|>" * 3
    for bad in (
        {"allowed_token_ids": []},
        {"allowed_token_ids": [99999999]},
        {"allowed_token_ids": [1], "response_format": {"type": "json_object"}},
    ):
        r = complete(server, prompt="hi", max_tokens=2, **bad)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(
            "allowed_token_ids"
        ), (bad, r.text)


def test_allowed_token_ids_are_batch_invariant(server):
    cases = [{"prompt": f"batch {i}", "temperature": 0.9, "seed": i, "max_tokens": 8,
              "return_token_ids": True, "allowed_token_ids": list(range(40 + i, 60 + 3 * i))}
             for i in range(6)]  # fmt: skip
    cases += [{"prompt": f"plain {i}", "temperature": 0.9, "seed": i, "max_tokens": 8,
               "return_token_ids": True} for i in range(3)]  # fmt: skip
    alone = [_ids(complete(server, **c)) for c in cases]
    with concurrent.futures.ThreadPoolExecutor(9) as pool:
        burst = list(pool.map(lambda c: _ids(complete(server, **c)), cases))
    assert burst == alone


def test_add_special_tokens_priority_and_token_strs(server):
    msgs = [{"role": "user", "content": "hi"}]
    plain = server.http.post("/tokenize", json={"messages": msgs}).json()["tokens"]
    for special in (False, True):
        # The tiny (Qwen) tokenizer adds no special tokens: the same ids either way.
        r = server.http.post("/tokenize", json={"messages": msgs, "add_special_tokens": special})
        assert r.json()["tokens"] == plain
        r = chat(server, max_tokens=1, add_special_tokens=special)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(plain)
        r = complete(server, prompt="hi", max_tokens=1, add_special_tokens=special)
        assert r.status_code == 200, r.text
    for priority in (-5, 0, 7):
        assert complete(server, prompt="hi", max_tokens=1, priority=priority).status_code == 200
    assert complete(server, prompt="hi", max_tokens=1, priority=1 << 40).status_code == 400
    r = server.http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    out = r.json()
    assert out["tokens"] == [72, 319, 108, 111, 265, 266, 108, 100]
    assert out["token_strs"] == ["H", "el", "l", "o", "Ġw", "or", "l", "d"]
    assert "token_strs" not in server.http.post("/tokenize", json={"prompt": "x"}).json()


# --- tool_choice without tools, stop tokens, metrics ----------------------------------------


def test_tool_choice_without_tools_is_a_400(server):
    named = {"type": "function", "function": {"name": "f"}}
    for choice in ("auto", "required", named):
        for tools in ({}, {"tools": None}, {"tools": []}):
            r = chat(server, max_tokens=2, tool_choice=choice, **tools)
            assert r.status_code == 400, (choice, tools, r.text)
            err = r.json()["error"]
            assert err["param"] == "tool_choice" and "needs tools" in err["message"], err
    for tools in ({}, {"tools": None}, {"tools": []}):
        assert chat(server, max_tokens=2, tool_choice="none", **tools).status_code == 200


def test_a_stop_token_is_in_the_text_only_when_asked(server):
    base = {"prompt": "one two", "max_tokens": 16, "temperature": 0, "return_token_ids": True,
            "ignore_eos": True}  # fmt: skip
    full = complete(server, **base).json()["choices"][0]
    ids = full["token_ids"]
    # A stop token that did not come before, after no special token (whose text the answer
    # leaves out and /detokenize keeps).
    plain = [i for i in range(2, len(ids)) if ids[i] not in ids[:i] and max(ids[: i + 1]) < 509]
    k = plain[0]
    stop = {"stop_token_ids": [ids[k]]}
    texts = {}
    for include in (False, True):
        body = {**base, **stop, "include_stop_str_in_output": include}
        whole = complete(server, **body).json()["choices"][0]
        assert whole["stop_reason"] == ids[k] and whole["token_ids"] == ids[: k + 1]
        events = _stream_events(server, "/v1/completions", {"model": MODEL, **body})
        streamed = "".join(c["text"] for e in events for c in e["choices"])
        assert streamed == whole["text"]
        texts[include] = whole["text"]
    server_text = server.http.post("/detokenize", json={"tokens": ids[: k + 1]}).json()["prompt"]
    assert texts[True] == server_text
    assert (
        texts[False] == server.http.post("/detokenize", json={"tokens": ids[:k]}).json()["prompt"]
    )
    assert texts[False] != texts[True]
    # Chat, whole and streamed alike.
    chat_body = {"max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    cids = chat(server, **chat_body).json()["choices"][0]["token_ids"]
    j = next(i for i in range(1, len(cids)) if cids[i] not in cids[:i] and max(cids[: i + 1]) < 509)
    for include in (False, True):
        body = {**chat_body, "stop_token_ids": [cids[j]], "include_stop_str_in_output": include}
        whole = chat(server, **body).json()["choices"][0]
        msgs = [{"role": "user", "content": "hi"}]
        events = _stream_events(server, "/v1/chat/completions",
                                {"model": MODEL, "messages": msgs, **body})  # fmt: skip
        streamed = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        assert streamed == whole["message"]["content"]
        want = server.http.post("/detokenize", json={"tokens": cids[: j + include]}).json()
        assert whole["message"]["content"] == want["prompt"], (include, whole)


def test_prefix_cache_queries_count_a_prompt_once(server):
    before = server.metrics()
    r = complete(server, prompt="count me once, please", n=3, max_tokens=2)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    after = server.metrics()

    def delta(name):
        return after.get(name, 0) - before.get(name, 0)

    assert delta("kern_prefix_cache_queries_total") == usage["prompt_tokens"]
    assert delta("kern_prompt_tokens_total") == usage["prompt_tokens"]
    assert delta("kern_prefix_cache_hits_total") == usage["prompt_tokens_details"]["cached_tokens"]
