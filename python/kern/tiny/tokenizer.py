"""The tiny checkpoints' tokenizer: a byte-level BPE learned here, deterministically.

Design notes
------------
* The tokenizer mirrors Qwen's pipeline (NFC normalizer, Qwen's split regex, byte-level BPE,
  ``<|endoftext|>``/``<|im_start|>``/``<|im_end|>`` after the regular vocabulary), trained on
  the small corpus below until the vocabulary reaches ``vocab`` ids.
* The BPE merges are learned here, in plain Python with an explicit tie-break (count, then
  the pair's text), rather than with the ``tokenizers`` trainer, whose tie order we do not
  control.
"""

from __future__ import annotations

import unicodedata
from collections import Counter
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# Qwen2/Qwen3's pre-tokenizer split (from their tokenizer.json).
_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# A Qwen3-style template written for kern: tools go into the system turn as JSON lines, the
# model calls them as <tool_call>{json}</tool_call>, results come back as <tool_response> in a
# user turn, and enable_thinking=false writes an empty <think> block.
CHAT_TEMPLATE = """\
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


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )


def build_tokenizer(vocab_size: int) -> tuple[Tokenizer, dict[str, int]]:
    """A byte-level BPE tokenizer of at most ``vocab_size`` ids, specials last."""
    min_size = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(f"vocab must be at least {min_size} (256 bytes + special tokens)")
    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    pre = _pre_tokenizer()
    text = unicodedata.normalize("NFC", _CORPUS)
    for special in SPECIAL_TOKENS:  # specials are never split, so never learned from
        text = text.replace(special, "\n")
    words = Counter(tuple(piece) for piece, _ in pre.pre_tokenize_str(text))
    merges: list[tuple[str, str]] = []
    target = vocab_size - len(SPECIAL_TOKENS)
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
        [AddedToken(s, special=True, normalized=False, single_word=False) for s in SPECIAL_TOKENS]
    )
    special_ids = {s: tok.token_to_id(s) for s in SPECIAL_TOKENS}
    return tok, special_ids


def _merge(word: tuple[str, ...], pair: tuple[str, str], merged: str) -> tuple[str, ...]:
    out = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == pair[0] and word[i + 1] == pair[1]:
            out.append(merged)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def tokenizer_config(special_ids: dict[str, int]) -> dict[str, Any]:
    added = {
        str(i): {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for s, i in special_ids.items()
    }
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
