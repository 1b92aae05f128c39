"""Kimi K2's tool-call convention (``tool_parser = "kimi_k2"``, ``--tool-call-parser``): the
splitter reads tool-calls sections (whole and in every split alike), the grammar writes them
for ``required`` and named tool_choice (its markers special tokens of the tokenizer, or plain
text), and a real ``kern serve`` with a Kimi-style chat template answers calls whose ids
(``functions.NAME:INDEX``) come back in the next turn."""

from __future__ import annotations

import json
import random
import re
import shutil

import jsonschema
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from support.scheduler import Harness, load, prompt
from support.schemas import SCHEMAS
from support.server import KEY, MODEL, Server

from kern.chat_formats.kimi_k2 import KIMI_K2
from kern.chat_formats.qwen3 import QWEN3
from kern.engine.structured import Grammars
from kern.server.splitter import Splitter
from kern.tiny import default_model_path

BEGIN, END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
MARKERS = [BEGIN, END, "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"]
# Kimi's turn markup: special tokens of the tokenizer below, as the markers are.
TURNS = ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>"]


def call(name: str, index: int, args: str) -> str:
    head = f"<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>"
    return head + args + "<|tool_call_end|>"


TWO = BEGIN + call("get_weather", 0, '{"city": "Paris"}') + call("get_time", 1, "{}") + END


def split(text: str, cuts=(), *, reasoning=False, tools=True):
    """What the kimi_k2 splitter makes of ``text`` fed in pieces cut at ``cuts``."""
    think = QWEN3.reasoning if reasoning else None
    s = Splitter(reasoning=think, tools=KIMI_K2 if tools else None)
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(text)), len(text)]
    reasoned, content, calls = "", "", []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        parts = s.feed(text[a:b], final=i == len(bounds) - 2)
        reasoned += parts.reasoning
        content += parts.content
        calls += [(c.id, c.name, json.loads(c.arguments)) for c in parts.calls]
    return reasoned, content, calls


def test_a_section_becomes_calls_with_their_ids():
    assert split("Let me check. " + TWO) == (
        "",
        "Let me check. ",
        [("functions.get_weather:0", "get_weather", {"city": "Paris"}),
         ("functions.get_time:1", "get_time", {})],
    )  # fmt: skip
    # The name runs to the last colon; whitespace between markers and calls is allowed.
    spaced = BEGIN + "\n " + call("a.b:c", 12, ' {"x": [1]} ') + "\n" + END + "\n"
    assert split(spaced) == ("", "", [("functions.a.b:c:12", "a.b:c", {"x": [1]})])
    # Text after the section stays content (whitespace around calls does not).
    assert split(TWO + "\n done \n")[1] == "done"
    # Two sections, and reasoning first.
    assert len(split(TWO + TWO)[2]) == 4
    assert split("<think>plan</think>" + TWO, reasoning=True)[:2] == ("plan", "")
    # Tools off, or Qwen3's blocks under the kimi_k2 parser: content.
    assert split(TWO, tools=False) == ("", TWO, [])
    qwen = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert split(qwen) == ("", qwen, [])


@pytest.mark.parametrize(
    "bad",
    [
        BEGIN + call("f", 0, "{not json}") + END,
        BEGIN + call("f", 0, "[1]") + END,
        BEGIN + call("f", 0, "{}") + "stray" + END,
        BEGIN + "<|tool_call_begin|>f:0<|tool_call_argument_begin|>{}<|tool_call_end|>" + END,
        BEGIN + "<|tool_call_begin|>functions.f<|tool_call_argument_begin|>{}<|tool_call_end|>"
        + END,
        BEGIN + "<|tool_call_begin|>functions.f:0{}<|tool_call_end|>" + END,
        BEGIN + "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{}" + END,
        BEGIN + END,
        BEGIN + call("f", 0, "{}"),  # cut off: no section end
        TWO[:-5],
        TWO[:40],
    ],
)  # fmt: skip
def test_a_malformed_or_cut_off_section_stays_content_verbatim(bad):
    assert split("Hi " + bad) == ("", "Hi " + bad, [])
    if bad.endswith(END):  # a good section after a bad one still parses
        assert split(bad + TWO)[1:] == (bad, split(TWO)[2])


