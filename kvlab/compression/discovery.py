"""Discovery: a package whose every module is one declaration (a method in kvlab.methods, a selection
stage in kvlab.compression.wrappers) imports its folders' modules instead of keeping an import list."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Iterable


def discover(package: str, path: Iterable[str]) -> list[str]:
    """Import every module of ``package`` (its folders ``path``), running the declarations they make;
    the names of the modules imported, sorted. Importing one twice is a no-op (Python's module cache)."""
    names = sorted(info.name for info in pkgutil.iter_modules(list(path)) if not info.ispkg)
    for name in names:
        importlib.import_module(f"{package}.{name}")
    return names
