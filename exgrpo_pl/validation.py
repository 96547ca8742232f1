"""Option checks shared by the module, the callbacks, the buffer and the sampler.

Every numeric option is checked when its object is built, i.e. before training starts: it must be a real
number (not a string or a bool), finite in float32, the dtype training computes in (a NaN temperature, an
infinite learning rate or a 1e39 reward weight, infinite once cast, would otherwise train NaN weights
without a word) and inside its range. The error names the owner and the option. Core module: no Lightning.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping

FLOAT32_MAX = 3.4028234663852886e38


def check_number(
    owner: str,
    name: str,
    value,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    high_open: bool = False,
    integer: bool = False,
    optional: bool = False,
):
    """`value` itself if it is a number in range, finite in float32; ValueError naming `owner.name` otherwise.

    Args:
        owner: the class the option belongs to, for the message.
        name: the option's name.
        value: the value given.
        low: the range's lower end (None: unbounded below).
        high: the range's upper end (None: unbounded above).
        low_open: exclude the lower end.
        high_open: exclude the upper end.
        integer: the value must be an int.
        optional: None is allowed (and returned as is).
    """
    if value is None and optional:
        return None
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        expected = "an integer" if integer else "a number"
        raise ValueError(f"{owner} {name}={value!r}: must be {expected}")
    if not math.isfinite(value):
        raise ValueError(f"{owner} {name}={value!r}: must be finite")
    if abs(value) > FLOAT32_MAX:
        raise ValueError(f"{owner} {name}={value!r}: must be finite in float32 (at most {FLOAT32_MAX:.4g})")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        raise ValueError(f"{owner} {name}={value!r}: must be {_range_text(low, high, low_open, high_open)}")
    return value


def _range_text(low, high, low_open: bool, high_open: bool) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low:g}"
    if low is None:
        return f"{'<' if high_open else '<='} {high:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def check_choice(owner: str, name: str, value, allowed: Iterable[str]):
    """`value` if it is one of `allowed`; ValueError naming `owner.name` and the choices otherwise."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{owner} {name}={value!r}; allowed: {', '.join(allowed)}")
    return value


def check_numbers(owner: str, values: Mapping, rules: Mapping[str, dict]) -> None:
    """`check_number` for every option named in `rules` (option -> keyword arguments of `check_number`)."""
    for name, rule in rules.items():
        check_number(owner, name, values[name], **rule)
