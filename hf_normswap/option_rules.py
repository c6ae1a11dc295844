"""One way to declare and check options: beside each dataclass field, its help, its closed set (`choices`) and its
rules (`Rule`: a test of the value and the options, for ranges and for rules across fields, and what it allows).
`check_options` checks every field in order and refuses the first bad value in one line:
`NAME=VALUE is invalid: ALLOWED`."""

import math
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import Any, NamedTuple


class Rule(NamedTuple):
    """A field's test of its value and the options it belongs to, and what the error says is allowed."""

    test: Callable[[Any, Any], bool]
    allowed: str


def check_options(options, error: type[Exception]) -> None:
    """Checks the `choices` and `rules` that the fields of the dataclass `options` declare in their metadata."""
    for item in fields(options):
        value, choices = getattr(options, item.name), item.metadata.get("choices")
        if choices is not None and value is not None and value not in choices:
            raise error(not_allowed(item.name, value, choices))
        for rule in item.metadata.get("rules", ()):
            if not rule.test(value, options):
                raise error(f"{item.name}={value!r} is invalid: {rule.allowed}")


def not_allowed(name: str, value, choices: Iterable) -> str:
    """The one-line error for a `value` of `name` outside its set `choices`."""
    return f"{name}={value!r} is invalid: allowed are {', '.join(map(str, choices))}"


def unwrapped(annotation):
    """`X | None` as X."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next(kind for kind in typing.get_args(annotation) if kind is not type(None))
    return annotation


def whole(value, low: int, high: float = math.inf) -> bool:
    """Whether `value` is a whole number from `low` to `high`."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def at_least(low: int, allowed: str | None = None) -> Rule:
    """A whole number of at least `low`, or None (left open)."""
    return Rule(lambda value, _: value is None or whole(value, low), allowed or f"at least {low}")


def positive(allowed: str = "must be positive") -> Rule:
    """A positive finite number, or None (left open)."""
    return Rule(
        lambda value, _: (
            value is None
            or (isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0)
        ),
        allowed,
    )
