"""AdaKV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
Allocation for Efficient LLM Inference", arXiv 2407.11550): head-adaptive budgets.

A wrapper over any scoring method (``budgets=document``, the preset ``adakv``): a layer's budget (the
sum of its heads' budgets under the method's own allocation) is shared among
its KV heads by one top-k over the scores of all of them, so a head whose
scores are concentrated gives keys to a head whose scores are spread out. A
safeguard keeps each head at least ``alpha_safeguard`` of the mean per-head
budget (the paper's and kvpress's default: 0.2), its own top scores first.

The same knob (``budgets``, kvlab.compression.budget_profiles' one vocabulary) also places the budget
by the model's head-budget profile (``profile``) or by one ranking across every head and layer
(``global``).

kvlab stores the result ragged (kvlab.runtime.cache.DenseSegment packs each
head's own length), so the bytes stored are those of the tokens kept. kvpress's
AdaKVPress masks the evicted keys instead and stores every key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvlab.compression.budget_profiles import BUDGET_ALIASES, HeadBudgets, allocation
from kvlab.compression.options import MethodError, knob
from kvlab.compression.request import Request
from kvlab.compression.stage import Stage


def safeguard(total: int, n_heads: int, alpha_safeguard: float) -> int:
    """Fewest tokens any head keeps: ``int(alpha_safeguard * total / n_heads)`` (kvpress's rounding)."""
    return int(alpha_safeguard * (total // n_heads))


def adakv_budgets(scores: torch.Tensor, total: int, floor: int) -> torch.Tensor:
    """One layer's head budgets: each head's top ``floor`` tokens, then the best of all heads' rest.

    scores: [H, T]; total: tokens the layer keeps (at most H * T); floor: at
    most total / H -> [H] long budgets summing to ``total``, each >= floor, on
    the scores' device.
    """
    n_heads, length = scores.shape
    flat = scores.float().clone()
    if floor > 0:
        flat.scatter_(-1, torch.topk(flat, floor, dim=-1).indices, float("inf"))
    picked = torch.topk(flat.flatten(), total).indices
    return torch.bincount(picked // length, minlength=n_heads)


#: What AdaKV's budgets follow (``budgets=document`` on a scoring method), in words.
SOURCE = "this document's scores, shared among the heads of each layer (AdaKV)"


@dataclass(frozen=True)
class AllocationKnobs:
    """Where each head's budget comes from (:func:`allocate`); on when ``budgets`` is not uniform."""

    budgets: Literal["uniform", "profile", "document", "global"] = knob(
        "uniform",
        "uniform (the method's own per-head budgets), document (AdaKV: a layer's budget shared among its heads "
        "by their scores), profile (the model's head-budget profile, as Attention Matching's) or global (one "
        "ranking of the scores across every head and layer, as KVzip's); the last three stored ragged",
        aliases=BUDGET_ALIASES,
    )
    alpha_safeguard: float = knob(
        0.2, "document: fewest tokens a head keeps, as a share of the mean per-head budget", low=0.0, high=1.0
    )


def allocate(
    req: Request, scores: list[torch.Tensor], own: HeadBudgets, opts: Any
) -> tuple[list[torch.Tensor], HeadBudgets]:
    """The head budgets ``opts.budgets`` asks for in place of the method's own (``own``, [n_layers, H_kv]),
    through the one allocation (kvlab.compression.budget_profiles.allocation): AdaKV's from the method's
    scores (per layer [H_kv, T_doc], unchanged), as kvpress's CriticalAdaKVPress, over the layer totals
    of ``own``; the model's profile; the global ranking.

    MethodError when a profile or the global ranking would replace an allocation the method makes
    itself (``own.mode`` not uniform: PyramidKV's pyramid, KVzip's pruning).
    """
    if opts.budgets in ("profile", "global") and own.mode != "uniform":
        raise MethodError(
            f"budgets={opts.budgets} would replace the method's own allocation ({own.source}); "
            "use budgets=uniform or document with it"
        )
    n_heads = own.budgets.shape[1]

    def adakv() -> HeadBudgets:
        return HeadBudgets(
            torch.stack(
                [
                    adakv_budgets(s, int(b.sum()), safeguard(int(b.sum()), n_heads, opts.alpha_safeguard))
                    for s, b in zip(scores, own.budgets)
                ]
            ),
            "document",
            SOURCE + ("" if own.mode == "uniform" else f", from {own.source}"),
        )

    return scores, allocation(req, opts.budgets, own, lambda: scores, adakv)


STAGE = Stage(name="adakv", order=10, knobs=AllocationKnobs, preset={"budgets": "document"}, scores=allocate)
