"""Where kvlab's bundled assets and the repository's docs lie (installed or run from a checkout), and where it
keeps models.

The repository keeps ``assets/`` at its top level; ``pip install`` (plain or
editable) maps that folder to the data package ``kvlab.assets``, which
importlib finds. A checkout used without installing has no such package, and
the folder is then the one beside ``kvlab/``.
"""

from __future__ import annotations

import os
import typing
from importlib import resources
from pathlib import Path


def assets_dir() -> Path:
    """The folder holding ``examples/`` and ``budgets/``."""
    try:
        # A regular package on disk (wheel or editable install): files() is a pathlib.Path.
        return Path(resources.files("kvlab.assets"))
    except ModuleNotFoundError:
        return Path(__file__).resolve().parent.parent / "assets"


def docs_dir() -> Path | None:
    """The repository's ``docs/`` folder (beside ``kvlab/``: a checkout, an editable install, the Docker
    image), or None where kvlab runs without its repository (a wheel ships no ``docs/``)."""
    folder = Path(__file__).resolve().parent.parent / "docs"
    return folder if folder.is_dir() else None


def models_dir(environ: typing.Mapping[str, str] | None = None) -> Path:
    """Where kvlab keeps the models it assembles and dequantises (kvlab.models): the user's cache.

    ``KVLAB_MODELS_DIR`` when set, else ``$XDG_CACHE_HOME/kvlab/models``, else ``~/.cache/kvlab/models``.
    """
    return user_cache_dir("models", "KVLAB_MODELS_DIR", environ)


def budgets_dir(environ: typing.Mapping[str, str] | None = None) -> Path:
    """Where ``kvlab budgets`` keeps the head-budget profiles it measures (kvlab.compression.budget_profiles).

    ``KVLAB_BUDGETS_DIR`` when set, else ``$XDG_CACHE_HOME/kvlab/budgets``, else ``~/.cache/kvlab/budgets``.
    """
    return user_cache_dir("budgets", "KVLAB_BUDGETS_DIR", environ)


def user_cache_dir(name: str, variable: str, environ: typing.Mapping[str, str] | None = None) -> Path:
    """``$variable`` when set, else ``$XDG_CACHE_HOME/kvlab/<name>``, else ``~/.cache/kvlab/<name>``."""
    env = os.environ if environ is None else environ
    raw = (env.get(variable) or "").strip()
    if raw:
        return Path(raw).expanduser()
    cache = (env.get("XDG_CACHE_HOME") or "").strip()
    return (Path(cache) if cache else Path.home() / ".cache") / "kvlab" / name
