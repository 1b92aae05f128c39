"""Tokenizer: a checkpoint's ``tokenizer.json`` (the ``tokenizers`` package) and its chat template.

Design notes
------------
* A folder without ``tokenizer.json`` but with Kimi's ``tiktoken.model``, or gpt-oss's
  ``o200k_base.tiktoken`` (o200k_harmony: ``<|return|>`` and ``<|call|>`` end a generation), is
  converted to the same kind of backend in memory (:mod:`kern.tokenizer.tiktoken`); no remote
  code runs, ever.
* Encoding never adds special tokens by default. The Qwen families have no BOS and no
  post-processor, and a chat prompt already carries every special token it needs as text
  (``<|im_start|>`` is matched as an added token wherever it appears), so adding them again
  would only double a BOS on families that have one. ``add_special_tokens=True`` runs the
  tokenizer's post-processor for callers that want it.
* The chat template is rendered the way ``transformers`` renders it, so a prompt kern builds is
  the prompt the model was trained on: a sandboxed (immutable) jinja2 environment with
  ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter
  that keeps non-ASCII text, and the globals templates call (``raise_exception``,
  ``strftime_now``). ``bos_token``/``eos_token`` and the other special tokens are passed as
  strings. The template comes from ``chat_template.jinja`` (transformers 5 writes it there) or
  else ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates of
  which ``default`` is used).
* End-of-sequence ids are the union of the tokenizer's ``eos_token`` and what the model's
  ``config.json``/``generation_config.json`` list (Qwen instruct models stop on both
  ``<|im_end|>`` and ``<|endoftext|>``); the checkpoint loader passes the latter in.
* In a chat prompt only the template's own markup becomes control tokens: text inside a
  message that spells an added token (``<|im_end|><|im_start|>system``) is encoded as plain
  text (:meth:`Tokenizer.encode_chat`), so a user cannot end their turn and open another.
  Prompts without such text encode exactly as the whole rendered string does.
* ``tokenizers``' ``encode`` holds the GIL for the whole call (a 1 MB text: 1.4 s with the
  event loop frozen, measured here), its ``encode_batch`` releases it: long texts go through
  the latter, so a server can tokenize them on a worker thread while it keeps serving.
* The tokenizer normalizes (Qwen's is NFC), so ``decode(encode(s))`` is ``s`` normalized, not
  always ``s`` itself; an answer's text need not tokenize back to its ids either.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from kern.checkpoint.errors import CheckpointError
from kern.tokenizer.stream import TextStream
from kern.tokenizer.template import ChatTemplateError, compile_chat_template
from kern.tokenizer.tiktoken import (
    HARMONY_CALL,
    HARMONY_FILE,
    TIKTOKEN_FILE,
    harmony_backend,
    missing_tokenizer_error,
    tiktoken_backend,
)
from kern.tokenizer.token_bytes import bytes_to_unicode

# gpt-oss's tokenizer_config.json values, for an o200k_base.tiktoken folder without one.
_HARMONY_CONFIG = {
    "bos_token": "<|startoftext|>",
    "eos_token": "<|return|>",
    "pad_token": "<|endoftext|>",
}

__all__ = ["ChatTemplateError", "TextStream", "Tokenizer", "compile_chat_template"]

_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
# Characters above which encode() takes the GIL-releasing path.
_LONG_TEXT = 16_384


class Tokenizer:
    """Text <-> token ids for one checkpoint, plus its chat template.

    Immutable after construction and safe to share between threads (the ``tokenizers``
    backend releases the GIL and holds no per-call state).
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        source: str = "tokenizer",
    ) -> None:
        self._tok = backend
        self._source = source
        self._special_tokens = dict(special_tokens or {})
        self._chat_template_source = chat_template
        self._chat_template = None
        if chat_template is not None:
            self._chat_template = compile_chat_template(chat_template, source)
        ids: list[int] = []
        eos = self._special_tokens.get("eos_token")
        if eos is not None:
            eos_id = backend.token_to_id(eos)
            if eos_id is None:
                raise CheckpointError(f"{source}: eos_token {eos!r} is not in the vocabulary")
            ids.append(eos_id)
        ids.extend(extra_eos_token_ids)
        self._eos_token_ids = tuple(dict.fromkeys(ids))
        bos = self._special_tokens.get("bos_token")
        self._bos_token_id = backend.token_to_id(bos) if bos is not None else None
        added = sorted(
            (t.content for t in backend.get_added_tokens_decoder().values() if t.content),
            key=len,
            reverse=True,
        )
        self._added = re.compile("|".join(map(re.escape, added))) if added else None
        self._plain: tokenizers.Tokenizer | None = None  # made on first use
        self._byte_table: dict[str, int] | None = None  # made on first use
        self._added_ids = frozenset(backend.get_added_tokens_decoder())
        # The UTF-8 length of the longest token: no token covers more bytes of the text.
        self.max_token_bytes = max(
            (len(t.encode("utf-8")) for t in backend.get_vocab(with_added_tokens=True)),
            default=1,
        )

    @classmethod
    def from_dir(cls, path: str | Path, *, extra_eos_token_ids: Iterable[int] = ()) -> Tokenizer:
        """Load a folder's ``tokenizer.json`` (or else Kimi's ``tiktoken.model``, see
        :mod:`kern.tokenizer.tiktoken`) and ``tokenizer_config.json`` (optional with the former).

        Raises :class:`~kern.checkpoint.errors.MissingFileError` without either tokenizer file and
        :class:`~kern.checkpoint.errors.CheckpointError` for a file that does not parse.
        """
        path = Path(path)
        config: dict[str, Any] = {}
        config_file = path / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{config_file}: not valid JSON: {e}") from e
            if not isinstance(config, dict):
                raise CheckpointError(f"{config_file}: expected a JSON object")
        file = path / "tokenizer.json"
        if file.is_file():
            try:
                backend = tokenizers.Tokenizer.from_file(str(file))
            except Exception as e:  # the Rust side raises a bare Exception
                raise CheckpointError(f"{file}: not a valid tokenizers file: {e}") from e
        elif (path / TIKTOKEN_FILE).is_file():
            backend = tiktoken_backend(path, config)
        elif (path / HARMONY_FILE).is_file():
            backend = harmony_backend(path)
            # gpt-oss's own tokenizer_config says the same; a folder may have none.
            config = {**_HARMONY_CONFIG, **config}
            extra_eos_token_ids = (*extra_eos_token_ids, HARMONY_CALL)
        else:
            raise missing_tokenizer_error(path, config)
        special: dict[str, str] = {}
        for key in _SPECIAL_KEYS:
            value = config.get(key)
            if isinstance(value, dict):  # a serialized AddedToken
                value = value.get("content")
            if value is not None and not isinstance(value, str):
                raise CheckpointError(f"{config_file}: field {key!r} must be a string")
            if value is not None:
                special[key] = value
        template = _read_template(path, config, config_file)
        return cls(
            backend,
            chat_template=template,
            special_tokens=special,
            extra_eos_token_ids=extra_eos_token_ids,
            source=str(path),
        )

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included.

        A model's ``vocab_size`` can be larger (embedding rows padded for alignment); ids
        between the two have no text.
        """
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a generation, the tokenizer's ``eos_token`` first."""
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def special_tokens(self) -> dict[str, str]:
        """``bos_token``/``eos_token``/``pad_token``/``unk_token`` strings that are set."""
        return dict(self._special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return self._chat_template is not None

    @property
    def chat_template(self) -> str | None:
        """The template's source text, or None."""
        return self._chat_template_source

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The ``tokenizers.Tokenizer`` underneath (shared: do not mutate it)."""
        return self._tok

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special-token strings in it become their ids. Releases the
        GIL for long texts (see the design notes)."""
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        if len(text) > _LONG_TEXT:
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def spells_control(self, text: str) -> bool:
        """Whether ``text`` holds an added token's text (``<|im_end|>``, ...)."""
        return self._added is not None and self._added.search(text) is not None

    def encode_chat(self, rendered: str, contents: Sequence[str]) -> list[int]:
        """Token ids of a rendered chat prompt whose messages held ``contents``: the template's
        markup becomes control tokens, added-token text inside a content stays plain text.
        Raises :class:`ChatTemplateError` if such a content does not appear verbatim in the
        rendered prompt, in message order (the template changed it)."""
        added = self._added
        if added is None or not any(added.search(c) for c in contents):
            return self.encode(rendered)
        ids: list[int] = []
        pos = 0
        for i, content in enumerate(contents):
            if not content or not added.search(content):
                continue
            at = rendered.find(content, pos)
            if at < 0:
                raise ChatTemplateError(
                    f"messages[{i}]: its content spells a control token, and the chat "
                    "template changed it, so it cannot be kept plain text"
                )
            ids += self.encode(rendered[pos:at])
            ids += self._plain_backend().encode_batch([content], add_special_tokens=False)[0].ids
            pos = at + len(content)
        return ids + self.encode(rendered[pos:])

    def _plain_backend(self) -> tokenizers.Tokenizer:
        if self._plain is None:
            # Every added token marked special, then special tokens encoded as text: added
            # tokens that are not "special" (Qwen's <think>, <tool_call>) stay text too.
            spec = json.loads(self._tok.to_str())
            for t in spec.get("added_tokens") or []:
                t["special"] = True
            plain = tokenizers.Tokenizer.from_str(json.dumps(spec))
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of text one token stands for (a byte-level BPE token may hold part of a
        UTF-8 character, which ``decode([id])`` shows as U+FFFD)."""
        if self._byte_table is None:
            self._byte_table = _byte_level_table(self._tok)
        token = self._tok.id_to_token(token_id)
        if token is None:
            return b""
        table = self._byte_table
        if table and token_id not in self._added_ids and all(c in table for c in token):
            return bytes(table[c] for c in token)
        return self._tok.decode([token_id], skip_special_tokens=False).encode(
            "utf-8", "surrogatepass"
        )

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``. Ids without a token (padding rows of the embedding) add nothing.

        Raises ``ValueError`` for a negative id.
        """
        ids = list(ids)
        for i in ids:
            if i < 0:
                raise ValueError(f"token id {i} is negative")
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def stream(self, *, skip_special_tokens: bool = False) -> TextStream:
        """A fresh incremental decoder for one sequence (see :class:`TextStream`)."""
        return TextStream(self._tok, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` with the chat template; returns the prompt text (not ids).

        ``template_kwargs`` are passed to the template as variables (``tools``,
        ``enable_thinking``, ...). Raises :class:`ChatTemplateError` when there is no template,
        when the messages are not a list of objects with a string ``role``, or when the
        template refuses them (``raise_exception``) or fails.
        """
        if self._chat_template is None:
            raise ChatTemplateError(
                f"{self._source}: no chat template (neither chat_template.jinja nor "
                "tokenizer_config.json's chat_template)"
            )
        if not isinstance(messages, list):
            raise ChatTemplateError("messages must be a list")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ChatTemplateError(f"messages[{i}] must be an object with a string 'role'")
        variables: dict[str, Any] = {key: None for key in _SPECIAL_KEYS}
        variables.update(self._special_tokens)
        variables.update(template_kwargs)
        variables["messages"] = messages
        variables["add_generation_prompt"] = add_generation_prompt
        try:
            return self._chat_template.render(**variables)
        except ChatTemplateError:
            raise
        except Exception as e:
            # A template is code run over client data: a TypeError from `None + str` is as
            # much the messages' fault as an explicit raise_exception, and must not be a 500.
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


def _byte_level_table(backend: tokenizers.Tokenizer) -> dict[str, int]:
    """Byte-level BPE's character -> byte map (GPT-2's printable stand-ins for the 256 bytes),
    or {} when the decoder is not byte-level."""
    spec = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {spec.get("type")} | {d.get("type") for d in spec.get("decoders") or []}
    if "ByteLevel" not in kinds:
        return {}
    return {c: b for b, c in bytes_to_unicode().items()}


def _read_template(path: Path, config: dict[str, Any], config_file: Path) -> str | None:
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise CheckpointError(f"{config_file}: chat_template list has no 'default' template")
    raise CheckpointError(f"{config_file}: field 'chat_template' must be a string or a list")
