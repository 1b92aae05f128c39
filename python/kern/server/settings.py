"""The server's settings (:class:`Settings`) and the API key's sources (:func:`api_key`),
which ``kern serve`` and the environment both go through."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kern.chat_formats import REASONING_PARSERS, TOOL_PARSERS
from kern.engine.targets import Selection, select
from kern.errors import UsageError
from kern.kern_toml import HOSTED_TOOLS, Target, TomlConfigError, grammar_timeout, parse_bytes
from kern.models.config import ModelConfig
from kern.server import logs
from kern.server.cors import parse_origins
from kern.tokenizer import ChatTemplateError, Tokenizer, compile_chat_template

__all__ = [
    "DEFAULT_BODY_TIMEOUT",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "DEFAULT_STATS_INTERVAL",
    "Settings",
    "api_key",
    "check_max_model_len",
    "read_chat_template",
    "served_names",
    "shutdown_timeout",
    "unknown_fields_env",
]

log = logging.getLogger("kern")

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_STATS_INTERVAL = 10.0
DEFAULT_BODY_TIMEOUT = 30.0
# Seconds the requests in flight get to finish after SIGTERM (kern.server.drain): inside
# Kubernetes' default terminationGracePeriodSeconds (30), after which it sends SIGKILL.
DEFAULT_SHUTDOWN_TIMEOUT = 25.0


@dataclass
class Settings:
    """How to serve: ``kern serve`` passes its flags; under ``hypercorn kern.app:app`` they come
    from the environment (:meth:`from_env`)."""

    # A checked target (kern.engine.targets); None: resolved from the environment.
    target: Target | None = None
    api_key: str | None = None
    max_body: int = DEFAULT_MAX_BODY_BYTES
    log_prompts: bool = False
    # Seconds between stats lines while there is work; 0: none.
    stats_interval: float = DEFAULT_STATS_INTERVAL
    # Seconds a client has to send a request body whole.
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    # Seconds ``kern serve`` lets the requests in flight finish after SIGTERM/SIGINT.
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    # The context a request may fill, prompt and answer (checked: at most the model's
    # max_position_embeddings); None: the model's.
    max_model_len: int | None = None
    # A chat template's text (read_chat_template) in place of the checkpoint's; None: its own.
    chat_template: str | None = None
    # Every model name a request may send, the first the one answers report (it is the
    # target's name); empty: the target's name alone.
    served_model_names: tuple[str, ...] = ()
    # Origins browser pages may call from (kern.server.cors); empty: CORS is off.
    allowed_origins: tuple[str, ...] = ()
    # KERN_ALLOW_UNKNOWN_FIELDS: an unknown request field is dropped and named in a warning
    # log line instead of a 400 naming it, as the target's allow_unknown_fields key says
    # (either turns it on).
    allow_unknown_fields: bool = False
    # Decode without CUDA graphs (``--enforce-eager``, ``KERN_ENFORCE_EAGER``); on a CUDA
    # target the app captures them at load otherwise.
    enforce_eager: bool = False

    def tokenizer(self, loaded: Tokenizer) -> Tokenizer:
        """The checkpoint's tokenizer, with :attr:`chat_template` in place of its template."""
        if self.chat_template is None:
            return loaded
        return Tokenizer(
            loaded.backend,
            chat_template=self.chat_template,
            special_tokens=loaded.special_tokens,
            extra_eos_token_ids=loaded.eos_token_ids,
            source="the served chat template",
        )

    @classmethod
    def from_env(cls) -> Settings:
        """``KERN_CONFIG`` + ``KERN_TARGET`` (a kern.toml target) or ``KERN_MODEL`` (a
        checkpoint folder), ``KERN_ROWS`` (as ``kern serve --rows``), ``KERN_API_KEY``,
        ``KERN_MAX_BODY_BYTES``, ``KERN_LOG_LEVEL``, ``KERN_LOG_PROMPTS``,
        ``KERN_STATS_INTERVAL``, ``KERN_SHUTDOWN_TIMEOUT``, ``KERN_REASONING_PARSER``,
        ``KERN_TOOL_CALL_PARSER``, ``KERN_HOSTED_TOOLS``,
        ``KERN_ALLOW_UNKNOWN_FIELDS``, ``KERN_MAX_MODEL_LEN``, ``KERN_CHAT_TEMPLATE`` (a file),
        ``KERN_SERVED_MODEL_NAME``, ``KERN_ALLOWED_ORIGINS`` (comma-separated),
        ``KERN_ENFORCE_EAGER`` (as ``--enforce-eager``),
        ``KERN_GRAMMAR_TIMEOUT`` and ``KERN_GRAMMAR_MAX_BYTES`` (as their flags). Raises
        ``UsageError`` naming the variable."""
        env = os.environ
        names: tuple[str, ...] = ()
        if env.get("KERN_SERVED_MODEL_NAME"):
            names = served_names(env["KERN_SERVED_MODEL_NAME"].split(","), "KERN_SERVED_MODEL_NAME")
        selection = _select(env, names[0] if names else None)
        out = cls(
            target=selection.target,
            api_key=api_key(
                None, Path(env["KERN_API_KEY_FILE"]) if "KERN_API_KEY_FILE" in env else None
            ),
            served_model_names=names,
        )
        if env.get("KERN_ALLOWED_ORIGINS"):
            out.allowed_origins = parse_origins(
                [env["KERN_ALLOWED_ORIGINS"]], "KERN_ALLOWED_ORIGINS"
            )
        if "KERN_MAX_MODEL_LEN" in env:
            text = env["KERN_MAX_MODEL_LEN"]
            if not text.isdigit() or int(text) < 1:
                raise UsageError(f"KERN_MAX_MODEL_LEN={text!r} is not a positive integer")
            out.max_model_len = check_max_model_len(
                int(text), selection.config, f"KERN_MAX_MODEL_LEN={text}"
            )
        if env.get("KERN_CHAT_TEMPLATE"):
            file = env["KERN_CHAT_TEMPLATE"]
            out.chat_template = read_chat_template(Path(file), f"KERN_CHAT_TEMPLATE={file}")
        for var, attr, kind in (
            ("KERN_MAX_BODY_BYTES", "max_body", int),
            ("KERN_STATS_INTERVAL", "stats_interval", float),
            ("KERN_BODY_TIMEOUT", "body_timeout", float),
        ):
            if var in env:
                try:
                    setattr(out, attr, kind(env[var]))
                except ValueError:
                    raise UsageError(f"{var}={env[var]!r} is not a number") from None
        out.shutdown_timeout = shutdown_timeout(env)
        out.log_prompts = env.get("KERN_LOG_PROMPTS", "") not in ("", "0")
        out.allow_unknown_fields = unknown_fields_env(env)
        out.enforce_eager = env.get("KERN_ENFORCE_EAGER", "") not in ("", "0")
        level = env.get("KERN_LOG_LEVEL", "info").lower()
        if level not in logs.LEVELS:
            raise UsageError(f"KERN_LOG_LEVEL={level!r} is not one of {', '.join(logs.LEVELS)}")
        if not log.handlers:
            logs.configure(level)
        return out


