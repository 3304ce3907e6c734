"""The registered methods by name: :func:`register` adds one, :func:`discover`
(kvlab.compression.discovery's) imports every module of the methods package (kvlab.methods calls
it: a method is a file there, no import list).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvlab import messages
from kvlab.compression.discovery import discover as discover
from kvlab.compression.interface import EvictionMethod, Method, keeping_windows
from kvlab.compression.options import MethodError
from kvlab.compression.selection import SELECTION_PRESETS, SelectionOptions

REGISTRY: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    """Class decorator: make a method available by its ``name`` (its caches keep the model's sliding
    windows, :func:`keeping_windows`).

    A scoring method (:meth:`EvictionMethod.selects`) declares Options that extend
    :class:`SelectionOptions` itself: the class is not given knobs behind its back.
    """
    if cls.name in REGISTRY:
        raise ValueError(f"method {cls.name!r} registered twice")
    if issubclass(cls, EvictionMethod) and cls.selects() and not issubclass(cls.Options, SelectionOptions):
        raise TypeError(f"{cls.name}: a scoring method's Options extend kvlab.compression.selection.SelectionOptions")
    if not getattr(cls.compress, "keeps_windows", False):
        cls.compress = keeping_windows(cls.compress)
    REGISTRY[cls.name] = cls
    return cls


def method_class(name: str) -> type[Method]:
    """The registered class of ``name``; MethodError listing the names when there is none."""
    if name not in REGISTRY:
        raise MethodError(messages.unknown("method", name, sorted(REGISTRY)))
    return REGISTRY[name]


def method_presets(cls: type[Method]) -> dict[str, dict[str, Any]]:
    """The method's own presets, and the wrappers' (:data:`SELECTION_PRESETS`) when it takes their knobs."""
    return {**cls.presets, **(SELECTION_PRESETS if issubclass(cls.Options, SelectionOptions) else {})}


def get_method(name: str, preset: str | None = None, **options: Any) -> Method:
    """Instantiate a registered method; options are fields of its Options dataclass.

    preset: one of the method's ``presets``, whose values the explicit options override.
    """
    cls = method_class(name)
    if preset is not None:
        presets = method_presets(cls)
        if preset not in presets:
            raise MethodError(f"{name} has no preset {preset!r}; it has: {', '.join(presets) or 'none'}")
        options = {**presets[preset], **options}
    known = {f.name for f in dataclasses.fields(cls.Options)}
    unknown = set(options) - known
    if unknown:
        raise MethodError(
            f"{name} has no option(s) {', '.join(sorted(unknown))}; it takes: {', '.join(sorted(known)) or 'none'}"
        )
    try:
        return cls(cls.Options(**options))
    except MethodError as exc:
        raise MethodError(f"{name}: {exc}") from None