TEXTS = [
    "Let me check. " + TWO + " tail",
    "<think>why" + TWO + "</think>\n" + TWO,
    "< <|tool_calls_section_begi" + BEGIN + call("f", 0, "{bad}") + END + TWO[:-3],
    TWO + "\n" + TWO,
]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("reasoning", [False, True])
def test_every_split_is_the_whole(text, reasoning):
    whole = split(text, reasoning=reasoning)
    for cut in range(1, len(text)):
        assert split(text, [cut], reasoning=reasoning) == whole, cut
    assert split(text, range(len(text)), reasoning=reasoning) == whole
    rng = random.Random(0)
    for _ in range(200):
        cuts = rng.sample(range(1, len(text)), rng.randint(2, 8))
        assert split(text, cuts, reasoning=reasoning) == whole, cuts


# --- the grammar ------------------------------------------------------------------------------

SPECS = [{"name": name, "parameters": schema} for name, schema in SCHEMAS.items()]
ID = re.compile(r"functions\.(\w+):[0-9]+")


def template() -> str:
    """A chat template in Kimi's format: tools declared first, calls and their results by id."""
    return (
        "{%- if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>"
        "{%- endif %}"
        "{%- for m in messages %}"
        "{%- if m['role'] == 'tool' %}<|im_system|>tool<|im_middle|>## Return of "
        "{{ m['tool_call_id'] }}\n{{ m['content'] }}<|im_end|>"
        "{%- elif m['role'] == 'assistant' %}<|im_assistant|>assistant<|im_middle|>"
        "{{ m['content'] or '' }}"
        "{%- if m['tool_calls'] %}<|tool_calls_section_begin|>"
        "{%- for c in m['tool_calls'] %}<|tool_call_begin|>{{ c['id'] }}"
        "<|tool_call_argument_begin|>{{ c['function']['arguments'] }}<|tool_call_end|>"
        "{%- endfor %}<|tool_calls_section_end|>{%- endif %}<|im_end|>"
        "{%- else %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}"
        "<|im_end|>{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{%- endif %}"
    )


