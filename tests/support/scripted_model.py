"""A tiny qwen3 checkpoint whose answers are scripted: one tool call, then (once a tool result
is in the conversation) one fixed line of text. The coding-agent tests serve it with ``kern
serve --model DIR`` so that an agent's turn goes the same way every time: the model calls the
tool, the agent runs it and sends the result back, the model answers.

How it works
------------
* The weights make a first-order Markov chain: every layer's ``o_proj`` and ``down_proj`` are
  zero, so the residual stream at a position is the current token's embedding and nothing
  else; the final RMSNorm (weight 1) turns ``c * e_k`` into ``sqrt(hidden) * e_k``; the
  ``lm_head`` row of the token that must follow has ``MARGIN`` in column ``k``, every other
  row zeros. The next token is a function of the current one, by a logit margin of
  ``sqrt(hidden) * MARGIN`` (160 at the tiny width, 64): greedy, and sampled at any ordinary
  temperature, alike.
  Every token the script does not name shares state 0, whose successor is ``<|im_end|>``
  (the end of sequence): any other prompt gets an empty answer.
* The script's tokens are added to the tokenizer, so each step is one token: after the
  special token :data:`CALL_MARK`, ``<tool_call>`` -> one token holding
  ``\\n{"name": NAME, "arguments": ARGS}\\n`` -> ``</tool_call>`` -> ``<|im_end|>``; after
  :data:`ANSWER_MARK`, one token holding the answer -> ``<|im_end|>``. ``<tool_call>`` and
  ``</tool_call>`` are plain (non-special) added tokens as in Qwen3's tokenizers: kern's
  qwen3 tool parser reads them from the answer's text.
* The chat template (:data:`CHAT_TEMPLATE`) renders every turn as Qwen's ``<|im_start|>ROLE``
  blocks (tools as JSON lines in a system block, calls as ``<tool_call>`` blocks, results as
  ``<tool_response>`` blocks) and ends the generation prompt with :data:`ANSWER_MARK` when a
  tool result is in the conversation, with :data:`CALL_MARK` otherwise. So the answer is text
  only because the tool's result came back: the call round-tripped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer

from kern.tiny import make_tiny

__all__ = [
    "ANSWER_MARK",
    "CALL_MARK",
    "CHAT_TEMPLATE",
    "MARGIN",
    "call_text",
    "chain_weights",
    "make_scripted",
]

CALL_MARK = "<|script_call|>"
ANSWER_MARK = "<|script_answer|>"
EOS = "<|im_end|>"
MARGIN = 20.0
# The context the checkpoint declares: the agents' prompts are long, and Claude Code asks
# for 32000 output tokens.
CONTEXT = 131072

CHAT_TEMPLATE = """\
{%- macro text_of(content) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is iterable %}
        {%- for part in content %}
            {%- if part is string %}
                {{- part }}
            {%- elif part['text'] is defined %}
                {{- part['text'] }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}
{%- if tools %}
    {{- '<|im_start|>system\\n# Tools\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' ~ (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(tool_result=false) %}
{%- for message in messages %}
    {%- if message['role'] == 'tool' %}
        {%- set ns.tool_result = true %}
        {{- '<|im_start|>user\\n<tool_response>\\n' ~ text_of(message['content']) }}
        {{- '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' ~ message['role'] ~ '\\n' ~ text_of(message['content']) }}
        {%- if message['tool_calls'] is defined and message['tool_calls'] %}
            {%- for call in message['tool_calls'] %}
                {%- set call = call['function'] if call['function'] is defined else call %}
                {{- '<tool_call>\\n{"name": ' ~ (call['name'] | tojson) ~ ', "arguments": ' }}
                {%- if call['arguments'] is string %}
                    {{- call['arguments'] }}
                {%- else %}
                    {{- call['arguments'] | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' ~ ('@ANSWER@' if ns.tool_result else '@CALL@') }}
{%- endif %}
""".replace("@ANSWER@", ANSWER_MARK).replace("@CALL@", CALL_MARK)


def call_text(name: str, arguments: dict[str, Any]) -> str:
    """What a ``<tool_call>`` block holds, as kern's qwen3 grammar writes it."""
    return f'\n{{"name": {json.dumps(name)}, "arguments": {json.dumps(arguments)}}}\n'


def make_scripted(
    out: Path, *, tool: str, arguments: dict[str, Any], answer: str, vocab_multiple: int = 64
) -> Path:
    """Write the scripted checkpoint to ``out`` (made or empty): it calls ``tool`` with
    ``arguments``, and answers ``answer`` once a tool result is in the conversation. The
    model's vocabulary is the tokenizer's rounded up to ``vocab_multiple`` ids, as released
    checkpoints pad theirs (Qwen3: 151669 tokens, 151936 rows)."""
    make_tiny("qwen3", out, max_position_embeddings=CONTEXT)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    plain = ["<tool_call>", call_text(tool, arguments), "</tool_call>", answer]
    marks = [CALL_MARK, ANSWER_MARK]
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in marks])
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in plain])
    ids = {t: tok.token_to_id(t) for t in [*marks, *plain, EOS]}
    assert len(set(ids.values())) == len(ids), ids
    size = tok.get_vocab_size(with_added_tokens=True)
    vocab = -(-size // vocab_multiple) * vocab_multiple
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")

    config = json.loads((out / "tokenizer_config.json").read_text())
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    for text in [*marks, *plain]:
        special = text in marks
        config["added_tokens_decoder"][str(ids[text])] = {
            "content": text, **flags, "special": special
        }  # fmt: skip
    config["chat_template"] = CHAT_TEMPLATE
    config["model_max_length"] = CONTEXT
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")

    model = json.loads((out / "config.json").read_text())
    model["vocab_size"] = vocab
    (out / "config.json").write_text(json.dumps(model, indent=2) + "\n")

    chain = [
        (CALL_MARK, "<tool_call>"),
        ("<tool_call>", plain[1]),
        (plain[1], "</tool_call>"),
        ("</tool_call>", EOS),
        (ANSWER_MARK, answer),
        (answer, EOS),
    ]
    chain_weights(out, ids, chain, EOS, vocab, ("o_proj.weight", "down_proj.weight"))
    return out


def chain_weights(
    out: Path,
    ids: dict[str, int],
    chain: list[tuple[str, str]],
    end: str,
    vocab: int,
    zeroed: tuple[str, ...],
) -> None:
    """Rewrite ``out``'s weights as the Markov chain (see the notes): each ``(token,
    following)`` of ``chain`` a state of its own, every other token state 0 (followed by
    ``end``); the tensors whose names end with ``zeroed`` (what writes into the residual
    stream) all zeros."""
    tensors = load_file(str(out / "model.safetensors"))
    hidden = tensors["model.norm.weight"].shape[0]
    assert len(chain) < hidden
    embed = tensors["model.embed_tokens.weight"][:0].new_zeros(vocab, hidden)
    head = embed.clone()
    embed[:, 0] = 1.0  # state 0: every token the script does not name
    head[ids[end], 0] = MARGIN
    for k, (token, following) in enumerate(chain, start=1):
        embed[ids[token]] = 0.0
        embed[ids[token], k] = 1.0
        head[ids[following], k] = MARGIN
    tensors["model.embed_tokens.weight"] = embed.contiguous()
    tensors["lm_head.weight"] = head.contiguous()
    tensors["model.norm.weight"] = tensors["model.norm.weight"].new_ones(hidden)
    for name in list(tensors):
        if name.endswith(zeroed):
            tensors[name] = tensors[name].new_zeros(tensors[name].shape)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
