"""The tiny checkpoints' tokenizer: a byte-level BPE learned here, deterministically.

Design notes
------------
* The tokenizer mirrors Qwen's pipeline (NFC normalizer, Qwen's split regex, byte-level BPE,
  ``<|endoftext|>``/``<|im_start|>``/``<|im_end|>`` after the regular vocabulary), trained on
  the small corpus below until the vocabulary reaches ``vocab`` ids.
* The BPE merges are learned here, in plain Python with an explicit tie-break (count, then
  the pair's text), rather than with the ``tokenizers`` trainer, whose tie order we do not
  control.
* :func:`write_tiktoken_tokenizer` writes a Kimi-style folder instead (``tiktoken.model``, no
  ``tokenizer.json``): byte-level merges learned the same way on bytes, split by Kimi's
  pattern, Kimi's special tokens at Kimi's offsets after the ranks, and a chat template in
  Kimi K2's format. ``auto_map`` names Kimi's remote code as real folders do; kern never
  runs it (``kern.tokenizer.tiktoken`` reads the folder).
"""

from __future__ import annotations

import json
import unicodedata
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from kern.tokenizer.tiktoken import (
    KIMI_PATTERN,
    KIMI_TOKENIZER_CLASS,
    NUM_SPECIAL_IDS,
    format_ranks,
)
from kern.tokenizer.token_bytes import bytes_to_unicode

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# gpt-oss's harmony markers, in o200k_harmony's id order (a tiny gpt_oss's last ids).
HARMONY_TOKENS = (
    "<|startoftext|>",
    "<|endoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
)

# Qwen2/Qwen3's pre-tokenizer split (from their tokenizer.json).
_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Both templates take a message's text (a string, or text parts) with this macro.
_TEXT_OF = """\
{%- macro text_of(message) %}
    {%- if message['content'] is string %}
        {{- message['content'] }}
    {%- elif message['content'] is not defined or message['content'] is none %}
    {%- else %}
        {%- for part in message['content'] %}
            {%- if part['type'] != 'text' %}
                {{- raise_exception('Only text content parts are supported') }}
            {%- endif %}
            {{- part['text'] }}
        {%- endfor %}
    {%- endif %}
{%- endmacro %}
"""

# A Qwen3-style template written for kern: tools go into the system turn as JSON lines, the
# model calls them as <tool_call>{json}</tool_call>, results come back as <tool_response> in a
# user turn, and enable_thinking=false writes an empty <think> block.
CHAT_TEMPLATE = (
    _TEXT_OF
    + """\
{%- set first_system = messages and messages[0]['role'] == 'system' %}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if first_system %}
        {{- text_of(messages[0]) ~ '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nFunctions you may call, one JSON signature per line:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' ~ (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nTo call one, answer with its name and arguments as JSON:\\n' }}
    {{- '<tool_call>\\n{"name": <name>, "arguments": <arguments>}\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set role = message['role'] %}
    {%- if role not in ['system', 'user', 'assistant', 'tool'] %}
        {{- raise_exception('Unknown role: ' ~ role) }}
    {%- endif %}
    {%- if role == 'system' and loop.first and tools %}
    {%- elif role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' ~ text_of(message) ~ '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' ~ role ~ '\\n' ~ text_of(message) }}
        {%- if role == 'assistant' and message['tool_calls'] %}
            {%- for call in message['tool_calls'] %}
                {%- set call = call['function'] if call['function'] is defined else call %}
                {%- if not loop.first or text_of(message) %}
                    {{- '\\n' }}
                {%- endif %}
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
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving engine answers many requests at once,
and every answer must be the same as the one it would give alone. When the cache is full, the
coldest prefix is parked in host memory; when host memory is full, it is dropped.
Once upon a time there was a small model that lived inside a wheel. It knew five hundred
words, and it said them in an order that nobody could predict, but it always said the same
thing when it was asked the same question. The engineers liked it for that.
<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
What is the capital of France?<|im_end|>
<|im_start|>assistant
The capital of France is Paris.<|im_end|>
<|im_start|>user
Write a function that adds two numbers.<|im_end|>
<|im_start|>assistant
def add(a: int, b: int) -> int:
    return a + b

for i in range(10):
    print(i, add(i, i * 2))
<|im_end|>
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2048 3.14159 1e-6 65536.
import torch
x = torch.randn(4, 64)
y = x @ w.T + b
if y.sum() > 0:
    raise ValueError("unexpected value")
class Request:
    def __init__(self, prompt_ids, max_tokens=16):
        self.prompt_ids = list(prompt_ids)
        self.max_tokens = max_tokens
The weather today is sunny with a light breeze from the west. Tomorrow it will rain, and the
day after that the wind will turn to the north. People walk their dogs in the park, children
play on the grass, and an old man reads a newspaper on a bench under the trees.
Café, naïve, résumé, Zürich, São Paulo, Kraków.
日本語のテキスト。中文文本。 Ελληνικά. Русский текст.
Emoji: 🙂 🚀 ✨. Symbols: <= >= != == -> => ... ---- **** #### @@ && || :: ;;
{"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
Question: how many tokens does this sentence have? Answer: it depends on the tokenizer.
"""


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )


