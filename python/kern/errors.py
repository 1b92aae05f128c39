"""Errors every command shares (a leaf module: it imports nothing of kern)."""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(Exception):
    """A mistake in what the user asked for; printed as one line, exit code 2."""
