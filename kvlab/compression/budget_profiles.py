"""Per-head budgets: how many compact keys each KV head gets.

Uniform budgets give every head T / ratio keys. Non-uniform budgets follow a
per-model profile, measured once by ``python -m kvlab budgets`` (a
sensitivity sweep, kvlab.compression.compaction_sweep) and stored as JSON under assets/budgets/:
each head's share of the total, mean 1. Whatever the profile, the total over
heads stays what the global ratio allows, and no head gets more than
``MAX_SHARE`` x or less than 1/``MIN_SHARE_DIV`` of the uniform budget.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from kvlab.compression.options import MethodError
from kvlab.compression.request import Request
from kvlab.models import LoadedModel
from kvlab.paths import assets_dir

BUDGET_DIR = assets_dir() / "budgets"
MAX_SHARE = 9.0
MIN_SHARE_DIV = 7.0


def profile_path(model_name: str) -> Path:
    slug = re.sub(r"[^A-Za-z0-9]+", "-", model_name).strip("-").lower()
    return BUDGET_DIR / f"{slug}.json"


def load_shares(lm: LoadedModel) -> torch.Tensor:
    """[n_layers, H_kv] budget shares (mean 1) of this model's sensitivity profile."""
    path = profile_path(lm.name)
    if not path.is_file():
        raise MethodError(
            f"no non-uniform budget profile for {lm.name} ({path.name}); "
            "make one with `python -m kvlab budgets` or use budgets=uniform"
        )
    shares = torch.tensor(json.loads(path.read_text())["shares"], dtype=torch.float64, device="cpu")
    if shares.shape != (lm.n_layers, lm.n_kv_heads):
        raise MethodError(f"{path.name} has shape {tuple(shares.shape)}, expected {(lm.n_layers, lm.n_kv_heads)}")
    return shares


def cap_shares(shares: torch.Tensor, lo: float = 1 / MIN_SHARE_DIV, hi: float = MAX_SHARE, rounds: int = 50) -> torch.Tensor:
    """Clip shares into [lo, hi] while keeping their mean at 1 (water-filling)."""
    s = shares.clamp_min(0).double()
    s = s / s.mean() if s.sum() > 0 else torch.ones_like(s)
    for _ in range(rounds):
        clipped = s.clamp(lo, hi)
        free = (clipped > lo) & (clipped < hi)
        excess = s.numel() - clipped.sum()
        if abs(float(excess)) < 1e-9 or not bool(free.any()):
            return clipped
        s = torch.where(free, clipped + excess * clipped / clipped[free].sum(), clipped)
    return s.clamp(lo, hi)


def allocate(shares: torch.Tensor, per_head: int, length: int) -> torch.Tensor:
    """Integer budgets [L, H] with total ``per_head * L * H`` following ``shares``, each in [1, length]."""
    total = per_head * shares.numel()
    raw = cap_shares(shares) * per_head
    budgets = raw.floor().long().clamp(1, length)
    # Hand out what rounding left over to the largest remainders.
    left = int(total - budgets.sum())
    if left > 0:
        room = (budgets < length)
        order = torch.argsort(torch.where(room, raw - raw.floor(), -1.0).flatten(), descending=True)
        flat = budgets.flatten()
        flat[order[:left]] += 1
        budgets = flat.view_as(budgets).clamp(1, length)
    return budgets


def compaction_budgets(lm: LoadedModel, req: Request, mode: str) -> torch.Tensor:
    """[n_layers, H_kv] compact keys per head for ``mode`` (uniform / nonuniform)."""
    if mode == "uniform":
        return req.uniform_budgets()
    if mode == "nonuniform":
        # Allocated on the CPU (a small integer problem), used on the model's device.
        return allocate(load_shares(lm), req.doc_budget, req.ctx.doc_len).to(lm.device)
    raise MethodError(f"budgets must be uniform or nonuniform, got {mode!r}")
