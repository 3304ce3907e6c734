"""The one wording of messages several layers give, so that a user reads the same sentence everywhere."""

from __future__ import annotations

from typing import Iterable


def unknown(what: str, names: object | Iterable[object], choices: Iterable[str]) -> str:
    """ "unknown WHAT 'name'; choose one of: a, b, c" (several names: "unknown WHATs 'a', 'b'; ...")."""
    listed = [names] if isinstance(names, str) or not isinstance(names, Iterable) else list(names)
    shown = ", ".join(repr(n) for n in listed) or "(none given)"
    plural = "s" if len(listed) > 1 else ""
    return f"unknown {what}{plural} {shown}; choose one of: {', '.join(choices)}"
