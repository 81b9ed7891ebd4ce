"""The job's ``input_shape`` and ``num_classes``, validated once for models and data."""

from __future__ import annotations

from typing import Any

import numpy as np

from senseshield.errors import ConfigError

__all__ = ["check_input_shape", "check_num_classes"]


def check_input_shape(input_shape: Any) -> tuple[int, ...]:
    """``input_shape`` as a tuple of positive ints of any rank >= 1, or a ConfigError."""
    ok = not isinstance(input_shape, (str, bytes))
    try:
        shape = tuple(int(d) for d in input_shape)
        ok = ok and len(shape) >= 1 and all(
            not isinstance(d, bool) and int(d) == d >= 1 for d in input_shape
        )
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(
            f"input_shape={input_shape!r} is not allowed; it must be a sequence of positive "
            f"integers, e.g. (C, L), (C, H, W) or (F,)."
        )
    return shape


def check_num_classes(num_classes: Any, *, minimum: int = 2) -> int:
    """``num_classes`` as an int >= ``minimum``, or a ConfigError (classification needs 2
    classes; a regression's or multi-label model's outputs may be 1)."""
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) \
            or num_classes < minimum:
        raise ConfigError(
            f"num_classes={num_classes!r} is not allowed; it must be an integer >= {minimum}."
        )
    return int(num_classes)
