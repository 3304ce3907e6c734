"""LagKV (Liang, Zhang, Li, Li, 2025, "LagKV: Lag-Relative Information of the KV Cache Tells
Which Tokens Are Important", arXiv 2504.04704).

Attention-free: after ``n_sink`` sink tokens the context is cut into
partitions of ``lag_size`` tokens, and each partition is judged against the
next one (its "lag" reference). Keys and values are min-max normalised per
channel by the reference partition's minimum and maximum; a token's score is
the softmax, over its partition, of the standard deviation across channels of
its normalised key, plus the same for its value: tokens that stand out from
what follows are kept. The last full partition and the remainder have no
reference and are always kept (a recent window), as are the sinks.

Follows kvpress's LagKVPress (its defaults: n_sink 4, lag_size 128; the
context's partitions start after its first ``n_sink`` tokens, template
included): without ``cross_scoring`` each token is scored by its rank within
its partition, so every partition keeps about the same share. A context
shorter than ``n_sink + 2 * lag_size`` is scored by recency. Deliberate
difference: a reference channel whose maximum equals its minimum divides by
a tiny number instead of 0 (kvpress would produce NaN scores there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.compression.interface import EvictionMethod, context_scores
from kvlab.compression.options import knob
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.compression.selection import SelectionOptions


@dataclass(frozen=True)
class LagKVOptions(SelectionOptions):
    n_sink: int = knob(4, "first context tokens always kept (attention sinks); partitions start after them", low=0)
    lag_size: int = knob(128, "partition length: each partition is normalised by the next one's range", low=1)
    cross_scoring: bool = knob(False, "compare raw scores across partitions instead of ranks within each")


def lag_relative_scores(states: torch.Tensor) -> torch.Tensor:
    """[H, P, L, d] partitions -> [H, P - 1, L]: softmax over each partition of the channel std of
    its states min-max normalised by the next partition's range."""
    ref, cur = states[:, 1:], states[:, :-1]
    low, high = ref.amin(dim=2, keepdim=True), ref.amax(dim=2, keepdim=True)
    normed = (cur - low) / (high - low).clamp_min(torch.finfo(states.dtype).tiny)
    return normed.std(dim=-1, correction=1).softmax(dim=-1)


def lagkv_layer_scores(keys: torch.Tensor, values: torch.Tensor, opts: LagKVOptions) -> torch.Tensor:
    """One layer's context [H_kv, N, d] keys and values -> [H_kv, N] LagKV scores in [0, 1] (1: always kept)."""
    n_kv, n, _ = keys.shape
    sink, lag = opts.n_sink, opts.lag_size
    score = torch.ones(n_kv, n, device=keys.device)
    if n < sink + 2 * lag:  # no partition has a reference: keep the newest
        if n > sink:
            score[:, sink:] = torch.arange(n - sink, device=keys.device) / (n - sink)
        return score
    end = sink + (n - sink) // lag * lag  # the last full partition and the rest: the kept tail
    parts = lambda x: x[:, sink:end].float().reshape(n_kv, -1, lag, x.shape[-1])  # noqa: E731
    lagged = (lag_relative_scores(parts(keys)) + lag_relative_scores(parts(values))) / 2  # [H, P - 1, L]
    if not opts.cross_scoring:
        lagged = lagged.argsort(dim=-1).argsort(dim=-1) / lag
    score[:, sink : end - lag] = lagged.reshape(n_kv, -1)
    return score


@register
class LagKV(EvictionMethod):
    name = "lagkv"
    summary = (
        "attention-free: tokens that stand out from the next partition's range (lag-relative), "
        "plus sinks and a recent tail"
    )
    paper = Paper(
        "Liang, Zhang, Li, Li",
        2025,
        "LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are Important",
        arxiv="2504.04704",
    )
    family = "selection"
    bf16_tolerance = "same_tokens"
    Options = LagKVOptions

    def scores(self, req: Request) -> list[torch.Tensor]:
        return context_scores(req, lambda keys, values: lagkv_layer_scores(keys, values, self.options))
