"""Per-head budgets: how many document keys each KV head keeps, and where that number came from.

A ratio r asks for T / r keys per KV head *on average*. Every allocation here keeps the total at
exactly that times the heads of the layers a method compresses (equal bytes, whatever the
allocation: what a head capped at the document's T keys cannot use goes to the others), and no
head keeps more than T keys or fewer than one. One vocabulary, :data:`BUDGETS`, for the ``budgets``
knob of Attention Matching and of every scoring method, the Compare tab's budgets axis and
``kvlab compare --budgets``, each value dispatched by one function, :func:`allocation`:

- ``uniform``: T / r keys each (a method's own allocation, e.g. PyramidKV's pyramid, stays its own);
- ``profile``: the model's profile, each head's share of the total measured once by
  ``kvlab budgets`` (a sensitivity sweep, kvlab.lab.budget_sweep), shipped for the
  offline models under assets/budgets/ and kept for any other model in the user's cache
  (:func:`kvlab.paths.budgets_dir`), capped to [1/``MIN_SHARE_DIV``, ``MAX_SHARE``] x uniform as
  the published profiles are;
- ``document``: this document's own reading, each family's published way (Attention Matching: a
  share per head from how concentrated its reference queries' attention is; a scoring method:
  AdaKV's sharing of each layer's budget by the method's scores);
- ``global``: one ranking of every head's scores across heads and layers, each head keeping its
  best key first (KVzip's pruning; the Attention Matching code's global RMS budgets);
- ``auto`` (Attention Matching's default, the paper's recipe): the model's profile where it has
  one, else uniform, and the run says so.

The spellings before this vocabulary (``nonuniform``, ``adakv``) are read as today's
(:data:`BUDGET_ALIASES`), with a note where a link uses them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvlab.compression.options import MethodError
from kvlab.compression.request import Request
from kvlab.paths import assets_dir, budgets_dir
from kvlab.runtime.model import LoadedModel

#: The profiles shipped with kvlab (one per offline model).
BUDGET_DIR = assets_dir() / "budgets"
MAX_SHARE = 9.0
MIN_SHARE_DIV = 7.0

#: The head-budget allocations every ``budgets`` knob chooses from (Attention Matching adds ``auto``).
BUDGETS = ("uniform", "profile", "document", "global")
#: Old spellings of the budgets knob's values -> today's (kvlab.compression.options.knob's aliases).
BUDGET_ALIASES = {"nonuniform": "profile", "adakv": "document"}

#: What each allocation's budgets follow, in words (the page's "Keys per head" and the docs).
BUDGET_SOURCES = {
    "uniform": "the same budget for every head",
    "profile": "the model's profile (per-head sensitivity, measured once by kvlab budgets)",
    "document": "this document's reference queries (how concentrated each head's attention is)",
    "global": "one ranking of the method's scores across every head and layer",
}


@dataclass(frozen=True)
class HeadBudgets:
    """Document keys per head and where they come from.

    budgets: [n_layers, H_kv] long, on the model's device (a sliding-window
    layer's row is unused: it keeps its window); mode: the allocation used
    (a key of :data:`BUDGET_SOURCES`); source: one line naming what the
    numbers follow (a profile's file, or why the budgets are uniform).
    """

    budgets: torch.Tensor
    mode: str
    source: str

    def meta(self) -> dict[str, str]:
        """What a stored cache's meta (the run's details and ``--json``) says of its budgets."""
        return {"budgets": self.mode, "budgets_source": self.source}


def profile_name(model_name: str) -> str:
    """The file name of ``model_name``'s profile: the name in lower case, runs of other characters as one hyphen."""
    return re.sub(r"[^A-Za-z0-9]+", "-", model_name).strip("-").lower() + ".json"


def profile_path(model_name: str, folder: Path | None = None) -> Path:
    """Where ``kvlab budgets`` writes ``model_name``'s profile: ``folder``, else the user's budgets folder."""
    return (budgets_dir() if folder is None else folder) / profile_name(model_name)


def find_profile(model_name: str) -> Path | None:
    """``model_name``'s profile: one the user measured (:func:`kvlab.paths.budgets_dir`) first, then the
    shipped one, or None."""
    for folder in (budgets_dir(), BUDGET_DIR):
        path = folder / profile_name(model_name)
        if path.is_file():
            return path
    return None


