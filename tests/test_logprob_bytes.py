"""Chat logprobs' ``bytes`` are the UTF-8 bytes each token adds to the answer, against a real
``kern serve`` of the tiny model (a byte-level BPE whose ids 0-255 are the bytes themselves):
a token that ends or splits a character carries its raw partial bytes, a token the text leaves
out (end of sequence, a skipped special token) carries ``[]``, and joined they decode
(``errors="replace"``) to the content, streamed and whole alike. Completions' logprobs have no
``bytes`` field."""

from __future__ import annotations

import json

import pytest
from support.server import MODEL, Server

# The tiny vocabulary: ids 0-255 are the bytes; its special tokens.
E_ACUTE = [0xC3, 0xA9]  # "é", two tokens of one byte each
A = ord("a")
IM_START, IM_END = 510, 511


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("bytes"), "bytes", pool_bytes="4MiB")
    yield srv
    srv.close()


def _body(**kw) -> dict:
    # Sampled with a seed over a few byte tokens: characters split across tokens, invalid
    # sequences and answers ending mid-character, the same on every run.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "é?"}],
            "logprobs": True, "top_logprobs": 2, "temperature": 1.5, "seed": 3,
            "allowed_token_ids": [*E_ACUTE, A], "max_tokens": 40}  # fmt: skip
    return {**body, **kw}


def _answer(srv: Server, **kw) -> tuple[str, list[dict]]:
    """The whole answer's content and logprob entries, checked to equal the streamed ones."""
    body = _body(**kw)
    r = srv.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content, entries = choice["message"]["content"], choice["logprobs"]["content"]
    text, streamed = "", []
    with srv.http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text += c["delta"].get("content") or ""
                    streamed += (c.get("logprobs") or {}).get("content") or []
    assert text == content
    assert streamed == entries  # each entry once, with the same bytes
    return content, entries


def _joined(entries: list[dict]) -> bytes:
    return b"".join(bytes(e["bytes"]) for e in entries)


def _check(content: str, entries: list[dict]) -> bytes:
    joined = _joined(entries)
    assert joined.decode("utf-8", "replace") == content
    for e in entries:
        for top in e["top_logprobs"]:  # an alternative's bytes are its own
            token = top["token"]
            if token.startswith("bytes:"):  # part of a character, written \xNN...
                assert token == "bytes:" + "".join(f"\\x{b:02x}" for b in top["bytes"])
            else:
                assert bytes(top["bytes"]) == token.encode()
    return joined


def test_split_characters_carry_their_raw_bytes(server):
    content, entries = _answer(server)
    joined = _check(content, entries)
    # Every token here is one byte, and all of them are in the answer.
    assert [len(e["bytes"]) for e in entries] == [1] * 40
    assert "é" in content and "é".encode() in joined  # a character split over two tokens
    assert b"\xc3\xc3" in joined or b"\xa9\xa9" in joined  # and bytes no character holds


def test_answers_ending_mid_character(server):
    _, entries = _answer(server)
    ids = [e["bytes"][0] for e in entries]
    # Every length whose last token starts "é": the answer ends inside that character.
    ends = [k + 1 for k in range(len(ids) - 1) if ids[k : k + 2] == E_ACUTE][:3]
    assert ends
    for n in ends:
        content, head = _answer(server, max_tokens=n)
        joined = _check(content, head)
        assert content.endswith("\ufffd") and joined.endswith(b"\xc3")
        assert head == entries[:n]


def test_left_out_tokens_have_no_bytes(server):
    _, entries = _answer(server)
    first_a = next(k for k, e in enumerate(entries) if e["bytes"] == [A])
    # The stop token ends the answer and adds nothing to it.
    content, head = _answer(server, stop_token_ids=[A])
    _check(content, head)
    assert len(head) == first_a + 1 and head[-1]["bytes"] == [] and head[-1]["token"] == "a"
    # ... unless asked for.
    content, head = _answer(server, stop_token_ids=[A], include_stop_str_in_output=True)
    assert _check(content, head).endswith(b"a") and head[-1]["bytes"] == [A]
    # Special tokens skipped from the text (the default), or kept.
    allowed = [*E_ACUTE, IM_START]
    content, skipped = _answer(server, allowed_token_ids=allowed)
    _check(content, skipped)
    specials = [e for e in skipped if e["token"] == "<|im_start|>"]
    assert specials and all(e["bytes"] == [] for e in specials)
    content, kept = _answer(server, allowed_token_ids=allowed, skip_special_tokens=False)
    _check(content, kept)
    assert "<|im_start|>" in content
    assert all(e["bytes"] == list(b"<|im_start|>") for e in kept if e["token"] == "<|im_start|>")


def test_a_stop_string_cuts_the_bytes(server):
    full, entries = _answer(server)
    # Cut at the first "é": the answer holds none of it, split over two tokens as it is.
    content, head = _answer(server, stop=["é"])
    assert content == full[: full.index("é")]
    everything = _joined(entries)
    assert _check(content, head) == everything[: everything.index("é".encode())]
    assert head[-1]["bytes"] == [] and head[-2]["bytes"] == []  # the two tokens of "é"


def test_completions_logprobs_have_no_bytes_field(server):
    body = {"model": MODEL, "prompt": "é", "max_tokens": 4, "logprobs": 1}
    lp = server.http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
