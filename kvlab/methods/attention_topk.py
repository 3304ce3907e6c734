"""Attention Matching's key selection alone (Zweiger, Fu, Guo, Kim, 2026): the paper's eviction baseline."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from kvlab.compression.interface import EvictionMethod
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.compression.selection import SelectionOptions
from kvlab.kernels import dispatch as kernels
from kvlab.methods.families.am_recipe import PAPER, QuerySourced, ScoredOptions, fitting_queries, reference_queries


@dataclass(frozen=True)
class AttentionTopKOptions(ScoredOptions, SelectionOptions):
    """The reference queries and their score (as ``attention_matching``'s), and the selection wrappers."""


@register
class AttentionTopK(QuerySourced, EvictionMethod):
    """The key selection of Attention Matching alone: the paper's eviction baseline."""

    name = "attention_topk"
    summary = "keep the keys the reference queries attend to most, bias 0, values as they were"
    paper = dataclasses.replace(PAPER, note="the eviction baseline of its ablations")
    family = "selection"
    bf16_tolerance = "near_ties"  # random weights: near-uniform attention, scores within a few bf16 roundings
    Options = AttentionTopKOptions

    def scores(self, req: Request) -> list[torch.Tensor]:
        ctx, opts = req.ctx, self.options
        out = []
        for layer, q in enumerate(reference_queries(ctx, opts, req.question)):
            keys = ctx.full.keys[layer][:, ctx.prefix_len :]
            if ctx.full.window(layer) is not None:
                # A sliding-window layer keeps its window whatever its scores (and the repeat pass keeps no
                # queries there: kvlab.queries.RepeatPass): none needed.
                out.append(torch.zeros(keys.shape[0], keys.shape[1], device=keys.device))
                continue
            grouped = fitting_queries(q, keys.shape[0], opts)
            # Chunked over the keys (a Triton kernel on CUDA): no [H_kv, n, T] matrix at long context.
            scale = ctx.lm.geometry[layer].scaling
            out.append(kernels.key_scores(grouped.to(keys.device), keys, scale=scale, scoring=opts.scoring))
        return out