def build_tokenizer(
    vocab_size: int, specials: tuple[str, ...] = SPECIAL_TOKENS
) -> tuple[Tokenizer, dict[str, int]]:
    """A byte-level BPE tokenizer of at most ``vocab_size`` ids, ``specials`` last."""
    min_size = 256 + len(specials)
    if vocab_size < min_size:
        raise ValueError(f"vocab must be at least {min_size} (256 bytes + special tokens)")
    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    pre = _pre_tokenizer()
    text = unicodedata.normalize("NFC", _CORPUS)
    for special in (*SPECIAL_TOKENS, *specials):  # never split, so never learned from
        text = text.replace(special, "\n")
    words = Counter(tuple(piece) for piece, _ in pre.pre_tokenize_str(text))
    merges: list[tuple[str, str]] = []
    target = vocab_size - len(specials)
    while len(vocab) < target:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += count
        if not pairs:
            break  # the corpus is exhausted: a smaller vocabulary than asked, like real models
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merged = best[0] + best[1]
        merges.append(best)
        vocab.setdefault(merged, len(vocab))
        words = Counter({_merge(word, best, merged): c for word, c in words.items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(s, special=True, normalized=False, single_word=False) for s in specials]
    )
    special_ids = {s: tok.token_to_id(s) for s in specials}
    return tok, special_ids


_Sym = TypeVar("_Sym", str, bytes)


def _merge(word: tuple[_Sym, ...], pair: tuple[_Sym, _Sym], merged: _Sym) -> tuple[_Sym, ...]:
    out: list[_Sym] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == pair[0] and word[i + 1] == pair[1]:
            out.append(merged)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _added_tokens(special_ids: dict[str, int]) -> dict[str, Any]:
    """tokenizer_config.json's ``added_tokens_decoder``: every id a special token."""
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    return {str(i): {"content": s, **flags, "special": True} for s, i in special_ids.items()}


def harmony_tokenizer_config(special_ids: dict[str, int]) -> dict[str, Any]:
    """A tiny gpt_oss's tokenizer_config.json: gpt-oss's special tokens, no chat template
    (kern renders harmony prompts itself, kern.chat_formats.harmony_prompt)."""
    return {
        "added_tokens_decoder": _added_tokens(special_ids),
        "bos_token": "<|startoftext|>",
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|return|>",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def tokenizer_config(special_ids: dict[str, int]) -> dict[str, Any]:
    added = _added_tokens(special_ids)
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 8192,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


# Kimi's named special tokens by their offset after the ranks (Kimi K2's and Kimi-Linear's
# tokenizer_config.json); the offsets between are reserved ids.
KIMI_SPECIAL_TOKENS = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|start_header_id|>": 6,
    "<|end_header_id|>": 7,
    "[EOT]": 9,
    "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11,
    "<|tool_calls_section_end|>": 12,
    "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14,
    "<|tool_call_end|>": 15,
    "<|im_middle|>": 17,
    "[UNK]": 254,
    "[PAD]": 255,
}

