"""Shared scoring maths of the attention-based eviction baselines.

H2O and KVzip both need "how much attention does each key receive from a
set of queries" (summed or maxed over the queries), TOVA a single query's
row of it; the attention itself always comes from kvlab.runtime.attention.
Scores that do not depend on the ratio are kept per context
(kvlab.context.Context.cached) so that a second ratio does not recompute them:
a method's own scores through kvlab.compression.interface.EvictionMethod.kept_scores
(kvlab.compression.interface.MethodScores), parts that several methods share
(KVzip's reconstruction scores, H2O's attention sums) through their own
function, under a key class of their own beside it (e.g.
kvlab.methods.families.scorers.KVzipScores). Nothing downstream changes a kept
score's tensors in place.
"""

from __future__ import annotations

from typing import Literal

import torch

from kvlab.runtime.attention import attention_logits, future_mask, group_queries, softmax_

# Logits per attention block (float32 elements, 16 MiB): bounds the transient
# [H, rows, T] matrices whatever the length, instead of a fixed row count whose
# block grows with T (256 rows of 32 heads at 32k keys would be 1 GiB).
BLOCK_ELEMENTS = 1 << 22


def received_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    reduce: Literal["sum", "max"] = "sum",
    causal: bool = True,
    block_elements: int = BLOCK_ELEMENTS,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention each key receives from each query head, summed or maxed over the queries.

    queries: [H, n, d], keys: [H_kv, T, d] -> [H, T] (float32); scale: the
    layer's own (kvlab.runtime.model.LayerGeometry.scaling; None: 1/sqrt(d)). With
    ``causal`` the queries are the last n of the T keys' tokens (each sees the
    keys up to its own); the softmax of every query runs over all the keys it
    can see. Computed in blocks of query rows of at most ``block_elements``
    logits; the query heads of a KV head's group are stacked against its keys
    (kvlab.runtime.attention.group_queries) rather than the keys copied per head.
    """
    n_heads, n = queries.shape[0], queries.shape[1]
    n_kv, total = keys.shape[0], keys.shape[1]
    group = n_heads // n_kv
    keys = keys.float()
    rows = max(1, block_elements // max(1, n_heads * total))
    out = torch.zeros(n_heads, total, device=keys.device)
    # One block's logits, reused by every block: a fresh matrix per block costs more than its softmax.
    buffer = torch.empty(n_heads * min(rows, n) * total, device=keys.device)
    for start in range(0, n, rows):
        end = min(start + rows, n)
        # Query i of the block sits at key position total - n + i: it sees keys up to there.
        visible = total - n + end if causal else total
        block = group_queries(queries[:, start:end].float(), n_kv)  # [H_kv, group * rows, d]
        logits = buffer[: n_heads * (end - start) * visible].view(n_kv, group * (end - start), visible)
        logits = attention_logits(block, keys[:, :visible], scale=scale, out=logits).view(
            n_kv, group, end - start, visible
        )
        if causal:  # only the block's own keys, the last end - start, can lie in a query's future
            own = logits[..., visible - (end - start) :]
            own.masked_fill_(future_mask(end - start, end - start, keys.device), float("-inf"))
        weights = softmax_(logits).view(n_heads, end - start, visible)
        if reduce == "sum":
            out[:, :visible] += weights.sum(dim=1)
        else:
            out[:, :visible] = torch.maximum(out[:, :visible], weights.amax(dim=1))
    return out


def pool_group(scores: torch.Tensor, n_kv_heads: int, how: Literal["mean", "max"]) -> torch.Tensor:
    """[H, T] per query head -> [H_kv, T]: pooled over each KV head's query-head group (GQA)."""
    grouped = scores.reshape(n_kv_heads, scores.shape[0] // n_kv_heads, -1)
    return grouped.mean(dim=1) if how == "mean" else grouped.amax(dim=1)


def protect(score: torch.Tensor, index: slice | torch.Tensor) -> torch.Tensor:
    """Mark tokens as always kept (+inf score), in place; returns ``score``."""
    score[..., index] = float("inf")
    return score
