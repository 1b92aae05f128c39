"""Kimi's tokenizer read from its ``tiktoken.model``, as a ``tokenizers`` byte-level BPE.

Kimi checkpoints (Kimi K2, Kimi-Linear) ship no ``tokenizer.json``: their tokenizer is a tiktoken
BPE file (one ``<base64 token bytes> <rank>`` line per token) plus Python code,
``tokenization_kimi.py``, that other servers run with ``trust_remote_code``. kern runs no remote
code: it converts the file, in memory, into the same ``tokenizers.Tokenizer`` every other
checkpoint gives it, so decoding, streaming, ``token_bytes`` and chat prompts work unchanged.

Design notes
------------
* What the remote code does, restated: a ``tiktoken.Encoding`` over the file's ranks with the
  split pattern :data:`KIMI_PATTERN`, and special tokens at the ids right after the ranks, named
  by ``tokenizer_config.json``'s ``added_tokens_decoder`` (``[BOS]`` first, ``[PAD]`` at the
  256th), ``<|reserved_token_{id}|>`` for ids it leaves out. Kimi's code makes two ids more
  than its 256 (its range ends at ``N + 258``); those lie past the model's embedding
  (``vocab_size`` is ``N + 256``), so kern stops at 256 and text spelling them stays plain text.
* tiktoken's BPE joins, again and again, the adjacent pair whose concatenation has the lowest
  rank (the leftmost of equals). A ``tokenizers`` BPE joins pairs by a merge list: here one
  merge per token, ordered by the token's rank, namely the two parts tiktoken's own BPE holds
  just before it builds that token from the token's bytes alone (:func:`_last_merge`). Inside
  any longer text a token can only form from those same two parts (its bytes evolve as they
  would alone until it forms), so no other pair is ever needed. A token its own bytes never
  build gets no merge: tiktoken reaches it only as a whole pre-tokenized piece, which
  ``ignore_merges`` (look the piece up before merging) reproduces.
* The tokenizers' regex engine (Oniguruma) reads the pattern's class intersections
  (``[\\p{Lu}...&&[^\\p{Han}]]``) as tiktoken's does: every code point, in a few contexts
  each, splits the same (checked once, tokenizers 0.23.3 against tiktoken 0.14.0), and
  ``tests/test_kimi_tokenizer.py`` compares ids with the ``tiktoken`` package over mixed-script
  text. Kimi's code also cuts a text with over 25,000 characters of unbroken (non-)whitespace
  into pieces before calling tiktoken; kern, like tiktoken's own ``encode``, does not, so such
  a text may differ from Kimi's at the cuts.
* What kern cannot read exactly is refused, naming the file: a malformed line, ranks that
  are not ``0..N-1``, a byte without a rank (tiktoken could not encode it), a special token id
  among the ranks or past the 256, a special token that is also a rank's text (a
  ``tokenizers`` vocabulary cannot give one string two ids), and a ``tokenizer_class`` other
  than Kimi's ``TikTokenTokenizer`` (another family's tiktoken file needs its own pattern).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from kern.checkpoint.errors import CheckpointError, MissingFileError, UnsupportedTokenizerError

__all__ = [
    "HARMONY_CALL",
    "HARMONY_FILE",
    "KIMI_PATTERN",
    "KIMI_TOKENIZER_CLASS",
    "NUM_SPECIAL_IDS",
    "TIKTOKEN_FILE",
    "format_ranks",
    "kimi_special_tokens",
    "harmony_backend",
    "missing_tokenizer_error",
    "O200K_PATTERN",
    "ranks_backend",
    "read_ranks",
    "tiktoken_backend",
]

TIKTOKEN_FILE = "tiktoken.model"
KIMI_TOKENIZER_CLASS = "TikTokenTokenizer"
# Ids kept for special tokens after the ranks (Kimi's num_reserved_special_tokens).
NUM_SPECIAL_IDS = 256

# Kimi's pre-tokenizer split, alternative by alternative: Han runs; words of other scripts
# (optionally capitalized, with an English contraction); numbers of up to three digits;
# punctuation runs; newlines; whitespace.
KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)


# o200k (openai-harmony's o200k_harmony): the split, then harmony's named special tokens at
# their ids, every other id up to HARMONY_END a reserved one.
O200K_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
HARMONY_FILE = "o200k_base.tiktoken"
HARMONY_FIRST_SPECIAL = 199998
HARMONY_END = 201088
HARMONY_SPECIALS = {
    199998: "<|startoftext|>",
    199999: "<|endoftext|>",
    200002: "<|return|>",
    200003: "<|constrain|>",
    200005: "<|channel|>",
    200006: "<|start|>",
    200007: "<|end|>",
    200008: "<|message|>",
    200012: "<|call|>",
}
HARMONY_CALL = 200012  # <|call|>: ends an assistant's tool call, an end id beside <|return|>


def read_ranks(file: Path) -> list[bytes]:
    """The tokens of a tiktoken BPE file, in rank order (index = rank = token id).

    Raises :class:`CheckpointError` naming the file and line for anything tiktoken would
    misread or could not encode with."""
    try:
        raw = file.read_bytes()
    except OSError as e:
        raise MissingFileError(f"{file}: cannot read: {e}") from e
    by_rank: dict[int, bytes] = {}
    line_of: dict[bytes, int] = {}
    for n, line in enumerate(raw.splitlines(), start=1):
        fields = line.split()
        if not fields:
            continue  # tiktoken skips blank lines too
        where = f"{file}: line {n}"
        if len(fields) != 2:
            raise CheckpointError(
                f"{where}: expected '<base64 token bytes> <rank>', got {_shown(line)}"
            )
        try:
            token = base64.b64decode(fields[0], validate=True)
        except (binascii.Error, ValueError):
            raise CheckpointError(f"{where}: {_shown(fields[0])} is not base64") from None
        if not fields[1].isdigit():
            raise CheckpointError(f"{where}: rank {_shown(fields[1])} is not a whole number")
        rank = int(fields[1])
        if not token:
            raise CheckpointError(f"{where}: the token is empty")
        if token in line_of:
            raise CheckpointError(f"{where}: token {token!r} is already on line {line_of[token]}")
        if rank in by_rank:
            raise CheckpointError(f"{where}: rank {rank} is given twice")
        by_rank[rank] = token
        line_of[token] = n
    missing = next((r for r in range(len(by_rank)) if r not in by_rank), None)
    if missing is not None:
        raise CheckpointError(
            f"{file}: ranks must be 0..{len(by_rank) - 1} with none left out; "
            f"rank {missing} is missing (the largest is {max(by_rank)})"
        )
    tokens = [by_rank[r] for r in range(len(by_rank))]
    for b in range(256):
        if bytes([b]) not in line_of:
            raise CheckpointError(
                f"{file}: byte 0x{b:02x} has no rank (every single byte needs one, or text "
                "holding it cannot be encoded)"
            )
    return tokens


def _shown(field: bytes) -> str:
    return repr(field[:60].decode("utf-8", "replace"))


def format_ranks(tokens: Sequence[bytes]) -> str:
    """The text of a tiktoken BPE file whose ranks are ``tokens``' indices."""
    return "".join(f"{base64.b64encode(t).decode('ascii')} {r}\n" for r, t in enumerate(tokens))


