"""SimLayerKV (Zhang et al., 2024, "SimLayerKV: A Simple Framework for Layer-Level KV Cache Reduction").

Whole layers, not tokens: a "lazy" layer, whose last queries put almost all
their attention on the first tokens and the most recent ones, keeps only
those (``n_initial`` + a recent window); every other layer keeps every token.

Laziness, as in kvpress (``kvpress/presses/simlayerkv_press.py``,
``SimLayerKVPress.is_lazy``) and the authors' SimLayerKV-decode
(sail-sg/SimLayerKV, ``LongBench/SimLayerKV_attention_llama.py``): the
attention weights of the context's last ``n_last`` queries (causal softmax over
the whole context), averaged over the query heads and those queries, summed
over what a lazy layer keeps. kvlab's lazy layer keeps the chat template as
every method does, so that sum runs over the template, the document's first
tokens up to ``n_initial`` counted from the context's start (the template
usually holds them, as for ``streaming_llm``) and the recent window.

Ratio semantics (the paper's knob is a threshold on that sum; kvlab's methods
take a ratio, docs/methods.md): the layers are ranked by laziness, and the
laziest become lazy, as few as the ratio allows while each keeps at least the
paper's window, W = n_initial + n_recent document tokens (the initial ones the
template does not hold, the rest recent): with L compressed layers, T document
tokens and B = T / ratio, k = ceil(L (T - B) / (T - W)) lazy layers, W capped
at B; together they keep L B - (L - k) T document tokens, shared as evenly as
whole tokens allow (the laziest get the extra one), so the cache meets the
ratio exactly. This is the paper's rule with its threshold set at the k-th
layer's score (``meta["implied_threshold"]``; every layer's score is in
``meta["laziness"]``). Every layer is scored against what the laziest keeps.
When even every layer lazy at the paper's window is above the budget (W > B:
a document shorter than about ratio x W, or a high ratio) every layer is lazy
and keeps B tokens, fewer recent ones than ``n_recent``: StreamingLLM in every
layer, and ``meta["window_shrunk"]`` is true. Ratio 1 keeps every layer whole.

Differences from kvpress's press: kvpress decides by ``lazy_threshold``
(its default 1.0 compresses nothing) and leaves a document no longer than
n_initial + n_recent + n_last uncompressed; its lazy layer keeps
``n_initial`` and ``n_recent - n_last`` tokens and is scored on the first
``n_initial`` and last ``n_recent`` positions; kvlab scores exactly the set a
lazy layer keeps, template included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlab.compression.interface import EvictionMethod
from kvlab.compression.options import Options, knob
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.methods.families.scorers import recency_scores
from kvlab.runtime.attention import attention_weights, expand_kv_heads
from kvlab.runtime.cache import CompressedKV


@dataclass(frozen=True)
class SimLayerKVOptions(Options):
    n_initial: int = knob(4, "initial (sink) tokens a lazy layer keeps, counted from the context's start", low=0)
    n_recent: int = knob(1024, "recent tokens a lazy layer keeps, at least (fewer when the ratio leaves fewer)", low=1)
    n_last: int = knob(1, "the context's last queries whose attention decides laziness", low=1)


@dataclass(frozen=True)
class LazyPlan:
    """Which layers are lazy and what they keep.

    scores: [n_layers] float laziness (NaN for a layer not compressed);
    budgets: [n_layers] document tokens each layer keeps per KV head (T for a
    layer that is not lazy); lazy: the lazy layers, laziest first.
    """

    scores: list[float]
    budgets: list[int]
    lazy: list[int]
    window_shrunk: bool

    def details(self) -> dict:
        lazy_scores = [self.scores[i] for i in self.lazy]
        return {
            "lazy_layers": sorted(self.lazy),
            "laziness": [None if math.isnan(s) else round(s, 6) for s in self.scores],
            "implied_threshold": min(lazy_scores) if lazy_scores else None,
            "lazy_layer_tokens": [self.budgets[i] for i in sorted(self.lazy)],
            "window_shrunk": self.window_shrunk,
        }


def lazy_budgets(n_layers: int, doc_len: int, budget: int, window: int) -> tuple[int, list[int]]:
    """How many layers go lazy, and the document tokens each keeps, laziest first.

    n_layers: the compressed layers L; doc_len: T; budget: B = T / ratio per
    layer on average; window: the paper's n_initial + n_recent (module docstring).
    """
    if budget >= doc_len or n_layers == 0:  # nothing to drop, or every layer a sliding window's
        return 0, []
    window = min(window, budget)
    n_lazy = min(n_layers, math.ceil(n_layers * (doc_len - budget) / (doc_len - window)))
    total = n_layers * budget - (n_layers - n_lazy) * doc_len
    share, extra = divmod(total, n_lazy)
    return n_lazy, [share + 1] * extra + [share] * (n_lazy - extra)


def laziness(queries: torch.Tensor, keys: torch.Tensor, kept: torch.Tensor, scale: float | None) -> float:
    """SimLayerKV's laziness of one layer: queries [H, n, d], the context's last n; keys [H_kv, N, d],
    the whole context; kept [N] bool, what a lazy layer keeps -> the attention weight on those keys,
    averaged over the query heads and the queries."""
    weights = attention_weights(queries, expand_kv_heads(keys, queries.shape[0]), scale=scale, causal=True)
    return float(weights.mean(dim=(0, 1))[kept.to(weights.device)].sum())


def lazy_keep_mask(length: int, prefix_len: int, n_initial: int, n_doc: int, device: torch.device) -> torch.Tensor:
    """[length] bool: what a lazy layer keeping ``n_doc`` document tokens keeps: the template, the
    context's first ``n_initial`` tokens, the newest of the rest (as streaming_llm ranks them)."""
    position = torch.arange(length, device=device)
    sinks = max(0, min(n_initial - prefix_len, n_doc))
    first = position < prefix_len + sinks
    return first | (position >= length - (n_doc - sinks))


