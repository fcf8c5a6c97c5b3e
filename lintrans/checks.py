"""Scalar argument checks shared by every layer of lintrans (torch-free, so configs can use them)."""
from __future__ import annotations

import math


def check_number(name: str, value, *, integer: bool = False, low=None, high=None, low_open: bool = False,
                 high_open: bool = False, allow_none: bool = False) -> None:
    """The one check for scalar arguments: TypeError when ``value`` is not an int (``integer``) or a
    real number (bools are neither), ValueError when it is not finite or outside [low, high]
    (``low_open`` / ``high_open`` exclude the end). Both messages name ``name`` and what is allowed."""
    if value is None and allow_none:
        return
    what = "an int" if integer else "a number"
    if low is not None and high is not None:
        what += f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    elif low is not None:
        what += f" {'>' if low_open else '>='} {low}"
    elif high is not None:
        what += f" {'<' if high_open else '<='} {high}"
    what += " or None" if allow_none else ""
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise TypeError(f"{name} must be {what}, got {value!r}")
    if not math.isfinite(value) or (low is not None and (value < low or (low_open and value == low))) or (
            high is not None and (value > high or (high_open and value == high))):
        raise ValueError(f"{name} must be {what}, got {value!r}")


def check_positive_int(name: str, value, allow_none: bool = False) -> None:
    check_number(name, value, integer=True, low=1, allow_none=allow_none)


def check_bool(name: str, value) -> None:
    """TypeError naming ``name`` unless ``value`` is a bool (1, "yes" and "False" are not)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def check_choice(name: str, value, allowed) -> None:
    """ValueError naming ``name`` and the allowed values when ``value`` is not one of ``allowed``."""
    try:
        known = value in allowed
    except TypeError:  # an unhashable value against a set or dict's keys
        known = False
    if not known:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}{_did_you_mean(value, allowed)}")


def _did_you_mean(value, allowed) -> str:
    """" (did you mean 'x'?)" for a string close to one allowed string (a typo, - for _), else ""."""
    if not isinstance(value, str):
        return ""
    import difflib

    names = [a for a in allowed if isinstance(a, str)]
    close = difflib.get_close_matches(value, names, n=1, cutoff=0.75) or [
        a for a in names if a.lower().replace("_", "-") == value.lower().replace("_", "-")]
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_known_keys(what: str, given, allowed, where: str = "") -> None:
    """ValueError listing the keys of ``given`` that are not in ``allowed``, and the allowed ones:
    ``unknown {what} ['x'] for {where}; allowed: [...]``."""
    unknown = sorted(set(given) - set(allowed), key=str)
    if unknown:
        raise ValueError(f"unknown {what} {unknown}{' for ' + where if where else ''}; allowed: {sorted(allowed)}")
