"""Checks of the knobs every part shares (one wording, one limit)."""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, TypeVar

from refitkit.errors import InvalidInput

T = TypeVar("T")

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


# Knobs renamed so that one concept has one name on every engine: the former spelling -> the name now. Each former
# spelling is still taken for one release (0.2), with a DeprecationWarning naming the new one.
RENAMED_KNOBS = {"flush_cache": "reset_prefix_cache", "release_memory": "sleep_level"}


def renamed_knob(knob: str, value: T, *, default: T, old: str, old_value: Any, converted: Any = None) -> Any:
    """``value`` of ``knob``, or the value given under its former name ``old`` (None: not given), with a
    ``DeprecationWarning`` naming ``knob``; ``converted(old_value)`` turns the old meaning into the new one where they
    differ. Both given, and different from the default: ``InvalidInput``."""
    if old_value is None:
        return value
    warnings.warn(
        f"{old}= is deprecated: use {knob}= (the same knob's name on every engine)", DeprecationWarning, stacklevel=3
    )
    if value != default:
        raise InvalidInput(f"{old}={old_value!r} and {knob}={value!r}: {old} is {knob}'s former name; pass {knob} only")
    return old_value if converted is None else converted(old_value)
