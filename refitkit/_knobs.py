"""Checks of the knobs every part shares (one wording, one limit)."""

from __future__ import annotations

import math
import numbers

from refitkit.errors import InvalidInput

MAX_TIMEOUT_S = 7 * 24 * 3600.0  # one week: the longest wait every poll, semaphore and timedelta can hold


def checked_seconds(value: object, knob: str) -> float:
    """``value`` as a float of seconds, finite, above 0 and at most ``MAX_TIMEOUT_S``; else InvalidInput naming ``knob``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidInput(f"{knob}={value!r} is a {type(value).__name__}; need a number of seconds")
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise InvalidInput(
            f"{knob}={value!r}; need a finite number of seconds above 0 and at most "
            f"MAX_TIMEOUT_S={MAX_TIMEOUT_S:g} (one week: the longest wait every poll can hold)"
        )
    return float(value)