def shipped_profiles() -> dict[str, list[list[float]]]:
    """The profiles shipped with kvlab: each model's name (as its profile states it) -> its shares
    [n_layers][H_kv], NaN in the layers no method compresses (sliding-window layers, when the profile
    lists ``compressed_layers``): what the Learn tab draws, without loading a model."""
    out = {}
    for path in sorted(BUDGET_DIR.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        layers = set(data.get("compressed_layers", range(len(data["shares"]))))
        out[data.get("model", path.stem)] = [
            row if i in layers else [float("nan")] * len(row) for i, row in enumerate(data["shares"])
        ]
    return out


def load_profile(lm: LoadedModel) -> tuple[torch.Tensor, str]:
    """(shares [n_layers, H_kv] float64 on the CPU, mean 1 over the compressed layers; one line naming the
    profile). MethodError when the model has none, or it cannot be read or has another shape."""
    path = find_profile(lm.name)
    if path is None:
        raise MethodError(
            f"no head-budget profile for {lm.name}; measure one with `kvlab budgets --model {lm.name}` "
            "or use budgets=uniform"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        shares = torch.tensor(data["shares"], dtype=torch.float64, device="cpu")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise MethodError(f"could not read the head-budget profile {path}: {exc}") from exc
    if shares.shape != (lm.n_layers, lm.n_kv_heads):
        raise MethodError(f"{path.name} has shape {tuple(shares.shape)}, expected {(lm.n_layers, lm.n_kv_heads)}")
    where = "shipped" if path.parent == BUDGET_DIR else str(path.parent)
    measured = f", measured on {data['document']}" if data.get("document") else ""
    return shares, f"the model's profile {path.name} ({where}{measured})"


def cap_shares(shares: torch.Tensor, lo: float = 1 / MIN_SHARE_DIV, hi: float = MAX_SHARE) -> torch.Tensor:
    """Shares clipped into [lo, hi] with their mean at 1: ``clamp(c * s, lo, hi)`` for the scale c that
    makes the mean 1 (water-filling: what a capped share gives up goes to the others in proportion to
    their shares, and a share raised to the floor takes more only once the others are full). A zero or
    negative share counts as a millionth of the mean. Needs lo <= 1 <= hi; float64, on the CPU."""
    s = shares.double().clamp_min(0)
    s = s / s.mean() if s.sum() > 0 else torch.ones_like(s)
    s = s.clamp_min(1e-6)
    n = s.numel()

    def total(c: float) -> float:
        return float((s * c).clamp(lo, hi).sum())

    # Bracket the scale, then bisect: total(c) grows with c from n*lo to n*hi.
    low, high = 1.0, 1.0
    while total(low) > n:
        low /= 2
    while total(high) < n:
        high *= 2
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if total(mid) < n else (low, mid)
    return (s * high).clamp(lo, hi)


def allocate(shares: torch.Tensor, per_head: int, length: int) -> torch.Tensor:
    """Integer budgets following ``shares`` (any shape), each in [1, length], summing to exactly
    ``min(per_head, length) * shares.numel()``.

    The shares are capped to [1/``MIN_SHARE_DIV``, ``MAX_SHARE``] x the mean and, on top, to what a
    head can hold (``length`` keys) and to at least one key (:func:`cap_shares`), so what a capped head
    cannot use goes to the others. Rounding hands the remainder to the largest fractional parts.
    """
    per_head = max(1, min(per_head, length))
    total = per_head * shares.numel()
    raw = cap_shares(shares, lo=max(1 / MIN_SHARE_DIV, 1 / per_head), hi=min(MAX_SHARE, length / per_head)) * per_head
    flat = raw.flatten().floor().long().clamp(1, length)
    frac = (raw - raw.floor()).flatten()
    # The capped shares sum to the total up to float rounding: at most a few keys to hand out or take back.
    while (left := total - int(flat.sum())) != 0:
        can = flat < length if left > 0 else flat > 1
        order = torch.argsort(torch.where(can, frac, -1.0 if left > 0 else 2.0), descending=left > 0)
        step = order[: min(abs(left), int(can.sum()))]
        flat[step] += 1 if left > 0 else -1
    return flat.view(raw.shape)


def spread(lm: LoadedModel, shares: torch.Tensor, per_head: int, length: int) -> torch.Tensor:
    """[n_layers, H_kv] budgets from per-head ``shares`` (the same shape), allocated among the layers a
    method compresses only (a sliding-window layer keeps its window; its row stays ``per_head``).
    A small integer plan, computed on the CPU and used on the model's device."""
    layers = lm.compressed_layers
    budgets = torch.full(tuple(shares.shape), max(1, min(per_head, length)), dtype=torch.long, device="cpu")
    if layers:
        budgets[layers] = allocate(shares[layers], per_head, length)
    return budgets.to(lm.device)


def uniform(req: Request, source: str = BUDGET_SOURCES["uniform"]) -> HeadBudgets:
    """Every head T / r keys."""
    return HeadBudgets(req.uniform_budgets(), "uniform", source)


def from_profile(req: Request) -> HeadBudgets:
    """The model's profile (``budgets=profile``); MethodError when it has none."""
    shares, source = load_profile(req.ctx.lm)
    return HeadBudgets(spread(req.ctx.lm, shares, req.doc_budget, req.ctx.doc_len), "profile", source)


def pooled_budgets(scores: list[torch.Tensor], per_head: int, floor: int = 1) -> torch.Tensor:
    """[n_layers, H_kv] how many of each head's keys are kept when every head keeps its best ``floor``
    and the rest of the ``n_layers * H_kv * per_head`` keys are the top scores of every head and layer
    together.

    scores: per layer [H_kv, T] on the model's device; per_head at most T, floor at most per_head.
    """
    stacked = torch.stack(scores).float()  # [L, H, T]
    n_layers, n_heads, length = stacked.shape
    flat = stacked.flatten(0, 1)  # [L * H, T]
    total = n_layers * n_heads * per_head
    counts = torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)
    if floor > 0:
        # The floor apart (not by raising scores to +inf, which a scorer's own +inf would tie with).
        best = torch.topk(flat, floor, dim=-1).indices
        flat = flat.scatter(-1, best, float("-inf"))
        counts += floor
        total -= floor * flat.shape[0]
    picked = torch.topk(flat.flatten(), total).indices
    counts += torch.bincount(picked // length, minlength=flat.shape[0])
    return counts.view(n_layers, n_heads)


def global_ranking(req: Request, scores: list[torch.Tensor]) -> HeadBudgets:
    """``budgets=global``: one ranking of ``scores`` (per layer [H_kv, T_doc]) over every head of the
    compressed layers, each head keeping at least its best key; the total that of uniform budgets."""
    ctx = req.ctx
    budgets = req.uniform_budgets()
    layers = ctx.lm.compressed_layers
    if layers:
        budgets[layers] = pooled_budgets([scores[i] for i in layers], min(req.doc_budget, ctx.doc_len)).to(
            budgets.device
        )
    return HeadBudgets(budgets, "global", BUDGET_SOURCES["global"])


def budgets_text(details: dict) -> str | None:
    """A run's head budgets in words from its details ("profile: the model's profile ..."; the
    source alone where it names the allocation already), or None for a method without budgets."""
    if "budgets_source" not in details:
        return None
    budgets, source = details["budgets"], details["budgets_source"]
    return source if source.startswith(budgets) else f"{budgets}: {source}"


def resolve(lm: LoadedModel, asked: str) -> tuple[str, str | None]:
    """The allocation ``asked`` stands for on ``lm``: ``auto`` is ``profile`` where the model has a
    profile, else ``uniform`` with the reason (the second item; None otherwise)."""
    if asked != "auto":
        return asked, None
    if find_profile(lm.name) is not None:
        return "profile", None
    return "uniform", f"uniform budgets: no profile for {lm.name} (measure one with `kvlab budgets --model {lm.name}`)"


def allocation(
    req: Request,
    asked: str,
    own: HeadBudgets,
    scores: Callable[[], list[torch.Tensor]],
    document: Callable[[], HeadBudgets],
) -> HeadBudgets:
    """The head budgets of ``budgets=asked`` (:data:`BUDGETS` or ``auto``, :func:`resolve`), for every method:
    ``own`` for uniform (the method's own allocation, the reason said when ``auto`` fell back to it),
    the model's profile, the method's ``document`` reading, or the global ranking of its ``scores()``
    (per layer [H_kv, T_doc]). ``scores`` and ``document`` are called only when asked for."""
    mode, why = resolve(req.ctx.lm, asked)
    if mode == "uniform":
        return own if why is None else HeadBudgets(own.budgets, own.mode, why)
    if mode == "profile":
        return from_profile(req)
    if mode == "document":
        return document()
    return global_ranking(req, scores())