def kimi_special_tokens(
    config: Mapping[str, Any], config_file: Path, ranks_file: Path, num_ranks: int
) -> list[str]:
    """The special tokens' texts for ids ``num_ranks ..`` (:data:`NUM_SPECIAL_IDS` of them),
    from ``added_tokens_decoder``, reserved names for ids it leaves out."""
    listed = config.get("added_tokens_decoder") or {}
    if not isinstance(listed, dict):
        raise CheckpointError(f"{config_file}: field 'added_tokens_decoder' must be an object")
    end = num_ranks + NUM_SPECIAL_IDS
    names: dict[int, str] = {}
    for key, entry in listed.items():
        content = entry.get("content") if isinstance(entry, dict) else entry
        if not key.isdigit() or not isinstance(content, str) or not content:
            raise CheckpointError(
                f"{config_file}: added_tokens_decoder[{key!r}] must map a token id to an "
                "object with a non-empty string 'content'"
            )
        token_id = int(key)
        if token_id < num_ranks:
            raise CheckpointError(
                f"{config_file}: added_tokens_decoder gives {content!r} id {token_id}, which "
                f"is rank {token_id} of {ranks_file} (special token ids start at {num_ranks}, "
                "after its ranks)"
            )
        if token_id >= end:
            raise CheckpointError(
                f"{config_file}: added_tokens_decoder gives {content!r} id {token_id}, past "
                f"the {NUM_SPECIAL_IDS} special token ids {num_ranks}..{end - 1} that follow "
                f"the ranks of {ranks_file}"
            )
        names[token_id] = content
    out = [names.get(i, f"<|reserved_token_{i}|>") for i in range(num_ranks, end)]
    first: dict[str, int] = {}
    for i, content in enumerate(out, start=num_ranks):
        if content in first:
            raise CheckpointError(
                f"{config_file}: special token {content!r} has two ids, {first[content]} and {i}"
            )
        first[content] = i
    return out


def missing_tokenizer_error(folder: Path, config: Mapping[str, Any]) -> MissingFileError:
    """The refusal of a folder with neither ``tokenizer.json`` nor ``tiktoken.model``; it names
    what ``tokenizer_config.json``'s ``tokenizer_class`` would need instead, if it has one."""
    cls = config.get("tokenizer_class")
    needs = ""
    if isinstance(cls, str):
        needs = f"; its tokenizer_class {cls!r} needs " + (
            "its own remote code (auto_map), which kern does not run"
            if "auto_map" in config
            else "files kern does not read"
        )
    return MissingFileError(
        f"{folder / 'tokenizer.json'}: no such file (kern reads tokenizers from "
        f"tokenizer.json, or Kimi's {TIKTOKEN_FILE}){needs}"
    )


