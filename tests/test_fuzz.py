"""kern's own OpenAPI document, and schemathesis fuzzing a real `kern serve` over it: for a
bounded number of bodies per route, valid ones (positive) and ones that break the schema
(negative), every answer is a 2xx or a 4xx in the route's error shape (OpenAI's; Anthropic's
under /v1/messages), never a 5xx, a traceback in the log or a hang; the server stays up and
the pool's books balance after each route."""

from __future__ import annotations

import json

import jsonschema
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, note, settings
from schemathesis import GenerationMode
from support.server import KEY, MODEL

from kern.server.openapi import ROUTES

# Examples per POST route and mode (a GET route takes GET_EXAMPLES): ~60 s for the module on
# two busy cores. Most valid-by-schema chat bodies still break a cross-field rule (a tool
# message without tool_call_id, ...): enough examples that some generate.
EXAMPLES = {GenerationMode.POSITIVE: 30, GenerationMode.NEGATIVE: 10}
GET_EXAMPLES = 4
# A request that takes longer is a hang (the context is 256 tokens: each answer is short).
TIMEOUT = 60
AUTH = {"Authorization": f"Bearer {KEY}"}
OPENAI_ERROR = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server(make_server):
    # A short context bounds every answer, however large the max_tokens drawn.
    return make_server(
        "fuzz",
        pool_bytes="4MiB",
        extra=("--max-model-len", "256"),
        env={"OMP_WAIT_POLICY": "PASSIVE"},
    )


@pytest.fixture(scope="module")
def spec(server):
    return server.http.get("/openapi.json").json()


@pytest.fixture(scope="module")
def schema(server, spec):
    loaded = schemathesis.openapi.from_dict(spec)
    loaded.config.update(base_url=server.url)
    loaded.config.max_stream_events = 1 << 20  # read every stream to its end
    return loaded


def test_document_is_valid_openapi_31(spec, schema):
    assert spec["openapi"] == "3.1.0"
    schema.validate()  # schemathesis' OpenAPI 3.1 meta-schema: raises on a malformed document
    for component in spec["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(component)
    # Every $ref points at a component.
    refs = set(_refs(spec))
    assert refs and refs <= {f"#/components/schemas/{n}" for n in spec["components"]["schemas"]}
    # Every route the table lists, each POST with its body, each with its error shape.
    assert {p: set(ops) for p, ops in spec["paths"].items()} == {p: {m} for p, m, *_ in ROUTES}
    for path, method, body, _, _ in ROUTES:
        op = spec["paths"][path][method]
        assert ("requestBody" in op) == (body is not None) == (method == "post"), path
        error = op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
        assert error.endswith("AnthropicError" if "/messages" in path else "ErrorResponse")
    request = spec["components"]["schemas"]["ChatCompletionRequest"]
    assert {"messages", "model"} <= set(request["required"])
    assert request["properties"]["top_logprobs"]["anyOf"][0]["maximum"] == 20


def test_document_lists_every_route_the_app_serves(server):
    from kern.app import App

    served = set(App()._routes) | {"/v1/models/{model}", "/v1/responses/{response_id}"}
    assert served == {p for p, *_ in ROUTES}
    # A malformed document is caught: the check above is not vacuous.
    broken = schemathesis.openapi.from_dict({"openapi": "3.1.0", "paths": {"x": 1}})
    with pytest.raises(Exception):  # noqa: B017, PT011 - jsonschema_rs' ValidationError
        broken.validate()


def _refs(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref":
                yield v
            else:
                yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


def _check(path: str, r: schemathesis.Response) -> None:
    """A 2xx, or a 4xx in the route's error shape."""
    assert r.status_code < 500, f"{r.status_code}: {r.text[:2000]}"
    if r.status_code < 400:
        assert not r.stream_cut_short, "a stream did not end within the timeout"
        if r.headers.get("content-type", [""])[0].startswith("application/json"):
            r.json()
        return
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    else:
        assert set(body) == {"error"} and set(body["error"]) == OPENAI_ERROR, body
    assert body["error"]["message"]


def _ints(value):
    """``value`` with integral floats as ints: JSON Schema counts 1.0 as an integer, kern (as
    msgspec) refuses it with a 400 naming the field; valid cases should reach generation."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, dict):
        return {k: _ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_ints(v) for v in value]
    return value


def _fuzzable(path: str, method: str, mode: GenerationMode) -> bool:
    # A negative case needs something to break: a body or a path parameter.
    return mode is GenerationMode.POSITIVE or method == "post" or "{" in path


CASES = [
    pytest.param(path, method, mode, id=f"{mode.value}-{method.upper()}-{path}")
    for path, method, *_ in ROUTES
    for mode in EXAMPLES
    if _fuzzable(path, method, mode)
]


@pytest.mark.parametrize("path,method,mode", CASES)
def test_fuzz(server, schema, path, method, mode):
    strategy = schema[path][method].as_strategy(generation_mode=mode)
    session = requests.Session()
    seen_log = len(server.output())
    statuses: list[int] = []

    @given(case=strategy)
    @settings(
        max_examples=EXAMPLES[mode] if method == "post" else GET_EXAMPLES,
        deadline=None,
        database=None,
        phases=(Phase.generate,),  # no shrinking: a failure prints its case as it came
        suppress_health_check=list(HealthCheck),
    )
    def run(case):
        # Valid bodies name the model served (else nearly all are a 404 for the model).
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            case.body["model"] = MODEL
        if mode is GenerationMode.POSITIVE:
            case.body = _ints(case.body)
        note(f"{case.method} {case.formatted_path} {json.dumps(case.body, default=repr)[:4000]}")
        r = case.call(session=session, headers=AUTH, timeout=TIMEOUT)
        statuses.append(r.status_code)
        _check(path, r)

    run()
    session.close()
    print(f"{mode.value} {method.upper()} {path}: {sorted(statuses)}")
    assert statuses  # (fewer than EXAMPLES where the schema allows fewer distinct cases)
    assert server.proc.poll() is None and server.http.get("/health").status_code == 200
    log = server.output()[seen_log:]
    assert "Traceback" not in log, log[-4000:]
    server.assert_no_leak()
