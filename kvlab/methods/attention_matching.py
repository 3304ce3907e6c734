"""Attention Matching (Zweiger, Fu, Guo, Kim, 2026, "Fast KV Compaction via Attention Matching").

Each KV head's document block is replaced by t compact keys (a subset of the
original keys, RoPE phases kept), one bias beta per key and refitted values,
chosen in closed form so that, for reference queries, the block's attention
output and attention mass are preserved (kvlab.compression.compaction). The
chat-template prefix stays as it is.

PRESETS holds the published configurations under the public code's names.
The defaults are ``AM-HighestAttnKeys-basic`` (HighestAttnKeys, not
on-policy): on-policy fitting reads the document once more per layer, which
on a CPU multiplies the compression time by the number of layers, for what
the paper reports as a small gain.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from kvlab.compression.compaction import (
    AMOptions,
    LayerFit,
    QuerySourced,
    am_budgets,
    compact_cache,
    compact_layer,
    fitted_cache,
    is_window,
    reference_queries,
    source_tokens,
    window_fit,
)
from kvlab.compression.interface import Method
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.methods.kvzip import KVzipOptions, kvzip_scores
from kvlab.queries import read_after, self_study_queries
from kvlab.runtime.cache import CompressedKV

# The published configurations (the public code's algorithm configs). The
# beta bounds follow the key selection: [-3, 3] for HighestAttnKeys, at most
# 7 above and ``drop_below`` below for OMP (kvlab.compression.solvers.compact.compact_block);
# the values are always refitted by least squares. Plain OMP adds one key per
# iteration and refits every time; the fast variant four keys and every other time.
_HIGHEST_ATTN: dict[str, Any] = {"key_selection": "highest_attn", "scoring": "rms", "nnls_iters": 2}
_OMP: dict[str, Any] = {"key_selection": "omp", "keys_per_iter": 1, "refit_every": 1, "drop_below": -7.0}
PRESETS: dict[str, dict[str, Any]] = {
    "AM-HighestAttnKeys-basic": {**_HIGHEST_ATTN, "on_policy": False},
    "AM-HighestAttnKeys": {**_HIGHEST_ATTN, "on_policy": True},
    "AM-OMP-basic": {**_OMP, "on_policy": False},
    "AM-OMP": {**_OMP, "on_policy": True},
    "AM-OMP-fast": {**_OMP, "keys_per_iter": 4, "refit_every": 2, "on_policy": True},
}



@register
class AttentionMatching(QuerySourced, Method):
    name = "attention_matching"
    summary = "compact keys + per-key bias + refitted values matching attention output and mass (closed form)"
    learn = (
        "Instead of choosing which tokens to keep, Attention Matching *builds* a small cache that behaves "
        "like the big one. Each KV head's T document keys and values are replaced by t = T/r keys "
        "$C_k$ (a subset of the original keys), one scalar bias $\\beta_j$ per key, and refitted values "
        "$C_v$, so that for reference queries $q$ both the attention **mass** and the attention **output** "
        "of the block are preserved:\n\n"
        "$$\\sum_{j=1}^{t} e^{q\\cdot c_j/\\sqrt d+\\beta_j}\\approx\\sum_{j=1}^{T} e^{q\\cdot k_j/\\sqrt d},"
        "\\qquad \\operatorname{softmax}\\!\\Big(\\tfrac{qC_k^\\top}{\\sqrt d}+\\beta\\Big)C_v\\approx"
        "\\operatorname{softmax}\\!\\Big(\\tfrac{qK^\\top}{\\sqrt d}\\Big)V$$\n\n"
        "Matching both makes the compact block a drop-in replacement whatever is read after it. Three "
        "closed-form steps, no gradient descent: keep the keys the reference queries attend to most "
        "(`scoring`: RMS attention as in the published code, mean or max) or pick them by orthogonal "
        "matching pursuit (`key_selection`), fit $w=e^{\\beta}$ by non-negative least squares on the mass "
        "($\\beta$ bounded to $[-3,3]$ for HighestAttnKeys as published, to [`drop_below`, 7] for OMP), "
        "then fit $C_v$ by least squares on the outputs. $e^{\\beta_j}$ reads as "
        "\"how many original keys' worth of mass key $j$ stands for\". The reference queries come from "
        "`query_source`: a *repeat-prefill* (the model is asked to repeat the document and its queries while "
        "re-reading it are recorded), the prefill itself, self-study answers or random vectors; your question "
        "is used only with `query_source=question`.\n\n"
        "The published configurations are presets: `AM-HighestAttnKeys-basic` (the defaults), "
        "`AM-HighestAttnKeys` (the same, on-policy: each layer's queries are re-read with the layers before "
        "it already compacted), `AM-OMP-basic`, `AM-OMP` (on-policy) and `AM-OMP-fast` (more keys per OMP "
        "iteration, fewer refits). The defaults are not on-policy because that costs one more pass over the "
        "document per layer, which is slow on a CPU, for a small gain. `key_selection=kvzip` keeps KVzip's "
        "keys (the most attended while the model repeats the document) and fits their bias and values.\n\n"
        "**Knobs that aim at keeping a needle.** *What the values are pulled toward:* `value_anchor` "
        "$\\lambda>0$ fits the $C_v$ that minimises the squared error $\\lVert XC_v-Y\\rVert$ plus "
        "$\\lambda$ times the squared distance $\\lVert C_v-V_S\\rVert$, a ridge toward the kept keys' own values $V_S$ rather than toward zero ($\\lambda$ relative to the "
        "Gram's mean diagonal, as `ridge`), so a key that no reference query reads keeps its own value; "
        "`value_fit=original` keeps the values and fits only $\\beta$. *Which queries the fit sees:* "
        "`max_queries=50000` (the published runs' cap) fits on every repeat-pass query instead of a "
        "subsample; `self_study_weight` adds self-study queries (the model answering generic prompts about "
        "the document, closer to questions), each weighted in the least squares and in the scores. *Which "
        "keys:* `key_selection=kvzip_union` keeps `kvzip_share` of each head's keys by KVzip's scores and the "
        "rest by HighestAttnKeys. *Exact tokens:* `exact_share` keeps that share of each head's budget as the "
        "tokens themselves, chosen by KVzip's scores (`exact_keys=kvzip`) or by the reference queries' "
        "attention (`exact_keys=attention`), own keys and values and bias 0, outside the fit; the other compact "
        "keys are fitted only to what those leave unexplained (the block's mass and output minus the exact "
        "tokens' part, under the softmax over every slot); `exact_share=1` is eviction.\n\n"
        "**Per-head budgets** (`budgets`; the Learn tab's \"Where the budget goes\"). The paper's best results give "
        "each head a budget of its own, from a per-model sensitivity profile; so does kvlab's default (`auto`): "
        "the model's profile where it has one (both offline models do; `kvlab budgets --model M` measures one), "
        "else uniform, said in the run. `uniform` gives every head T/r keys; `document` sizes each head by how "
        "concentrated its reference queries' attention is ($\\log T$ minus the mean entropy of one query's "
        "softmax); `global` ranks every head's keys by the reference queries' RMS attention in one pool, as "
        "the published global-RMS budgets. Every allocation stores the same bytes.\n\n"
        "**What the measurements say** (tables with their commands, n, intervals and dates in "
        "docs/head-budgets.md). On five public-domain books (24 single needles of three shapes in about 1,500 "
        "tokens each) on SmolLM2-135M, at 2x, 5x, 10x and 20x: with uniform budgets this fit keeps four "
        "needles, then one, then none; with the model's profile (the default) 17/13/3/0, and KVzip, an "
        "eviction, 20/20/19/6. Where the "
        "budget goes decides more than how keys are chosen or fitted, and a small attention error still "
        "does not guarantee that a rare token survives at 10x. Self-study queries on top of the profile "
        "(`self_study_weight=4.0`) keep 20/17/11/8: no variant is within one needle of KVzip at every ratio, "
        "so for needles on that model, use KVzip. The needle trace (`python -m benchmarks.needle_view`) "
        "shows how a near miss happens: the compact keys sit on the needle's digits and draw the question's "
        "attention as in the full cache, but the refitted values lower one digit's log-probability until the "
        "answer drifts. On Gemma 3 270M (three global layers of one KV head) the profile keeps 23/24 at 2x "
        "and none from 5x on, as every eviction tried there; `beaconkv_mixed`, which quantises what it does "
        "not keep, keeps 24/24/21/15."
    )
    paper = Paper("Zweiger, Fu, Guo, Kim", 2026, "Fast KV Compaction via Attention Matching", arxiv="2602.16284")
    family = "compaction"
    bf16_tolerance = "fit"  # a least-squares fit absorbs the rounding of its inputs (test_bf16's drift check sees a solver run in bf16)
    Options = AMOptions
    presets = PRESETS

    def compress(self, req: Request) -> CompressedKV:
        ctx, opts = req.ctx, self.options
        req.progress(0.3, f"reference queries: {opts.query_source}")
        start = time.perf_counter()
        # KVzip's scores need the reconstruction pass: timed with the queries.
        exact_kvzip = opts.exact_share > 0 and opts.exact_keys == "kvzip"
        scores = kvzip_scores(req, KVzipOptions()) if opts.key_selection in ("kvzip", "kvzip_union") or exact_kvzip else None
        key_scores = scores if opts.key_selection in ("kvzip", "kvzip_union") else None
        exact_scores = scores if exact_kvzip else None
        if opts.on_policy:
            scores_s = time.perf_counter() - start
            head = am_budgets(req, opts)
            stored, queries_s = self._on_policy(req, head.budgets, key_scores, exact_scores)
            queries_s += scores_s
        else:
            queries = reference_queries(ctx, opts, req.question)
            extra = self_study_queries(ctx, opts.self_study_tokens) if opts.self_study_weight > 0 else None
            head = am_budgets(req, opts, queries)
            queries_s = time.perf_counter() - start
            req.progress(0.4, "fitting keys, biases and values")
            stored = compact_cache(ctx.full.stored, queries, head.budgets, opts, ctx.prefix_len, req.record_importance,
                                   key_scores, extra, exact_scores)
        stored.meta = {
            "method": self.name,
            "query_source": opts.query_source,
            "key_selection": opts.key_selection,
            **head.meta(),
            **stored.meta,
            "fit_s": {"queries": queries_s, **stored.meta["fit_s"]},
        }
        return stored

    def _on_policy(
        self, req: Request, budgets: torch.Tensor, key_scores: list[torch.Tensor] | None,
        exact_scores: list[torch.Tensor] | None = None,
    ) -> tuple[CompressedKV, float]:
        """Compact layer by layer, each layer's queries read with the layers before it compacted."""
        ctx, opts = req.ctx, self.options
        ids = source_tokens(ctx, opts, req.question)
        full = ctx.full.stored
        length = full.logical_len if req.record_importance else None
        fits: list[LayerFit] = []
        queries_s = 0.0
        for layer in range(ctx.lm.n_layers):
            start = time.perf_counter()
            mixed = CompressedKV([f.segments for f in fits] + full.layers[layer:], full.logical_len)
            q = read_after(ctx, ids, mixed, layers=layer + 1)[layer]
            queries_s += time.perf_counter() - start
            fits.append(window_fit(full.layers[layer], q.shape[1], length) if is_window(full.layers[layer]) else
                        compact_layer(full.layer_view(layer), q, budgets[layer], opts, ctx.prefix_len, length,
                                      None if key_scores is None else key_scores[layer],
                                      scale=ctx.lm.geometry[layer].scaling,
                                      exact_scores=None if exact_scores is None else exact_scores[layer]))
            req.progress(0.3 + 0.3 * (layer + 1) / ctx.lm.n_layers, f"on-policy: layer {layer + 1}")
        return fitted_cache(fits, full.logical_len), queries_s
