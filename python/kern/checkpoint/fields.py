"""Typed reads of a ``config.json`` object, with errors that name the file and the field."""

from __future__ import annotations

import math
from typing import Any

from kern.checkpoint.errors import ConfigFieldError

__all__ = ["Fields"]


class Fields:
    """Typed reads of one JSON object, with errors that name the file and the field."""

    def __init__(self, raw: dict[str, Any], where: str) -> None:
        self.raw = raw
        self.where = where

    _MISSING = object()

    def _get(self, key: str, default: Any) -> Any:
        value = self.raw.get(key, default)
        if value is self._MISSING:
            raise ConfigFieldError(f"{self.where}: missing required field {key!r}")
        return value

    def pos_int(self, key: str, default: Any = _MISSING) -> int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigFieldError(
                f"{self.where}: field {key!r} must be a positive integer, got {value!r}"
            )
        return value

    def number(self, key: str, default: Any = _MISSING) -> float:
        value = self._get(key, default)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise ConfigFieldError(f"{self.where}: field {key!r} must be a number, got {value!r}")
        return float(value)

    def flag(self, key: str, default: Any = _MISSING) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise ConfigFieldError(f"{self.where}: field {key!r} must be a boolean, got {value!r}")
        return value

    def text(self, key: str, default: Any = _MISSING) -> str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise ConfigFieldError(f"{self.where}: field {key!r} must be a string, got {value!r}")
        return value
