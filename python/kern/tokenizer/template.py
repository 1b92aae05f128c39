"""The chat template, rendered the way ``transformers`` renders it: a sandboxed (immutable)
jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``tojson`` filter that keeps non-ASCII text, and the globals templates call
(``raise_exception``, ``strftime_now``)."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplateError", "compile_chat_template"]


class ChatTemplateError(ValueError):
    """The chat template is missing, does not compile, or refused the messages.

    A server answers it with a 400: it is the request (or the checkpoint) that is wrong.
    """


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template refused the messages: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators=None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes HTML characters and ASCII-fies text; templates written for
    # transformers expect plain json.dumps output.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str, where: str) -> Template:
    """``source`` compiled as a chat template; :class:`ChatTemplateError` naming ``where``."""
    try:
        return _environment().from_string(source)
    except TemplateError as e:
        raise ChatTemplateError(f"{where}: chat template does not compile: {e}") from e


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
