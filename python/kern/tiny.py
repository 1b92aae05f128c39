"""Tiny random-weight checkpoints of every family, deterministic from a seed.

``make_tiny("qwen3", DIR)`` writes a complete Hugging Face folder — ``config.json``,
``generation_config.json``, ``model.safetensors`` (or shards and an index), ``tokenizer.json``,
``tokenizer_config.json`` with a Qwen chat template — that both kern and ``transformers`` load,
so the runner can be tested against the oracle with no network and no download.

Design notes
------------
* Bit-identical output for the same arguments, on any machine: every file is written from
  sorted, fixed data. Each tensor has its own ``torch.Generator`` seeded from a hash of
  (seed, tensor name), so adding a layer does not change the tensors of the others. The BPE
  merges are learned here, in plain Python with an explicit tie-break (count, then the pair's
  text), rather than with the ``tokenizers`` trainer, whose tie order we do not control.
* Weights are not transformers' init. Its N(0, 0.02) gives this 64-wide model logits with a
  standard deviation of 0.17, so greedy picks hang on small gaps, and changing the six tokens
  before the last moved the last logits by at most 0.58. Here matrices are N(0, 1/fan_in) and
  the (untied) embedding N(0, 1): logit std 1.07, and the same context change moves them by
  2.8, so a runner with broken attention or positions cannot pass an oracle test by luck
  (greedy text changes token from step to step, see tests/test_tiny.py). A tied embedding is
  scaled down (see ``_weights``). Norm weights are their neutral value (1, or 0 for Qwen3.5's
  zero-centered RMSNorm, which scales by 1 + w) plus N(0, 0.1), so a runner that gets the
  offset wrong is caught. Qwen3.5's decay parameters keep the recurrent state alive for a few
  tokens (A in [0.05, 1]), so a runner that drops or mixes up states is caught too.
* The tokenizer mirrors Qwen's pipeline (NFC normalizer, Qwen's split regex, byte-level BPE,
  ``<|endoftext|>``/``<|im_start|>``/``<|im_end|>`` after the regular vocabulary), trained on
  the small corpus below until the vocabulary reaches ``vocab`` ids.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import math
import unicodedata
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from kern.checkpoint import expected_shapes, parse_dtype
from kern.model_config import FAMILIES, ModelConfig, parse_config

__all__ = ["DEFAULT_MODEL_ARGS", "SPECIAL_TOKENS", "default_model_path", "make_tiny"]

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# The embedded default model (python/kern/assets/tiny-qwen3) is make_tiny("qwen3", DIR,
# **DEFAULT_MODEL_ARGS); tests/test_tiny.py regenerates it and compares bytes.
DEFAULT_MODEL_ARGS: dict[str, Any] = {"seed": 0}

_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": dict(
        layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=512
    ),
    "qwen3_5": dict(
        layers=4,
        hidden=64,
        heads=4,
        kv_heads=2,
        head_dim=32,
        intermediate=128,
        vocab=512,
        linear_key_heads=2,
        linear_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        conv_kernel=4,
        full_attention_interval=2,
    ),
    "qwen3_moe": dict(
        layers=2,
        hidden=64,
        heads=4,
        kv_heads=2,
        head_dim=16,
        intermediate=128,
        vocab=512,
        experts=8,
        experts_per_tok=2,
        moe_intermediate=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=(),
    ),
}

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


def default_model_path() -> Path:
    """The tiny qwen3 checkpoint shipped inside the package (``kern serve`` with no model)."""
    path = importlib.resources.files("kern").joinpath("assets", "tiny-qwen3")
    if not isinstance(path, Path):
        # A zipped install: kern loads weights with mmap and needs real files.
        raise RuntimeError(f"the embedded model is not on the filesystem ({path})")
    return path


def make_tiny(
    family: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    intermediate: int | None = None,
    vocab: int | None = None,
    experts: int | None = None,
    experts_per_tok: int | None = None,
    moe_intermediate: int | None = None,
    norm_topk_prob: bool | None = None,
    decoder_sparse_step: int | None = None,
    mlp_only_layers: Sequence[int] | None = None,
    linear_key_heads: int | None = None,
    linear_value_heads: int | None = None,
    linear_key_head_dim: int | None = None,
    linear_value_head_dim: int | None = None,
    conv_kernel: int | None = None,
    full_attention_interval: int | None = None,
    tie_embeddings: bool = False,
    dtype: str = "float32",
    shards: int = 1,
    overwrite: bool = False,
) -> Path:
    """Write a random-weight checkpoint of ``family`` to ``out_dir``; returns ``out_dir``.

    Sizes left as None take the family's tiny defaults (``_DEFAULTS``); options that do not
    apply to the family (``experts`` for ``qwen3``) must be None. ``dtype`` is the stored
    dtype (``float32``/``bfloat16``/``float16``); ``shards > 1`` writes
    ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``.

    Raises ``ValueError`` for an unknown family or an option that does not apply,
    :class:`~kern.model_config.ConfigFieldError` for inconsistent sizes, and ``FileExistsError``
    when ``out_dir`` is not empty and ``overwrite`` is false. Same arguments, same bytes.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r} (one of {', '.join(FAMILIES)})")
    given = dict(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
        vocab=vocab,
        experts=experts,
        experts_per_tok=experts_per_tok,
        moe_intermediate=moe_intermediate,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=decoder_sparse_step,
        mlp_only_layers=mlp_only_layers,
        linear_key_heads=linear_key_heads,
        linear_value_heads=linear_value_heads,
        linear_key_head_dim=linear_key_head_dim,
        linear_value_head_dim=linear_value_head_dim,
        conv_kernel=conv_kernel,
        full_attention_interval=full_attention_interval,
    )
    args = dict(_DEFAULTS[family])
    for key, value in given.items():
        if value is None:
            continue
        if key not in args:
            raise ValueError(f"option {key!r} does not apply to family {family!r}")
        args[key] = value
    if shards < 1:
        raise ValueError(f"shards must be at least 1, got {shards}")
    storage_dtype = parse_dtype(dtype)

    tokenizer, special_ids = _build_tokenizer(args["vocab"])
    config_json = _config_json(family, args, special_ids, tie_embeddings, dtype)
    config = parse_config(config_json, source=f"make_tiny({family!r})")

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out}: not empty (pass overwrite=True / --force to replace)")
    out.mkdir(parents=True, exist_ok=True)
    tensors = _weights(config, seed, storage_dtype)
    _write_weights(out, tensors, shards)
    _write_json(out / "config.json", config_json)
    _write_json(
        out / "generation_config.json",
        {
            "bos_token_id": special_ids["<|endoftext|>"],
            "eos_token_id": [special_ids["<|im_end|>"], special_ids["<|endoftext|>"]],
            "pad_token_id": special_ids["<|endoftext|>"],
        },
    )
    (out / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    _write_json(out / "tokenizer_config.json", _tokenizer_config(special_ids))
    return out


def _config_json(
    family: str, a: dict[str, Any], special: dict[str, int], tie: bool, dtype: str
) -> dict[str, Any]:
    n = a["layers"]
    cfg: dict[str, Any] = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": special["<|endoftext|>"],
        "dtype": dtype,
        "eos_token_id": special["<|im_end|>"],
        "head_dim": a["head_dim"],
        "hidden_act": "silu",
        "hidden_size": a["hidden"],
        "initializer_range": 0.02,
        "intermediate_size": a["intermediate"],
        "max_position_embeddings": 8192,
        "num_attention_heads": a["heads"],
        "num_hidden_layers": n,
        "num_key_value_heads": a["kv_heads"],
        "pad_token_id": special["<|endoftext|>"],
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tie,
        "use_cache": True,
        "vocab_size": a["vocab"],
    }
    if family == "qwen3":
        cfg.update(
            architectures=["Qwen3ForCausalLM"],
            model_type="qwen3",
            layer_types=["full_attention"] * n,
            max_window_layers=n,
            rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
            sliding_window=None,
            use_sliding_window=False,
        )
    elif family == "qwen3_moe":
        cfg.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            decoder_sparse_step=a["decoder_sparse_step"],
            mlp_only_layers=sorted(a["mlp_only_layers"]),
            moe_intermediate_size=a["moe_intermediate"],
            norm_topk_prob=a["norm_topk_prob"],
            num_experts=a["experts"],
            num_experts_per_tok=a["experts_per_tok"],
            output_router_logits=False,
            rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"},
            router_aux_loss_coef=0.001,
            sliding_window=None,
            use_sliding_window=False,
        )
    else:
        interval = a["full_attention_interval"]
        cfg.update(
            # The text-only form; published Qwen3.5 checkpoints nest this under text_config of
            # a multimodal "qwen3_5" config, which kern reads as well.
            architectures=["Qwen3_5ForCausalLM"],
            model_type="qwen3_5_text",
            layer_types=[
                "linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)
            ],
            linear_conv_kernel_dim=a["conv_kernel"],
            linear_key_head_dim=a["linear_key_head_dim"],
            linear_num_key_heads=a["linear_key_heads"],
            linear_num_value_heads=a["linear_value_heads"],
            linear_value_head_dim=a["linear_value_head_dim"],
            rope_parameters={
                "partial_rotary_factor": 0.25,
                "rope_theta": 10000000.0,
                "rope_type": "default",
            },
        )
    return dict(sorted(cfg.items()))


