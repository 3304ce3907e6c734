"""Where kvlab's bundled assets lie, whether kvlab is installed or run from a checkout.

The repository keeps ``assets/`` at its top level; ``pip install`` (plain or
editable) maps that folder to the data package ``kvlab.assets``, which
importlib finds. A checkout used without installing has no such package, and
the folder is then the one beside ``kvlab/``.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path


def assets_dir() -> Path:
    """The folder holding ``examples/`` and ``budgets/``."""
    try:
        # A regular package on disk (wheel or editable install): files() is a pathlib.Path.
        return Path(resources.files("kvlab.assets"))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / "assets"
