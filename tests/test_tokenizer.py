"""kern.tokenizer: round trips, special tokens, streaming decode, chat templates."""

from __future__ import annotations

import json
import shutil
import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kern.checkpoint.errors import MissingFileError
from kern.tiny import SPECIAL_TOKENS, make_tiny
from kern.tokenizer import ChatTemplateError, Tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_tiny("qwen3", tmp_path_factory.mktemp("tok") / "m")


@pytest.fixture(scope="module")
def tok(tiny_dir) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


# Strings that contain a special token's text would (correctly) tokenize to that token.
texts = st.text(max_size=200).filter(lambda s: not any(t in s for t in SPECIAL_TOKENS))


@settings(max_examples=200, deadline=None)
@given(text=texts)
def test_round_trip_is_nfc_identity(tok, text):
    assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


@settings(max_examples=100, deadline=None)
@given(text=texts)
def test_stream_concatenation_equals_decode(tok, text):
    ids = tok.encode(text)
    stream = tok.stream()
    assert "".join(stream.step(i) for i in ids) == tok.decode(ids)


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, 511), max_size=60),
    skip=st.booleans(),
)
def test_stream_of_any_ids_holds_at_most_an_unfinished_character(tok, ids, skip):
    # Random ids split UTF-8 characters anywhere (a model's answer may end inside one).
    # After each step everything decoded so far is out but a trailing U+FFFD, and
    # finish() returns that, so the whole text is decode's, U+FFFD included.
    stream = tok.stream(skip_special_tokens=skip)
    out = ""
    for n in range(len(ids)):
        out += stream.step(ids[n])
        so_far = tok.decode(ids[: n + 1], skip_special_tokens=skip)
        assert out == so_far.removesuffix("\ufffd")
    assert out + stream.finish() == tok.decode(ids, skip_special_tokens=skip)
    assert stream.finish() == ""


def test_stream_finish_returns_an_unfinished_character(tok):
    head, char = tok.encode("a"), tok.encode("\u4e2d")  # a 3-byte character
    assert len(char) == 3  # one id per byte in the tiny vocabulary
    stream = tok.stream()
    assert [stream.step(i) for i in [*head, *char[:2]]] == ["a", "", ""]
    assert stream.finish() == "\ufffd"
    assert tok.decode([*head, *char[:2]]) == "a\ufffd"
    # A token that cannot continue the character releases its U+FFFD at once.
    stream = tok.stream()
    assert [stream.step(i) for i in [*head, char[0], *head]] == ["a", "", "\ufffda"]


def test_special_tokens(tok):
    im_start, im_end, eot = (
        tok.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    )
    assert (eot, im_start, im_end) == (509, 510, 511)
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == im_start
    assert tok.encode("hi<|im_end|>")[-1] == im_end
    assert tok.eos_token_ids == (im_end,)  # without the checkpoint's extra ids
    assert tok.bos_token_id is None
    assert tok.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    assert tok.vocab_size == 512
    assert tok.decode([im_start, im_end], skip_special_tokens=True) == ""
    assert tok.id_to_token(im_end) == "<|im_end|>"


def test_extra_eos_ids_follow_the_tokenizers_own(tiny_dir):
    tok = Tokenizer.from_dir(tiny_dir, extra_eos_token_ids=[509, 511, 509])
    assert tok.eos_token_ids == (511, 509)


def test_decode_refuses_negative_ids_and_skips_ids_without_text(tok):
    with pytest.raises(ValueError, match=r"token id -1 is negative"):
        tok.decode([1, -1])
    assert tok.decode([tok.encode("a")[0], 100000]) == "a"
    with pytest.raises(TypeError):
        tok.encode(b"bytes")  # type: ignore[arg-type]


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Two "}, {"type": "text", "text": "parts"}],
    },
]


def test_chat_template_renders_qwen_format(tok):
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nTwo parts<|im_end|>\n"
    )
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == expected
    assert tok.apply_chat_template(MESSAGES) == expected + "<|im_start|>assistant\n"
    assert tok.has_chat_template


def test_chat_template_matches_transformers(tiny_dir, tok):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    rendered = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(MESSAGES) == rendered
    for text in [
        "Hello world, the quick brown fox!",
        "日本語 Café\n\n  def f(x):\n\treturn x",
        rendered,
    ]:
        assert tok.encode(text) == theirs(text)["input_ids"]


def test_template_errors_are_chat_template_errors(tok):
    with pytest.raises(ChatTemplateError, match=r"Unknown role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    with pytest.raises(ChatTemplateError, match=r"Only text content parts"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(ChatTemplateError, match=r"messages\[0\] must be an object"):
        tok.apply_chat_template(["hello"])  # type: ignore[list-item]
    with pytest.raises(ChatTemplateError, match=r"messages must be a list"):
        tok.apply_chat_template({"role": "user"})  # type: ignore[arg-type]


def _with_template(src: Path, dst: Path, template) -> Tokenizer:
    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    if template is None:
        config.pop("chat_template")
    else:
        config["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(dst)


def test_template_helpers_and_sandbox(tiny_dir, tmp_path):
    template = (
        "{{ bos_token is none }}|{{ eos_token }}|{{ messages[0] | tojson }}|{{ extra }}"
        "{% for m in messages %}{% if loop.index > 0 %}{% break %}{% endif %}{% endfor %}"
    )
    tok = _with_template(tiny_dir, tmp_path / "a", template)
    out = tok.apply_chat_template([{"role": "user", "content": "é"}], extra="kw")
    assert out == 'True|<|im_end|>|{"role": "user", "content": "é"}|kw'
    evil = _with_template(tiny_dir, tmp_path / "b", "{{ ''.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError, match=r"SecurityError"):
        evil.apply_chat_template([{"role": "user", "content": "x"}])
    mutating = _with_template(tiny_dir, tmp_path / "c", "{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError):
        mutating.apply_chat_template([{"role": "user", "content": "x"}])
    typed = _with_template(tiny_dir, tmp_path / "d", "{{ messages[0]['content'] + 'x' }}")
    with pytest.raises(ChatTemplateError, match=r"TypeError"):
        typed.apply_chat_template([{"role": "user", "content": None}])


def test_named_templates_and_jinja_file(tiny_dir, tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    tok = _with_template(tiny_dir, tmp_path / "a", named)
    assert tok.apply_chat_template([]) == "D"
    tok_dir = tmp_path / "b"
    _with_template(tiny_dir, tok_dir, "from config")
    (tok_dir / "chat_template.jinja").write_text("from file")
    assert Tokenizer.from_dir(tok_dir).apply_chat_template([]) == "from file"


def test_missing_template_and_bad_template(tiny_dir, tmp_path):
    tok = _with_template(tiny_dir, tmp_path / "a", None)
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match=r"no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match=r"does not compile"):
        _with_template(tiny_dir, tmp_path / "b", "{% for %}")


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(MissingFileError, match=r"tokenizer\.json: no such file"):
        Tokenizer.from_dir(tmp_path)
