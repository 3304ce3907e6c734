"""A method's knobs: :func:`knob` declares one, :class:`Options` checks every value on creation.

A bad value raises :class:`MethodError` naming the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass, field
from typing import Any


class MethodError(ValueError):
    """A method was asked for something it cannot do; the message says why."""


def knob(
    default: Any,
    help: str,
    *,
    low: float | None = None,
    high: float | None = None,
    odd: bool = False,
    slider: bool = False,
    aliases: dict[str, str] | None = None,
) -> Any:
    """A dataclass field for one method knob: its default, its help line and what it allows.

    low / high: inclusive bounds of a number (None: open); odd: a whole number
    that must be odd (a centred pooling kernel); slider: the app shows the
    number as a slider from low to high (both must be given), for knobs a
    learner is meant to move and watch; aliases: a choice's old spelling -> today's, read as
    today's (links and sheets in the wild keep working; :func:`alias_of` names the change).
    """
    if slider and (low is None or high is None):
        raise ValueError("a slider knob needs both bounds (low and high)")
    metadata = {"help": help, "low": low, "high": high, "odd": odd, "slider": slider, "aliases": aliases or {}}
    return field(default=default, metadata=metadata)


def alias_of(f: dataclasses.Field, value: Any) -> str | None:
    """Today's spelling of ``value`` when it is an old one of knob ``f``'s choices (:func:`knob`'s aliases),
    else None."""
    return f.metadata.get("aliases", {}).get(value) if isinstance(value, str) else None


def allowed(f: dataclasses.Field, kind: Any) -> str:
    """What a knob of type ``kind`` declared by ``f`` accepts, in words ("an odd whole number >= 1")."""
    if typing.get_origin(kind) is typing.Literal:
        return "one of " + ", ".join(map(str, typing.get_args(kind)))
    if kind is bool:
        return "true or false"
    if kind is str:
        return "a non-empty text"
    low, high = f.metadata.get("low"), f.metadata.get("high")
    noun = ("an odd whole number" if f.metadata.get("odd") else "a whole number") if kind is int else "a number"
    if low is not None and high is not None:
        return f"{noun} from {low:g} to {high:g}"
    if low is not None:
        return f"{noun} >= {low:g}"
    return f"{noun} <= {high:g}" if high is not None else noun


def _accepts(f: dataclasses.Field, kind: Any, value: Any) -> bool:
    if typing.get_origin(kind) is typing.Literal:
        return isinstance(value, str) and value in typing.get_args(kind)
    if kind is bool:
        return isinstance(value, bool)
    if kind is str:
        return isinstance(value, str) and bool(value.strip())
    if kind not in (int, float):
        return True  # no rule for other types
    if (
        isinstance(value, bool)
        or not isinstance(value, int if kind is int else (int, float))
        or not math.isfinite(value)
    ):
        return False
    low, high = f.metadata.get("low"), f.metadata.get("high")
    if f.metadata.get("odd") and value % 2 == 0:
        return False
    return (low is None or value >= low) and (high is None or value <= high)


@functools.cache
def option_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved type of an Options dataclass (Literal kept; annotations are strings here)."""
    return typing.get_type_hints(cls)


@dataclass(frozen=True)
class Options:
    """Base of every method's knobs: each field is checked on creation against its
    type (Literal choices included) and the bounds its :func:`knob` declares.

    A bad value raises MethodError naming the field, the value and what is
    allowed; get_method prefixes the method's name.
    """

    def __post_init__(self) -> None:
        kinds = option_types(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if (today := alias_of(f, value)) is not None:
                object.__setattr__(self, f.name, today)  # frozen: the old spelling read as today's
                value = today
            if f.init and not _accepts(f, kinds[f.name], value):
                raise MethodError(f"{f.name} must be {allowed(f, kinds[f.name])}, got {value!r}")


@dataclass(frozen=True)
class NoOptions(Options):
    """A method without knobs."""