def unknown_fields_env(env: Mapping[str, str]) -> bool:
    """Whether ``KERN_ALLOW_UNKNOWN_FIELDS`` turns the unknown-field warning on (anything but
    unset, empty or 0), under ``kern serve`` and plain hypercorn alike."""
    return env.get("KERN_ALLOW_UNKNOWN_FIELDS", "") not in ("", "0")


def shutdown_timeout(env: Mapping[str, str], flag: float | None = None) -> float:
    """``flag`` (``--shutdown-timeout``) if given, else ``KERN_SHUTDOWN_TIMEOUT`` (seconds >=
    0), else :data:`DEFAULT_SHUTDOWN_TIMEOUT`; a :class:`UsageError` naming the variable."""
    if flag is not None:
        return flag
    text = env.get("KERN_SHUTDOWN_TIMEOUT")
    if text is None:
        return DEFAULT_SHUTDOWN_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise UsageError(f"KERN_SHUTDOWN_TIMEOUT={text!r} is not a number of seconds >= 0")
    return value


def _select(env: Mapping[str, str], served_name: str | None) -> Selection:
    """The checked target the environment names: the same resolve, rows and check sequence as
    ``kern serve``'s flags go through."""
    parser = env.get("KERN_REASONING_PARSER") or None
    if parser is not None and parser not in REASONING_PARSERS:
        raise UsageError(
            f"KERN_REASONING_PARSER={parser!r} is not one of {', '.join(REASONING_PARSERS)}"
        )
    tools = env.get("KERN_TOOL_CALL_PARSER") or None
    if tools is not None and tools not in TOOL_PARSERS:
        raise UsageError(f"KERN_TOOL_CALL_PARSER={tools!r} is not one of {', '.join(TOOL_PARSERS)}")
    hosted = env.get("KERN_HOSTED_TOOLS") or None
    if hosted is not None and hosted not in HOSTED_TOOLS:
        raise UsageError(f"KERN_HOSTED_TOOLS={hosted!r} is not one of {', '.join(HOSTED_TOOLS)}")
    config, name, model = env.get("KERN_CONFIG"), env.get("KERN_TARGET"), env.get("KERN_MODEL")
    if config and not name:
        raise UsageError("KERN_CONFIG needs KERN_TARGET")
    if name and not config:
        raise UsageError("KERN_TARGET needs KERN_CONFIG")
    rows = None
    if "KERN_ROWS" in env:
        text = env["KERN_ROWS"]
        if not text.isdigit() or int(text) < 1:
            raise UsageError(f"KERN_ROWS={text!r} is not a positive integer")
        rows = int(text)
    return select(
        config=Path(config) if config else None,
        target=name or None,
        model=Path(model) if model else None,
        overrides={
            "reasoning_parser": parser,
            "tool_parser": tools,
            "hosted_tools": hosted,
            **_grammar_budget(env),
        },
        rows=rows,
        rows_flag="KERN_ROWS",
        served_name=served_name,
        serving=True,
    )


