"""A request's prompt as token ids: a text, or chat messages rendered through the checkpoint's
template (the client's texts in it kept plain), refused before tokenizing when it cannot fit
the context; and ids a client sends, checked against the vocabulary."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from kern.chat_formats.harmony_prompt import EFFORTS
from kern.chat_formats.harmony_prompt import render as render_harmony
from kern.server import api
from kern.server.api import ApiError
from kern.tokenizer import ChatTemplateError, Tokenizer

__all__ = ["Prompts"]

# The variables a harmony prompt takes from chat_template_kwargs (it has no template).
_HARMONY_KWARGS = ("reasoning_effort", "conversation_start_date")

# Characters above which a prompt is tokenized on a worker thread.
_THREAD_TEXT = 16_384


class Prompts:
    """Prompts for one tokenizer and model; every refusal is an ``ApiError`` naming ``param``."""

    def __init__(self, tokenizer: Tokenizer, *, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._affixes: tuple[list[int], list[int]] | None = None
        self._mid_system: bool | None = None

    def renders_mid_system(self) -> bool:
        """Whether the chat template renders a system message after the first turn as one
        (Qwen3's does); some raise on one or drop it, and a dropped message would be an input
        accepted and ignored. Probed once, by rendering one."""
        if self._mid_system is None:
            mark = "kern-probe-8f3a"
            probe = [
                {"role": "user", "content": "u"},
                {"role": "assistant", "content": "a"},
                {"role": "system", "content": mark},
                {"role": "user", "content": "v"},
            ]
            try:
                text = self.tokenizer.apply_chat_template(probe, True)
            except ChatTemplateError:
                text = ""
            self._mid_system = mark in text
        return self._mid_system

    def special_affixes(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer's ``add_special_tokens`` puts before and after a text's own
        (a BOS, say; none for Qwen's): what a rendered chat prompt gets when a request asks
        for them, as its pieces are encoded apart (``Tokenizer.encode_chat``)."""
        if self._affixes is None:
            plain = self.tokenizer.encode("a", add_special_tokens=False)
            full = self.tokenizer.encode("a", add_special_tokens=True)
            at = next((i for i in range(len(full)) if full[i : i + len(plain)] == plain), None)
            if at is None:  # not a plain wrapping: nothing kern can add around pieces
                raise ApiError(
                    400,
                    "add_special_tokens: this tokenizer's special tokens are not a fixed "
                    "prefix and suffix",
                    param="add_special_tokens",
                )
            self._affixes = (full[:at], full[at + len(plain) :])
        return self._affixes

    def check_ids(self, ids: list[int], param: str) -> None:
        for i, t in enumerate(ids):
            if t >= self.vocab_size:
                raise ApiError(
                    400,
                    f"token id {t} is not below the vocabulary size {self.vocab_size}",
                    param=f"{param}[{i}]",
                    code="invalid_value",
                )

    async def encode(
        self,
        text: str,
        param: str,
        *,
        add_special_tokens: bool = False,
        contents: list[str] | None = None,
    ) -> list[int]:
        """Token ids of a prompt's text (a rendered chat prompt with its messages' ``contents``:
        their added-token text stays plain). Refuses, before tokenizing, a text too long to
        fit the context whatever it encodes to; tokenizes a long one on a worker thread, so
        the event loop keeps serving everyone else meanwhile."""
        size = len(text.encode("utf-8", "surrogatepass"))
        # No token covers more than max_token_bytes bytes of normalized text, and NFC at
        # most shrinks text threefold (decomposed Hangul): 4x that is a safe lower bound.
        least = size // (4 * self.tokenizer.max_token_bytes)
        if least > self.max_model_len:
            raise ApiError(
                400,
                f"the prompt is {size} bytes, at least {least} tokens: over the model's "
                f"context of {self.max_model_len} tokens",
                param=param,
                code="context_length_exceeded",
            )

        before, after = (
            self.special_affixes() if contents is not None and add_special_tokens else ([], [])
        )

        def encode() -> list[int]:
            if contents is not None:
                return before + self.tokenizer.encode_chat(text, contents) + after
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

        try:
            if len(text) > _THREAD_TEXT:
                return await asyncio.to_thread(encode)
            return encode()
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param=param) from None
        except Exception as e:  # e.g. a lone surrogate, which JSON allows and UTF-8 does not
            raise ApiError(400, f"cannot tokenize: {e}", param=param) from None

    def render(self, body: Any, *, harmony: bool) -> tuple[str, list[str]]:
        """A chat or tokenize request's prompt text and the client's texts in it: harmony's
        (:meth:`render_harmony`) for a harmony model, else the checkpoint's template, which
        takes no reasoning_effort of its own (chat_template_kwargs may carry one)."""
        effort = getattr(body, "reasoning_effort", None)
        if harmony:
            return self.render_harmony(
                body.messages,
                body.add_generation_prompt,
                body.chat_template_kwargs,
                body.tools,
                effort,
            )
        if effort is not None:
            raise ApiError(
                400,
                "reasoning_effort: this model takes it through chat_template_kwargs, if its "
                "template has one",
                param="reasoning_effort",
            )
        return self.render_chat(
            body.messages, body.add_generation_prompt, body.chat_template_kwargs, body.tools
        )

    def render_chat(
        self,
        messages: list[api.ChatMessage],
        add_generation_prompt: bool | None,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[api.Tool] | None = None,
    ) -> tuple[str, list[str]]:
        """The chat prompt's text and the client's texts in it, in order (messages' contents
        and their calls' arguments: kept plain text by :meth:`encode`)."""
        dicts: list[dict[str, Any]] = []
        contents: list[str] = []
        for m in messages:
            d: dict[str, Any] = {"role": m.role, "content": m.text()}
            contents.append(d["content"])
            if m.name is not None:
                d["name"] = m.name
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                d["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": c.function.arguments},
                    }
                    for c in m.tool_calls
                ]
                contents += [c.function.arguments for c in m.tool_calls]
            dicts.append(d)
        kwargs = dict(template_kwargs or {})
        if tools:
            if "tools" not in (self.tokenizer.chat_template or ""):
                raise ApiError(
                    400, "this model's chat template does not render tools", param="tools"
                )
            kwargs["tools"] = self._plain_tools([msgspec.to_builtins(t) for t in tools])
        try:
            text = self.tokenizer.apply_chat_template(
                dicts, add_generation_prompt is not False, **kwargs
            )
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages") from None
        return text, contents

    def _plain_tools(self, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``tools``, refused (naming the first) if one spells a control token: the prompt
        would turn its text into markup."""
        for i, t in enumerate(tools):
            if self.tokenizer.spells_control(msgspec.json.encode(t).decode()):
                raise ApiError(
                    400, f"tools[{i}] spells a control token of the tokenizer", param=f"tools[{i}]"
                )
        return tools

    def render_harmony(
        self,
        messages: list[api.ChatMessage],
        add_generation_prompt: bool | None,
        template_kwargs: dict[str, Any] | None,
        tools: list[api.Tool] | None,
        effort: str | None,
    ) -> tuple[str, list[str]]:
        """:meth:`render_chat` for a harmony model (kern.chat_formats.harmony_prompt): the
        prompt openai-harmony renders; ``effort`` (the request's reasoning_effort) or
        ``reasoning_effort`` in ``template_kwargs`` sets the system message's, and
        ``conversation_start_date`` its date. Any other kwarg is refused by name."""
        kwargs = dict(template_kwargs or {})
        for key in kwargs:
            if key not in _HARMONY_KWARGS:
                raise ApiError(
                    400,
                    f"chat_template_kwargs: {key!r} is not a harmony prompt's (it takes "
                    f"{', '.join(_HARMONY_KWARGS)})",
                    param="chat_template_kwargs",
                )
        effort = effort or kwargs.get("reasoning_effort") or "medium"
        if effort not in EFFORTS:
            raise ApiError(
                400,
                f"reasoning_effort {api.echo(effort)} is not one of {', '.join(EFFORTS)}",
                param="reasoning_effort",
            )
        date = kwargs.get("conversation_start_date")
        if date is not None and not isinstance(date, str):
            raise ApiError(
                400,
                "chat_template_kwargs.conversation_start_date must be a string",
                param="chat_template_kwargs",
            )
        dicts = [msgspec.to_builtins(m) for m in messages]
        for d, m in zip(dicts, messages, strict=True):
            d["content"] = m.text()
        specs = self._plain_tools([msgspec.to_builtins(t.function) for t in tools or ()])
        try:
            return render_harmony(
                dicts,
                specs,
                reasoning_effort=effort,
                date=date,
                add_generation_prompt=add_generation_prompt is not False,
            )
        except ValueError as e:
            raise ApiError(400, str(e), param="messages") from None
