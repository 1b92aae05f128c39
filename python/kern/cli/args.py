"""The argument types of every ``kern`` command: argparse ``type=`` callables that turn a flag's
text into a value or say in one phrase what is wrong with it.

A leaf: the subcommand modules import it, and it imports nothing of kern above the base, so no
subcommand imports the parser back (``kern.cli`` imports the subcommands). Each raises
``argparse.ArgumentTypeError``; argparse prefixes the flag (``argument --port: ...``).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

from kern.kern_toml import TomlConfigError, check_device, parse_bytes

__all__ = [
    "byte_size",
    "count",
    "device",
    "id_list",
    "index_list",
    "label_list",
    "level_list",
    "port",
    "positive_int",
    "rate",
    "seconds",
]

# A probe label names a file: nothing that could leave --probe-dir.
_LABEL = re.compile(r"^[A-Za-z0-9._-]+$")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def count(text: str) -> int:
    """An integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def rate(text: str) -> float:
    """A number above 0 (requests per second)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the rate must be above 0")
    return value


def seconds(text: str) -> float:
    """A finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


def port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0 to 65535)")
    return value


def device(text: str) -> str:
    """A device as kern.toml takes it (``cpu``, ``cuda``, ``cuda:N``)."""
    try:
        check_device(text, "--device")
    except TomlConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--device: ")) from None
    return text


def byte_size(minimum: int) -> Callable[[str], int]:
    """A size in bytes of at least ``minimum``, as kern.toml takes it (``512MiB``, ``4GiB``)."""

    def parse(text: str) -> int:
        # A bare number is bytes, as in kern.toml.
        value: int | str = int(text) if text.isdigit() else text
        try:
            return parse_bytes(value, "size", minimum=minimum)
        except TomlConfigError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("size: ")) from None

    return parse


def level_list(text: str) -> list[int]:
    """Comma-separated integers >= 1 (``kern bench --concurrency``)."""
    try:
        levels = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected e.g. 1,12,64") from None
    if any(n < 1 for n in levels):
        raise argparse.ArgumentTypeError(f"{text!r}: every level must be at least 1")
    return levels


def _int_list(text: str, what: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of {what}"
        ) from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: {what} are not negative")
    return values


def id_list(text: str) -> list[int]:
    """Comma-separated token ids (>= 0)."""
    return _int_list(text, "token ids")


def index_list(text: str) -> list[int]:
    """Comma-separated indices (>= 0), none repeated."""
    values = _int_list(text, "indices")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r} repeats an index")
    return values


def label_list(text: str) -> list[str]:
    """Comma-separated probe labels, each a safe file name, none repeated."""
    labels = text.split(",")
    for label in labels:
        if not _LABEL.match(label):
            raise argparse.ArgumentTypeError(
                f"label {label!r}: use letters, digits, '.', '_' and '-' (it names a file)"
            )
    if len(set(labels)) != len(labels):
        raise argparse.ArgumentTypeError(f"{text!r} repeats a label")
    return labels