def _grammar_budget(env: Mapping[str, str]) -> dict[str, float | int]:
    """The grammar budgets ``KERN_GRAMMAR_TIMEOUT`` and ``KERN_GRAMMAR_MAX_BYTES`` set, as
    kern.toml keys (kern.engine.grammar_compile); a :class:`UsageError` naming the variable."""
    out: dict[str, float | int] = {}
    if "KERN_GRAMMAR_TIMEOUT" in env:
        text = env["KERN_GRAMMAR_TIMEOUT"]
        try:
            out["grammar_timeout"] = grammar_timeout(float(text), "KERN_GRAMMAR_TIMEOUT")
        except (ValueError, TomlConfigError):
            raise UsageError(
                f"KERN_GRAMMAR_TIMEOUT={text!r} is not a positive number of seconds"
            ) from None
    if "KERN_GRAMMAR_MAX_BYTES" in env:
        text = env["KERN_GRAMMAR_MAX_BYTES"]
        value = int(text) if text.isdigit() else text
        try:
            out["grammar_max_bytes"] = parse_bytes(value, "KERN_GRAMMAR_MAX_BYTES", minimum=1)
        except TomlConfigError as e:
            raise UsageError(str(e)) from None
    return out


def check_max_model_len(value: int, config: ModelConfig, what: str) -> int:
    """``value``, the context a server accepts, if the model has it: a :class:`UsageError`
    naming ``what`` (``--max-model-len N``, ``KERN_MAX_MODEL_LEN=N``) when it is over the
    model's ``max_position_embeddings``."""
    if value > config.max_position_embeddings:
        raise UsageError(
            f"{what}: over the model's context of {config.max_position_embeddings} tokens "
            "(max_position_embeddings in its config.json)"
        )
    return value


def read_chat_template(path: Path, what: str) -> str:
    """The text of a Jinja chat template file, checked to compile as the checkpoint's would;
    a :class:`UsageError` naming ``what`` (``--chat-template FILE``) when it cannot be read or
    does not compile."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"{what}: cannot read the chat template: {e.strerror}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{what}: the chat template is not UTF-8 text") from None
    try:
        compile_chat_template(text, what)
    except ChatTemplateError as e:
        raise UsageError(str(e)) from None
    return text


def served_names(names: list[str], where: str) -> tuple[str, ...]:
    """The model names a server answers to, in order, each once; a :class:`UsageError` naming
    ``where`` for an empty one."""
    if any(not name.strip() for name in names):
        raise UsageError(f"{where}: a model name cannot be empty")
    return tuple(dict.fromkeys(names))


def api_key(flag: str | None, file: Path | None, flag_name: str = "--api-key") -> str | None:
    """The API key from a flag, a file (its first line) or ``KERN_API_KEY``, in that order;
    None: no key. An empty or blank key is a ``UsageError``: an unset shell variable must
    not start a server with no auth."""
    if flag is not None and file is not None:
        raise UsageError(f"{flag_name} and a key file: pass one of them")
    if flag is not None:
        key, where = flag, flag_name
    elif file is not None:
        try:
            lines = file.read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise UsageError(f"{file}: cannot read the API key file: {e.strerror}") from None
        key, where = (lines[0] if lines else ""), str(file)
    elif "KERN_API_KEY" in os.environ:
        key, where = os.environ["KERN_API_KEY"], "KERN_API_KEY"
    else:
        return None
    if not key.strip():
        raise UsageError(f"{where}: the API key is empty")
    if key != key.strip() or any(c.isspace() for c in key):
        raise UsageError(f"{where}: the API key contains whitespace")
    return key
