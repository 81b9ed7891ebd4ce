"""Comma-separated number lists as ``argparse`` types, for the benchmarks' command lines.

    parser.add_argument("--budgets", type=numbers(int, minimum=1), default="64,32")

argparse applies the type to a string default too, and turns a bad value into its usual
one-line ``error: argument --budgets: ...`` and exit 2.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def numbers(kind: type = float, *, minimum: float | None = None) -> Callable[[str], list]:
    """An argparse type: ``"1,4"`` -> ``[1, 4]`` of ``kind``, each at least ``minimum``."""
    what = "integers" if kind is int else "numbers"

    def parse(text: str) -> list:
        try:
            values = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {what}, e.g. 1,4") from None
        if minimum is not None and any(v < minimum for v in values):
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed; give {what} >= {minimum:g}")
        return values

    parse.__name__ = f"list of {what}"
    return parse