def kimi_checkpoint(folder, *, special: bool):
    """The embedded model with :func:`template`; ``special``: Kimi's markers are added
    special tokens of its tokenizer (ids 512 on, the model's rows for them random)."""
    shutil.copytree(default_model_path(), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if not special:
        return folder
    spec = json.loads((folder / "tokenizer.json").read_text())
    added = [*MARKERS, *TURNS]
    for i, content in enumerate(added, start=512):
        spec["added_tokens"].append({"id": i, "content": content, "single_word": False,
            "lstrip": False, "rstrip": False, "normalized": False, "special": True})  # fmt: skip
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    weights = load_file(folder / "model.safetensors")
    rng = torch.Generator().manual_seed(0)
    for name, scale in (("lm_head.weight", 0.13), ("model.embed_tokens.weight", 1.0)):
        rows = torch.randn(len(added), weights[name].shape[1], generator=rng) * scale
        weights[name] = torch.cat([weights[name], rows])
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    model = json.loads((folder / "config.json").read_text())
    model["vocab_size"] = 512 + len(added)
    (folder / "config.json").write_text(json.dumps(model))
    return folder


@pytest.fixture(scope="module", params=["special", "plain"])
def engine(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("kimi") / "ckpt"
    return load(kimi_checkpoint(folder, special=request.param == "special"), pool_bytes=2**22)


def check_calls(calls, names):
    """``calls``: (id, name, arguments) each, a call of one of ``names`` valid for its schema."""
    assert calls, "no tool call"
    for call_id, name, arguments in calls:
        assert ID.fullmatch(call_id) and ID.fullmatch(call_id).group(1) == name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def client_calls(message):
    return [(c.id, c.function.name, c.function.arguments) for c in message.tool_calls]


@pytest.mark.parametrize(
    ("choice", "parallel"), [("required", False), ("required", True), ("set_unit", True)]
)
def test_greedy_answers_under_the_grammar_are_valid_calls(engine, choice, parallel):
    tok, h = engine.checkpoint.tokenizer, Harness(engine)
    grammars = Grammars(tok, engine.checkpoint.config.vocab_size)
    compiled = grammars.compile_tools(SPECS, choice, parallel, None, KIMI_K2)
    reqs = [
        h.submit(prompt(seed, 12), 200, grammar=grammars.matcher(compiled)) for seed in range(6)
    ]
    h.run()
    names = set(SCHEMAS) if choice == "required" else {choice}
    stopped = 0
    for req in reqs:
        ids = [t for t in h.answer(req) if t not in tok.eos_token_ids]
        parts = Splitter(reasoning=None, tools=KIMI_K2).feed(tok.decode(ids), final=True)
        if h.finish_reason(req) == "length":  # parallel calls may go on: the cut-off section
            assert parallel and parts.content.startswith(BEGIN[:1]) and not parts.calls
            continue
        stopped += 1
        assert parts.content == "", parts
        check_calls([(c.id, c.name, c.arguments) for c in parts.calls], names)
        if not parallel or choice != "required":
            assert len(parts.calls) == 1
    assert stopped >= 3


def test_the_grammar_can_write_the_markers_special_tokens(engine):
    """At every step of a call, the token that comes next (a marker's own token where the
    tokenizer has one) is one the mask allows."""
    tok = engine.checkpoint.tokenizer
    grammars = Grammars(tok, engine.checkpoint.config.vocab_size)
    special = tok.token_to_id(BEGIN) is not None
    one = BEGIN + call("set_unit", 3, '{"unit": "F"}') + END
    for choice, parallel, text in (
        ("required", False, one),
        ("set_unit", False, one),
        ("required", True, TWO.replace("get_time", "set_unit").replace("{}", '{"unit": "C"}')
         .replace('"Paris"}', '"Paris", "days": 2}')),
        ("auto", True, "Checking. " + one + " and " + one),
    ):  # fmt: skip
        matcher = grammars.matcher(grammars.compile_tools(SPECS, choice, parallel, None, KIMI_K2))
        ids = tok.encode(text)
        assert (tok.token_to_id(BEGIN) in ids) == special
        for i in ids:
            logits = torch.zeros(1, engine.checkpoint.config.vocab_size)
            matcher.apply(logits)
            assert logits[0, i] == 0 and matcher.accept(i), (choice, tok.decode([i]))
        eos = tok.eos_token_ids[0]
        assert matcher.accept(eos) and matcher.done
    # One call, then the section ends: a second is refused without parallel calls, or named.
    for choice, parallel in (("required", False), ("set_unit", True)):
        matcher = grammars.matcher(grammars.compile_tools(SPECS, choice, parallel, None, KIMI_K2))
        second = one.replace(END, "") + "<|tool_call_begin|>"
        assert not all(matcher.accept(i) for i in tok.encode(second))


def test_unknown_parsers_are_refused(tmp_path, capsys, monkeypatch):
    from kern.cli import _parser
    from kern.engine.targets import resolve_target
    from kern.errors import UsageError
    from kern.kern_toml import TomlConfigError, load_toml_config
    from kern.server.settings import Settings

    config = tmp_path / "kern.toml"
    config.write_text('[targets.a]\ncheckpoint = "c"\ntool_parser = "kimi_k2"\n'
                      '[targets.b]\ncheckpoint = "c"\n')  # fmt: skip
    toml = load_toml_config(config)
    assert (toml.target("a").tool_parser, toml.target("b").tool_parser) == ("kimi_k2", "qwen3")
    config.write_text('[targets.a]\ncheckpoint = "c"\ntool_parser = "hermes"\n')
    with pytest.raises(TomlConfigError, match="targets.a.tool_parser: 'hermes' is not one of "):
        load_toml_config(config)
    target, _ = resolve_target(
        config=None, target=None, model=None, overrides={"tool_parser": "kimi_k2"}
    )
    assert target.tool_parser == "kimi_k2" and target.where("tool_parser") == "--tool-call-parser"
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--tool-call-parser", "hermes"])
    assert "argument --tool-call-parser: invalid choice: 'hermes'" in capsys.readouterr().err
    monkeypatch.setenv("KERN_TOOL_CALL_PARSER", "hermes")
    with pytest.raises(UsageError, match="KERN_TOOL_CALL_PARSER='hermes' is not one of qwen3"):
        Settings.from_env()


# --- a real server -------------------------------------------------------------------------------

ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kimi-serve")
    (tmp / "kimi.jinja").write_text(template())
    ckpt = kimi_checkpoint(tmp / "ckpt", special=True)
    extra = ("--tool-call-parser", "kimi_k2", "--chat-template", str(tmp / "kimi.jinja"))
    srv = Server(tmp, "kimi", pool_bytes="4MiB", model=ckpt, extra=extra)
    yield srv
    srv.close()


@pytest.mark.parametrize("bias", [False, True])
def test_required_calls_stream_as_whole_and_come_back(server, bias):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    # The bias makes the model write each marker as its special token (it cannot fit in the
    # schemas' strings), which the default skip_special_tokens would have left out.
    extra = {"logit_bias": {str(i): 40 for i in range(512, 517)}} if bias else {}
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
                  max_tokens=200, parallel_tool_calls=False, **extra)  # fmt: skip
    whole = client.chat.completions.create(**kwargs, extra_body={"return_token_ids": True})
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(client_calls(choice.message), set(SCHEMAS))
    if bias:
        assert 512 in choice.model_extra["token_ids"]
    with client.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    assert client_calls(streamed.message) == client_calls(choice.message)
    # The next turn: the calls and their results, rendered by the template with their ids.
    turn = [*ASK, choice.message.model_dump(exclude_none=True)]
    turn += [{"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"}
             for c in choice.message.tool_calls]  # fmt: skip
    again = client.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, max_tokens=6)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    rendered = server.http.post("/tokenize", json={"messages": turn, "tools": TOOLS}).json()
    assert again.usage.prompt_tokens == rendered["count"]
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    text = server.http.post("/detokenize", json={"tokens": rendered["tokens"]}).json()["prompt"]
    c = choice.message.tool_calls[0]
    assert f"<|tool_call_begin|>{c.id}<|tool_call_argument_begin|>{c.function.arguments}" in text
    assert f"<|im_system|>tool<|im_middle|>## Return of {c.id}\nsunny, 21 C<|im_end|>" in text


def test_named_and_auto(server):
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 200}
    named = {"type": "function", "function": {"name": "set_unit"}}
    # Skipping special tokens would drop the markers: they are kept by default, and a request
    # that asks for them skipped is refused by name, not silently overridden.
    for skip in (None, False):
        r = server.http.post(
            "/v1/chat/completions",
            json={**body, "tool_choice": named, "skip_special_tokens": skip},
        ).json()
        [c] = r["choices"][0]["message"]["tool_calls"]
        assert ID.fullmatch(c["id"]).group(1) == c["function"]["name"] == "set_unit"
    r = server.http.post(
        "/v1/chat/completions", json={**body, "tool_choice": named, "skip_special_tokens": True}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "skip_special_tokens", r.text
    assert "kimi_k2 tool-call markers" in r.json()["error"]["message"]
    for choice in ("auto", "none"):
        r = server.http.post("/v1/chat/completions", json={**body, "tool_choice": choice})
        assert r.status_code == 200, r.text
