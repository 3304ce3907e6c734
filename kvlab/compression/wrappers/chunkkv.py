"""ChunkKV (Liu et al., 2025, "ChunkKV: Semantic-Preserving KV Cache Compression for
Efficient Long-Context LLM Inference", arXiv 2502.00299): keep whole chunks.

A wrapper over any scoring method (``granularity=chunk``): the document is cut
into chunks of ``chunk_size`` consecutive tokens (the paper's default: 10;
kvpress's ChunkKVPress uses 20), the last one shorter; a chunk's score is the
mean over its tokens of the token scores summed over the layer's KV heads, and
the layer keeps the best chunks, the same in every head, as the paper and
kvpress do.

Deliberate difference from kvpress: kvlab keeps exactly the budget, so the
last chunk it reaches may be kept in part (its own best tokens); kvpress keeps
``int(n_chunks * (1 - compression_ratio))`` whole chunks. The chunks start at
the document's first token (kvpress's at the context's first, the template
included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvlab.compression.budget_profiles import HeadBudgets
from kvlab.compression.options import knob
from kvlab.compression.request import Request
from kvlab.compression.stage import Stage


def chunk_means(token_scores: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """[T] token scores -> [T]: each token gets the mean score of its chunk (the last one shorter).

    A chunk holding a protected token (+inf) is protected as a whole.
    """
    length = token_scores.shape[0]
    chunk = torch.arange(length, device=token_scores.device) // chunk_size
    n_chunks = int(chunk[-1]) + 1
    sums = torch.zeros(n_chunks, device=token_scores.device).index_add_(0, chunk, token_scores.float())
    sizes = torch.bincount(chunk, minlength=n_chunks).float()
    return (sums / sizes)[chunk]


def chunk_ranks(scores: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """One layer's scores [H_kv, T] -> [H_kv, T] ranks (higher = keep) that keep whole chunks.

    Tokens are ordered by their chunk's mean of the head-summed scores, ties
    (inside a chunk) by their own head-summed score, then by position; the
    rank T - i of the i-th token is the same in every head, so a top-B of it
    is the best chunks, the last of them in part.
    """
    summed = scores.float().sum(dim=0)  # [T]
    length = summed.shape[0]
    order = torch.sort(summed, descending=True, stable=True).indices
    order = order[torch.sort(chunk_means(summed, chunk_size)[order], descending=True, stable=True).indices]
    ranks = torch.empty(length, device=scores.device)
    ranks[order] = torch.arange(length, 0, -1, dtype=torch.float32, device=scores.device)
    return ranks.expand(scores.shape[0], -1)


@dataclass(frozen=True)
class ChunkKnobs:
    """ChunkKV's knobs (:func:`chunks`); on with ``granularity=chunk``."""

    granularity: Literal["token", "chunk"] = knob(
        "token", "token, or chunk (ChunkKV: keep whole chunks of consecutive tokens, the same in every head)"
    )
    chunk_size: int = knob(10, "chunk: tokens per chunk", low=1)


def chunks(
    req: Request, scores: list[torch.Tensor], head: HeadBudgets, opts: Any
) -> tuple[list[torch.Tensor], HeadBudgets]:
    """Per layer [H_kv, T_doc] scores -> :func:`chunk_ranks` of ``opts.chunk_size``; the budgets as they are."""
    return [chunk_ranks(s, opts.chunk_size) for s in scores], head


#: Why ChunkKV runs alone: it picks chunks by one score shared by the heads, where head budgets
#: (AdaKV's) and per-head first-stage picks (CriticalKV's) have no meaning.
SHARED_CHUNKS = "ChunkKV keeps the same chunks in every head"

STAGE = Stage(
    name="chunkkv",
    order=20,
    knobs=ChunkKnobs,
    preset={"granularity": "chunk"},
    excludes={"adakv": SHARED_CHUNKS, "criticalkv": SHARED_CHUNKS},
    scores=chunks,
    records=("granularity",),
)
