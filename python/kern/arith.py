"""Integer arithmetic the layers share."""

__all__ = ["cdiv"]


def cdiv(a: int, b: int) -> int:
    """``a / b`` rounded up (``b`` > 0): pages for ``a`` tokens, blocks for ``a`` rows."""
    return -(-a // b)
