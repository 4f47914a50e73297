"""Byte sizes on command lines and in environment variables: '1073741824', '512M', '512MiB', '1G',
'1T' (binary units, the same for every command)."""

from __future__ import annotations

import argparse


class SizeError(argparse.ArgumentTypeError, ValueError):
    """Not a size: an option parser shows the message, other callers catch a ValueError."""


_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}  # binary: 1G = 1 GiB


def byte_size(text: str | int) -> int:
    """Parses a size; raises SizeError naming the text."""
    clean = str(text).strip().lower().removesuffix("b").removesuffix("i")  # 1G = 1GiB = 1GB
    unit = _UNITS.get(clean[-1:], 1)
    number = clean[:-1] if clean[-1:] in _UNITS else clean
    try:
        value = int(float(number) * unit)
    except ValueError:
        raise SizeError(
            f"not a size in bytes: {text!r} (e.g. 512M, 1G, 1T)") from None
    if value <= 0:
        raise SizeError(f"a size must be positive, got {text!r}")
    return value


def format_size(num_bytes: int) -> str:
    """The shortest exact form: 1073741824 -> '1G', 1536 -> '1536'... for help texts and logs."""
    for suffix, unit in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if num_bytes >= unit and num_bytes % unit == 0:
            return f"{num_bytes // unit}{suffix}"
    return str(num_bytes)
