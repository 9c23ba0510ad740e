"""A request's decoding fields and the one rule each obeys: the single place that turns untrusted values into checked
ones.

`check_field(name, value)` holds the type and range of every field a request may carry (`max_tokens`, `temperature`,
`top_p`, `top_k`, `seed`, `stop`) and refuses a bad value with a DFlashError naming the field; `SamplingParams`, the
typed settings the loops decode with, applies the same rules when it is made, so a SamplingParams that exists is a
checked one and the code that receives one trusts it. Every edge goes through here: the HTTP front's generate, infer
and OpenAI bodies (deploy/handler.py, deploy/openai_api.py), the request the Triton model reads, and the CLI's and
the Python API's SamplingParams. What depends on the engine (the prompt plus `max_tokens` within its context) is
checked where the engine is known (runtime/single.py's `check_request`).
"""

from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass

from dflash_export.errors import DFlashError, json_kind

DEFAULT_MAX_TOKENS = 128
MAX_STOP_STRINGS = 16
INT64_MAX = (1 << 63) - 1   # max_tokens travels as INT64
UINT64_MAX = (1 << 64) - 1  # seed travels as UINT64
FP32_MAX = 3.4028234663852886e38  # temperature and top_p travel as FP32: its largest value
FP32_TINY = 2.0 ** -149           # and its smallest positive one

# name -> (integer field, lowest, highest, lowest excluded)
_RANGES = {
    "max_tokens": (True, 1, INT64_MAX, False),
    "top_k": (True, 0, INT64_MAX, False),
    "seed": (True, 0, UINT64_MAX, False),
    "temperature": (False, 0.0, math.inf, False),
    "top_p": (False, 0.0, 1.0, True),
}
FIELDS = (*_RANGES, "stop")


def is_int(v) -> bool:
    """An integer that is not a boolean (Python's True is an int; JSON's true is no integer)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """An integer or a float, not a boolean."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_finite_number(v) -> bool:
    """A number, neither infinite nor NaN, that a float holds (an integer of JSON's unbounded length past float's
    range is not: it cannot be computed with as one)."""
    try:
        return is_number(v) and math.isfinite(v)
    except OverflowError:
        return False


def is_positive_number(v) -> bool:
    """A number above 0 and finite (NaN is not)."""
    return is_finite_number(v) and v > 0


def shown(v) -> str:
    """A number as an error message quotes it: an integer of JSON's unbounded length cut to its first and last
    digits (a 4000-digit value would otherwise fill the message); a float in `g` form where that is its exact value,
    else in full (2.0000001 is not shown as 2, which would contradict a bound of 2)."""
    if isinstance(v, float):
        text = f"{v:g}"
        return text if float(text) == v else repr(v)
    text = str(v)
    return text if len(text) <= 40 else f"{text[:12]}...{text[-6:]} ({len(text.lstrip('-'))} digits)"


def check_unicode(text: str, name: str) -> str:
    """Refuse a string that cannot be UTF-8 (a lone surrogate, which JSON's \\ud800 escapes can carry)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DFlashError(f"lone surrogate \\u{ord(text[e.start]):04x} at character {e.start} (not valid Unicode "
                          "text)", field=name) from None
    return text


def check_field(name: str, value, field: str | None = None):
    """`value` for the request field `name`, checked: an int for the integer fields, a float for temperature and
    top_p, a list of strings for stop (one string is a list of one); a DFlashError naming `field` (the name the
    client used, `name` by default) otherwise."""
    field = field or name
    if name == "stop":
        stops = value if isinstance(value, list) else [value]
        if not all(isinstance(s, str) for s in stops):
            raise DFlashError("expected a string or a list of strings", field=field)
        if len(stops) > MAX_STOP_STRINGS:
            raise DFlashError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", field=field)
        return [check_unicode(s, field) for s in stops]
    integer, lo, hi, lo_open = _RANGES[name]
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integer else numbers.Real):
        raise DFlashError(f"expected {'an integer' if integer else 'a number'}, got {json_kind(value)}", field=field)
    if integer:
        value = int(value)
        if not lo <= value <= hi:
            raise DFlashError(f"must be in {lo}..{hi}, got {shown(value)}", field=field)
        return value
    given = value
    try:
        value = float(value)
    except OverflowError:  # an integer beyond float's range (JSON allows any length): float's largest of its sign
        value = sys.float_info.max if given > 0 else -sys.float_info.max  # stands for it in the range checks
    if not math.isfinite(value):
        raise DFlashError(f"must be a finite number, got {value}", field=field)
    if lo_open and not lo < value <= hi:
        raise DFlashError(f"must be in ({lo:g}, {hi:g}], got {shown(given)}", field=field)
    if not lo_open and value < lo:
        raise DFlashError(f"must be >= {lo:g}, got {shown(given)}", field=field)
    return value


_SPLITMIX_STEP = 0x9E3779B97F4A7C15


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of a request with `seed` that asks for several choices (OpenAI's `n`): choice 0
    keeps `seed` (it is the answer the same request with one choice gets); choice i >= 1 takes the i-th number
    SplitMix64 seeded with `seed` gives (Steele, Lea and Flood's generator: `seed` + i x 0x9E3779B97F4A7C15 modulo
    2^64, through its finalizer). Hashed rather than `seed` + i, so that the choices of requests with nearby seeds
    (seed 1 and seed 2, each with n = 4) do not share their draws."""
    if index == 0:
        return seed
    z = (seed + index * _SPLITMIX_STEP) & UINT64_MAX
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & UINT64_MAX
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & UINT64_MAX
    return z ^ (z >> 31)


def as_fp32(name: str, value):
    """A checked field's value as it is sent to the model, whose `temperature` and `top_p` inputs are FP32: rounded
    there, a temperature beyond FP32's range would arrive as inf and a top_p below its smallest positive value as 0,
    both refused by the model. They are sent as FP32's largest value (any temperature that large makes every kept
    token equally likely in float64) and its smallest positive one (a top_p below the most likely token's
    probability keeps that token alone). Other values are returned as they are."""
    if name == "temperature" and value > FP32_MAX:
        return FP32_MAX
    if name == "top_p" and value < FP32_TINY:
        return FP32_TINY
    return value


_CHECKED = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")  # SamplingParams' fields check_field rules


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings, checked when made (`check_field`: a DFlashError naming the request field, as
    the served API calls it: `max_tokens` for `max_new_tokens`). temperature 0 = greedy."""

    max_new_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: list[int] | None = None  # None: the target's own stop ids

    def __post_init__(self) -> None:
        # Held as checked: an int or a float, as check_field returns it (an integer too long for a float: float's
        # largest value, which decoding can divide by).
        for attr, value in zip(_CHECKED, self.check()):
            object.__setattr__(self, attr, value)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def check(self) -> list:
        """The request fields' rules (`check_field`) applied to these settings; their checked values."""
        return [check_field("max_tokens" if attr == "max_new_tokens" else attr, getattr(self, attr))
                for attr in _CHECKED]
