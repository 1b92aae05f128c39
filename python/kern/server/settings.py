"""The server's settings (:class:`Settings`) and the API key's sources (:func:`api_key`),
which ``kern serve`` and the environment both go through."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kern.engine.targets import select
from kern.errors import UsageError
from kern.kern_toml import REASONING_PARSERS, Target
from kern.server import logs

__all__ = [
    "DEFAULT_BODY_TIMEOUT",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_STATS_INTERVAL",
    "Settings",
    "api_key",
]

log = logging.getLogger("kern")

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_STATS_INTERVAL = 10.0
DEFAULT_BODY_TIMEOUT = 30.0


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

    @classmethod
    def from_env(cls) -> Settings:
        """``KERN_CONFIG`` + ``KERN_TARGET`` (a kern.toml target) or ``KERN_MODEL`` (a
        checkpoint folder), ``KERN_ROWS`` (as ``kern serve --rows``), ``KERN_API_KEY``,
        ``KERN_MAX_BODY_BYTES``, ``KERN_LOG_LEVEL``, ``KERN_LOG_PROMPTS``,
        ``KERN_STATS_INTERVAL``, ``KERN_REASONING_PARSER``. Raises ``UsageError`` naming the
        variable."""
        env = os.environ
        out = cls(
            target=_target(env),
            api_key=api_key(
                None, Path(env["KERN_API_KEY_FILE"]) if "KERN_API_KEY_FILE" in env else None
            ),
        )
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
        out.log_prompts = env.get("KERN_LOG_PROMPTS", "") not in ("", "0")
        level = env.get("KERN_LOG_LEVEL", "info").lower()
        if level not in logs.LEVELS:
            raise UsageError(f"KERN_LOG_LEVEL={level!r} is not one of {', '.join(logs.LEVELS)}")
        if not log.handlers:
            logs.configure(level)
        return out


def _target(env: Mapping[str, str]) -> Target:
    """The checked target the environment names: the same resolve, rows and check sequence as
    ``kern serve``'s flags go through."""
    parser = env.get("KERN_REASONING_PARSER") or None
    if parser is not None and parser not in REASONING_PARSERS:
        raise UsageError(
            f"KERN_REASONING_PARSER={parser!r} is not one of {', '.join(REASONING_PARSERS)}"
        )
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
        overrides={"reasoning_parser": parser},
        rows=rows,
        rows_flag="KERN_ROWS",
        serving=True,
    ).target


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