# Kimi K2's chat format, written for kern: tools declared as compact JSON in a tool_declare
# system turn (keys sorted, as Kimi's tokenizer sorts them before rendering), a default system
# turn, tool calls as <|tool_call_begin|>{id}<|tool_call_argument_begin|>{arguments} in a
# section after the assistant's text, tool results in a "tool" system turn.
KIMI_CHAT_TEMPLATE = (
    _TEXT_OF
    + """\
{%- if tools %}
    {{- '<|im_system|>tool_declare<|im_middle|>' }}
    {{- tools | tojson(separators=(',', ':'), sort_keys=true) }}
    {{- '<|im_end|>' }}
{%- endif %}
{%- if not messages or messages[0]['role'] != 'system' %}
    {{- '<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.' }}
    {{- '<|im_end|>' }}
{%- endif %}
{%- for message in messages %}
    {%- set role = message['role'] %}
    {%- if role == 'user' %}
        {{- '<|im_user|>user<|im_middle|>' ~ text_of(message) }}
    {%- elif role == 'system' %}
        {{- '<|im_system|>system<|im_middle|>' ~ text_of(message) }}
    {%- elif role == 'tool' %}
        {%- if message['tool_call_id'] is not string %}
            {{- raise_exception('A tool message needs a tool_call_id') }}
        {%- endif %}
        {{- '<|im_system|>tool<|im_middle|>## Return of ' ~ message['tool_call_id'] ~ '\\n' }}
        {{- text_of(message) }}
    {%- elif role == 'assistant' %}
        {{- '<|im_assistant|>assistant<|im_middle|>' ~ text_of(message) }}
        {%- if message['tool_calls'] %}
            {{- '<|tool_calls_section_begin|>' }}
            {%- for call in message['tool_calls'] %}
                {%- set fn = call['function'] if call['function'] is defined else call %}
                {%- set id = call['id'] if call['id'] is string
                    else 'functions.' ~ fn['name'] ~ ':' ~ loop.index0 %}
                {{- '<|tool_call_begin|>' ~ id ~ '<|tool_call_argument_begin|>' }}
                {%- if fn['arguments'] is string %}
                    {{- fn['arguments'] }}
                {%- else %}
                    {{- fn['arguments'] | tojson }}
                {%- endif %}
                {{- '<|tool_call_end|>' }}
            {%- endfor %}
            {{- '<|tool_calls_section_end|>' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unknown role: ' ~ role) }}
    {%- endif %}
    {{- '<|im_end|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_assistant|>assistant<|im_middle|>' }}
{%- endif %}
"""
)

# Text in Kimi's chat format, beside the shared corpus, so the markup's words get merges.
_KIMI_CORPUS = """\
system tool_declare user assistant tool functions.get_weather:0 functions.search:1
## Return of functions.get_weather:0
{"city": "Beijing", "unit": "celsius"} {"temperature": 21, "condition": "sunny"}
You are Kimi, an AI assistant created by Moonshot AI. 北京今天天气晴朗。我们明天去公园。
"""


@dataclass(frozen=True)
class KimiTokenizerFiles:
    """What :func:`write_tiktoken_tokenizer` wrote, for the folder's ``config.json``."""

    num_ranks: int  # tokens of tiktoken.model; the special tokens' ids follow
    vocab_size: int  # num_ranks + 256 special ids: config.json's vocab_size
    bos_token_id: int  # [BOS]
    eos_token_id: int  # <|im_end|>, which Kimi-Linear's config.json names (eos_token is [EOS])
    special_ids: dict[str, int]  # the named special tokens (KIMI_SPECIAL_TOKENS) -> id


def write_tiktoken_tokenizer(out_dir: Path, *, merges: int = 400) -> KimiTokenizerFiles:
    """Write a Kimi-style tokenizer into ``out_dir``: ``tiktoken.model`` (the 256 bytes, then
    up to ``merges`` merged tokens learned from the built-in corpus) and
    ``tokenizer_config.json`` (special tokens, chat template). Deterministic."""
    tokens = learn_byte_merges(_CORPUS + _KIMI_CORPUS, merges)
    n = len(tokens)
    special_ids = {s: n + offset for s, offset in KIMI_SPECIAL_TOKENS.items()}
    added = _added_tokens(special_ids)
    config = {
        "added_tokens_decoder": added,
        "additional_special_tokens": [s for s in KIMI_SPECIAL_TOKENS if s.startswith("<|")],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]",
        "chat_template": KIMI_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "model_max_length": 8192,
        "pad_token": "[PAD]",
        "tokenizer_class": KIMI_TOKENIZER_CLASS,
        "unk_token": "[UNK]",
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tiktoken.model").write_text(format_ranks(tokens), encoding="ascii")
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return KimiTokenizerFiles(
        num_ranks=n,
        vocab_size=n + NUM_SPECIAL_IDS,
        bos_token_id=special_ids["[BOS]"],
        eos_token_id=special_ids["<|im_end|>"],
        special_ids=special_ids,
    )


def learn_byte_merges(corpus: str, merges: int) -> list[bytes]:
    """The 256 single bytes, then the tokens of up to ``merges`` BPE merges learned on
    ``corpus`` split by Kimi's pattern (a merge that rebuilds a known token adds none)."""
    split = pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated", invert=False)
    pieces = Counter(p.encode("utf-8") for p, _ in split.pre_tokenize_str(corpus))
    words = Counter({tuple(p[i : i + 1] for i in range(len(p))): c for p, c in pieces.items()})
    tokens = [bytes([b]) for b in range(256)]
    known = set(tokens)
    for _ in range(merges):
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += count
        if not pairs:
            break  # every word is one token
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merged = best[0] + best[1]
        if merged not in known:
            known.add(merged)
            tokens.append(merged)
        words = Counter({_merge(word, best, merged): c for word, c in words.items()})
    return tokens