def harmony_backend(folder: Path) -> tokenizers.Tokenizer:
    """gpt-oss's o200k_harmony from a folder's ``o200k_base.tiktoken`` (no tokenizer.json):
    the o200k ranks with their split pattern and harmony's special tokens at the ids after
    them, as openai-harmony builds it (its last reserved id, 201088, lies past gpt-oss's
    embedding of 201,088 rows and is left out, as Kimi's two extra ids are)."""
    ranks_file = folder / HARMONY_FILE
    tokens = read_ranks(ranks_file)
    if len(tokens) != HARMONY_FIRST_SPECIAL:
        raise CheckpointError(
            f"{ranks_file}: {len(tokens)} ranks, where o200k_base has {HARMONY_FIRST_SPECIAL} "
            "(harmony's special tokens take the ids after them)"
        )
    specials = [
        HARMONY_SPECIALS.get(i, f"<|reserved_{i}|>")
        for i in range(HARMONY_FIRST_SPECIAL, HARMONY_END)
    ]
    return ranks_backend(tokens, specials, where=str(ranks_file), pattern=O200K_PATTERN)


def tiktoken_backend(folder: Path, config: Mapping[str, Any]) -> tokenizers.Tokenizer:
    """The ``tokenizers.Tokenizer`` of a Kimi folder's ``tiktoken.model`` (no ``tokenizer.json``)
    with ``config``, its parsed ``tokenizer_config.json``.

    Raises :class:`MissingFileError` without ``tokenizer_config.json``,
    :class:`UnsupportedTokenizerError` when it names a class other than Kimi's, and
    :class:`CheckpointError` for a file kern cannot read exactly."""
    ranks_file = folder / TIKTOKEN_FILE
    config_file = folder / "tokenizer_config.json"
    if not config_file.is_file():
        raise MissingFileError(
            f"{config_file}: no such file (a {TIKTOKEN_FILE} tokenizer takes its special "
            "tokens from it)"
        )
    cls = config.get("tokenizer_class")
    if cls != KIMI_TOKENIZER_CLASS:
        raise UnsupportedTokenizerError(
            f"{config_file}: tokenizer_class is {cls!r}, not Kimi's {KIMI_TOKENIZER_CLASS!r}: "
            f"kern reads {ranks_file} (with no tokenizer.json) only as Kimi's tokenizer, with "
            "its split pattern and special tokens, and runs no remote code"
        )
    tokens = read_ranks(ranks_file)
    specials = kimi_special_tokens(config, config_file, ranks_file, len(tokens))
    return ranks_backend(tokens, specials, where=str(ranks_file))


def ranks_backend(
    tokens: Sequence[bytes], specials: Sequence[str], *, where: str, pattern: str = KIMI_PATTERN
) -> tokenizers.Tokenizer:
    """A byte-level BPE equal to tiktoken's over ``tokens`` (rank order) with the split
    ``pattern`` (Kimi's by default), and ``specials`` as special tokens at the ids after the
    ranks."""
    to_char = _byte_chars()
    text = ["".join(to_char[b] for b in t) for t in tokens]
    vocab = {s: r for r, s in enumerate(text)}
    ranks = {t: r for r, t in enumerate(tokens)}
    merges = []
    for token in tokens:
        pair = _last_merge(token, ranks) if len(token) > 1 else None
        if pair is not None:
            merges.append((text[ranks[pair[0]]], text[ranks[pair[1]]]))
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    for content in specials:
        if content in vocab:
            raise CheckpointError(
                f"{where}: special token {content!r} is also the text of rank "
                f"{vocab[content]}, and a tokenizer cannot give one text two ids"
            )
    # Added one by one in id order, each takes the next id: num_ranks, num_ranks + 1, ...
    backend.add_special_tokens(
        [AddedToken(s, special=True, normalized=False, single_word=False) for s in specials]
    )
    for i, content in enumerate(specials, start=len(tokens)):
        if backend.token_to_id(content) != i:  # cannot happen after the check above
            raise CheckpointError(f"{where}: special token {content!r} did not get id {i}")
    return backend


def _last_merge(token: bytes, ranks: Mapping[bytes, int]) -> tuple[bytes, bytes] | None:
    """The two parts tiktoken's BPE joins last when it encodes ``token``'s bytes alone, or None
    when it never builds ``token`` from them.

    Most tokens split into two ranked parts at one place only, and then those are the
    parts (the BPE can end in no other two); the BPE itself runs when there are several."""
    cuts = [k for k in range(1, len(token)) if token[:k] in ranks and token[k:] in ranks]
    if len(cuts) == 1:
        # Also right for a token the BPE never builds: that pair is then never adjacent
        # over the token's bytes, so its merge never fires.
        return token[: cuts[0]], token[cuts[0] :]
    if not cuts:
        return None
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = None, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best is None or rank < best):
                best, at = rank, i
        if best is None:
            return None
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts[0], parts[1]


def _byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: byte -> the printable character that stands for it."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]