def _weights(config: ModelConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    zero_centered = config.model_type == "qwen3_5"
    tensors = {}
    for name, shape in expected_shapes(config).items():
        digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        leaf = name.rsplit(".", 2)
        if name.endswith("norm.weight"):
            # linear_attn.norm is a plain gated RMSNorm (scales by w) even in Qwen3.5.
            plain = not zero_centered or name.endswith("linear_attn.norm.weight")
            t = (1.0 if plain else 0.0) + 0.1 * noise
        elif leaf[-1] == "A_log":
            u = torch.rand(shape, generator=gen, dtype=torch.float32)
            t = torch.log(0.05 + 0.95 * u)
        elif leaf[-1] == "dt_bias":
            t = 1.0 + 0.1 * noise
        elif name.endswith("conv1d.weight"):
            t = noise / math.sqrt(shape[-1])
        elif name.endswith(".bias"):
            t = 0.02 * noise
        elif name == "model.embed_tokens.weight":
            # Tied, the embedding is also the output head, and the residual stream carries the
            # last token's own row into its logits: at std 1 greedy text repeats one token from
            # the first step. The self term shrinks with the square of the scale, the others
            # linearly; at 1/(4 sqrt(hidden)) greedy text varies (logit std ~0.25).
            t = noise / (4 * math.sqrt(shape[1])) if config.tie_word_embeddings else noise
        else:  # projections, the router, lm_head: [out, in]
            t = noise / math.sqrt(shape[-1])
        tensors[name] = t.to(dtype).contiguous()
    return tensors


def _write_weights(out: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    metadata = {"format": "pt"}
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata=metadata)
        return
    names = list(tensors)
    per = math.ceil(len(names) / shards)
    weight_map = {}
    total = 0
    for k in range(shards):
        part = {n: tensors[n] for n in names[k * per : (k + 1) * per]}
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(out / file), metadata=metadata)
        for n, t in part.items():
            weight_map[n] = file
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(out / "model.safetensors.index.json", index)


def _write_json(file: Path, value: Any) -> None:
    file.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


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


def _build_tokenizer(vocab_size: int) -> tuple[Tokenizer, dict[str, int]]:
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


def _tokenizer_config(special_ids: dict[str, int]) -> dict[str, Any]:
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
