"""Every request field that carries a token id (or a count of them) against ids a client can
get wrong: past the vocabulary, negative, 2^63, 2^64 and non-integers are each a 400 naming
the field, never a 500, a crash or a wrong index; and while a stream of such bodies arrives, a
well-formed greedy request answers bitwise what it answers alone."""

from __future__ import annotations

import concurrent.futures
import json
import threading

import httpx
import pytest
from support.server import KEY, MODEL

from kern.tiny import default_model_path

VOCAB = json.loads((default_model_path() / "config.json").read_text())["vocab_size"]
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4}

# Ids a client can get wrong, as JSON values.
BAD_IDS = {
    "vocab": VOCAB,
    "far": 10**6,
    "negative": -1,
    "2^31": 2**31,
    "2^63": 2**63,
    "2^64": 2**64,
    "float": 1.5,
    "integral-float": 7.0,
    "string": "7",
    "bool": True,
    "null": None,
}
# logit_bias's ids are object keys (strings): the same mistakes, and digits that are not ASCII.
BAD_KEYS = {
    "vocab": str(VOCAB),
    "far": str(10**6),
    "negative": "-1",
    "2^63": str(2**63),
    "2^64": str(2**64),
    "float": "1.5",
    "word": "seven",
    "empty": "",
    "spaced": " 7",
    "hex": "0x7",
    "superscript": "\u00b2",  # str.isdigit() is true, int() refuses it
    "arabic-indic": "\u0667",  # str.isdigit() is true, int() reads 7
}

# field -> (route, body given a bad value, the param the 400 must name, as a prefix)
FIELDS = {
    "completion prompt ids": (
        "/v1/completions",
        lambda v: {**COMPLETION, "prompt": [1, v]},
        "prompt",
    ),
    "completion prompt batch": (
        "/v1/completions",
        lambda v: {**COMPLETION, "prompt": [[1, 2], [3, v]]},
        "prompt",
    ),
    "completion stop_token_ids": (
        "/v1/completions",
        lambda v: {**COMPLETION, "stop_token_ids": [2, v]},
        "stop_token_ids",
    ),
    "chat stop_token_ids": (
        "/v1/chat/completions",
        lambda v: {**CHAT, "stop_token_ids": [v]},
        "stop_token_ids",
    ),
    "completion allowed_token_ids": (
        "/v1/completions",
        lambda v: {**COMPLETION, "allowed_token_ids": [5, v]},
        "allowed_token_ids",
    ),
    "chat allowed_token_ids": (
        "/v1/chat/completions",
        lambda v: {**CHAT, "allowed_token_ids": [v]},
        "allowed_token_ids",
    ),
    "chat bad_words": ("/v1/chat/completions", lambda v: {**CHAT, "bad_words": [v]}, "bad_words"),
    "detokenize tokens": ("/detokenize", lambda v: {"model": MODEL, "tokens": [1, v]}, "tokens"),
    # Counts of ids: at most 20 alternatives, as OpenAI allows.
    "chat top_logprobs": (
        "/v1/chat/completions",
        lambda v: {**CHAT, "logprobs": True, "top_logprobs": v},
        "top_logprobs",
    ),
    "completion logprobs": ("/v1/completions", lambda v: {**COMPLETION, "logprobs": v}, "logprobs"),
}
# null is "left out" for a count: a valid value there.
VALID = {("chat top_logprobs", "null"), ("completion logprobs", "null")}
BIAS = {
    "completion logit_bias": ("/v1/completions", COMPLETION),
    "chat logit_bias": ("/v1/chat/completions", CHAT),
}


@pytest.fixture(scope="module")
def server(make_server):
    return make_server("ids", pool_bytes="4MiB", env={"OMP_WAIT_POLICY": "PASSIVE"})


def _bad_bodies() -> list[tuple[str, str, dict, str]]:
    """(case name, route, body, param) for every field and bad value."""
    out = []
    for field, (route, body, param) in FIELDS.items():
        for name, value in BAD_IDS.items():
            if (field, name) not in VALID:
                out.append((f"{field}: {name}", route, body(value), param))
    for field, (route, base) in BIAS.items():
        for name, key in BAD_KEYS.items():
            out.append((f"{field}: {name}", route, {**base, "logit_bias": {key: 1}}, "logit_bias"))
    return out


BAD = _bad_bodies()


def _refused(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] is not None and err["param"].startswith(param), err


@pytest.mark.parametrize("route,body,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_id_is_a_400_naming_the_field(server, route, body, param):
    _refused(server.http.post(route, json=body), param)
    # The same body streamed: refused before the stream opens.
    if route != "/detokenize":
        _refused(server.http.post(route, json={**body, "stream": True}), param)


def test_ids_at_the_edge_are_served(server):
    """The last id of the vocabulary is one (the refusals above are at the right bound)."""
    last = VOCAB - 1
    for route, body in [
        ("/v1/completions", {**COMPLETION, "prompt": [1, last], "stop_token_ids": [last]}),
        ("/v1/completions", {**COMPLETION, "allowed_token_ids": [0, last]}),
        ("/v1/chat/completions", {**CHAT, "logit_bias": {str(last): 100, "0": -100}}),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 20}),
        ("/detokenize", {"model": MODEL, "tokens": [0, last]}),
    ]:
        r = server.http.post(route, json=body)
        assert r.status_code == 200, (route, body, r.text)
    # Only the allowed ids come out; a +100 bias picks its id every step (greedy).
    out = server.complete([1, 2], max_tokens=8, allowed_token_ids=[7, last])
    assert set(out["choices"][0]["token_ids"]) <= {7, last}
    biased = server.complete([1, 2], max_tokens=4, logit_bias={"9": 100}, ignore_eos=True)
    assert biased["choices"][0]["token_ids"] == [9, 9, 9, 9]


GOOD = {
    "chat": (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "max_tokens": 48,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 5,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    ),
    "completion": (
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": [5, 6, 7, 8, 9, 10, 11],
            "max_tokens": 48,
            "temperature": 0,
            "logprobs": 5,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    ),
}


def _answer(r: httpx.Response) -> list[dict]:
    """The choices without ids and timestamps: text, token ids and logprobs, as sent."""
    assert r.status_code == 200, r.text
    return r.json()["choices"]


@pytest.mark.parametrize("kind", GOOD)
def test_good_answer_unchanged_while_bad_ids_arrive(server, kind):
    route, body = GOOD[kind]
    alone = _answer(server.http.post(route, json=body))
    done = threading.Event()
    answered = [0]
    started = threading.Event()

    def hammer(offset: int) -> None:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
            i = offset
            while not done.is_set():
                _, r_route, r_body, param = BAD[i % len(BAD)]
                _refused(c.post(r_route, json=r_body), param)
                answered[0] += 1
                started.set()
                i += 7

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        hammers = [pool.submit(hammer, k) for k in range(2)]
        assert started.wait(60)
        before = answered[0]
        try:
            together = _answer(server.http.post(route, json=body))
        finally:
            done.set()
        during = answered[0] - before
        for h in hammers:
            h.result()
    assert during > 0, "no bad request was answered while the good one ran"
    # Bitwise: the JSON text of text, ids and every logprob is the same.
    assert json.dumps(together) == json.dumps(alone)
    server.assert_no_leak()
    assert "Traceback" not in server.output()