@register
class SimLayerKV(EvictionMethod):
    name = "simlayerkv"
    summary = (
        "layer-level: the laziest layers (last queries' attention on initial + recent tokens) keep only "
        "those, the others keep everything; as many lazy layers as the ratio needs"
    )
    paper = Paper(
        "Zhang et al.", 2024, "SimLayerKV: A Simple Framework for Layer-Level KV Cache Reduction", arxiv="2410.13846"
    )
    family = "selection"
    # Which layers are lazy follows a ranking of layer-wide attention shares; bf16 moves them by far less
    # than the gaps between layers, and within a layer the kept tokens are positions.
    bf16_tolerance = "same_tokens"
    Options = SimLayerKVOptions
    scores_are_importance = False  # within a layer, position (sinks and recency), as streaming_llm
    #: SimLayerKV-decode (the default, kvpress's n_last=1) and -prefill (the last 32 queries).
    presets = {"SimLayerKV-decode": {"n_last": 1}, "SimLayerKV-prefill": {"n_last": 32}}

    def plan(self, req: Request) -> LazyPlan:
        """The lazy layers and every layer's document budget for ``req``'s ratio."""
        ctx, opts = req.ctx, self.options
        layers = ctx.lm.compressed_layers
        n_lazy, shares = lazy_budgets(len(layers), ctx.doc_len, req.doc_budget, opts.n_initial + opts.n_recent)
        scores = [float("nan")] * ctx.lm.n_layers
        budgets = [min(req.doc_budget, ctx.doc_len)] * ctx.lm.n_layers  # a window layer's is not used
        for i in layers:
            budgets[i] = ctx.doc_len
        if n_lazy:
            # Every layer scored against what it would keep as the laziest (the most tokens).
            kept = lazy_keep_mask(ctx.length, ctx.prefix_len, opts.n_initial, shares[0], ctx.lm.device)
            for i in layers:
                queries = ctx.queries["context"][i][:, -opts.n_last :]
                scores[i] = laziness(queries, ctx.full.keys[i], kept, ctx.lm.geometry[i].scaling)
        order = sorted(layers, key=lambda i: -scores[i])[:n_lazy]
        for i, share in zip(order, shares):
            budgets[i] = share
        shrunk = bool(n_lazy) and min(shares) < min(ctx.doc_len, opts.n_initial + opts.n_recent)
        return LazyPlan(scores, budgets, order, shrunk)

    def head_budgets(self, req: Request) -> torch.Tensor:
        lm = req.ctx.lm
        budgets = torch.tensor(self.plan(req).budgets, dtype=torch.long, device="cpu")
        return budgets.unsqueeze(1).expand(-1, lm.n_kv_heads).to(lm.device)

    def allocation(self) -> tuple[str, str]:
        return "lazy layers", "SimLayerKV's layer budgets: lazy layers keep their sinks and recent tokens"

    def scores(self, req: Request) -> list[torch.Tensor]:
        # Within a lazy layer: the sinks, then recency (streaming_llm's scores with n_sink = n_initial).
        return recency_scores(req, self.options.n_initial)

    def compress(self, req: Request) -> CompressedKV:
        stored = super().compress(req)
        stored.meta.update(self.plan(req).details())
        return stored
