"""AdaKV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
Allocation for Efficient LLM Inference", arXiv 2407.11550): head-adaptive budgets.

A wrapper over any scoring method (``budgets=adakv``): a layer's budget (the
sum of its heads' budgets under the method's own allocation) is shared among
its KV heads by one top-k over the scores of all of them, so a head whose
scores are concentrated gives keys to a head whose scores are spread out. A
safeguard keeps each head at least ``alpha_safeguard`` of the mean per-head
budget (the paper's and kvpress's default: 0.2), its own top scores first.

kvlab stores the result ragged (kvlab.runtime.cache.DenseSegment packs each
head's own length), so the bytes stored are those of the tokens kept. kvpress's
AdaKVPress masks the evicted keys instead and stores every key.
"""
from __future__ import annotations

import torch


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
