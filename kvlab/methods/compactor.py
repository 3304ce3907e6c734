"""Compactor (Chari & Van Durme, 2025, "Compactor: Calibrated Query-Agnostic KV Cache Compression
with Approximate Leverage Scores", arXiv 2507.08143; kvpress's CompactorPress).

Two query-agnostic signals blended: the approximate leverage of the pre-RoPE keys (outliers
of the key matrix, kvlab.methods.leverage) and non-causal chunked attention x ||v||
(kvlab.methods.non_causal_attn; their maths in kvlab.methods.families.scorers), each z-scored over
the layer, s = lambda * z_leverage + z_attention. The first ``sink_size_start`` context tokens
and the last ``sink_size_end`` are left out of both computations (their centring, chunks and
z-scores) and always kept. As in
kvpress, lambda defaults to the share of tokens evicted (there 1 - kept/context; here of the
document, 1 - 1/ratio), "a good heuristic" by kvpress's docstring; ``blend_by_ratio=false``
fixes it at ``blending``.

The differences from kvpress's non-causal half (the attention scale, the last chunk) are
non_causal_attn's; the sketch is leverage's (seeded CPU draw).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.compression.interface import EvictionMethod
from kvlab.compression.options import knob
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.compression.selection import SelectionOptions
from kvlab.context import Memo
from kvlab.methods.families.scorers import gaussian_sketches, leverage, non_causal_layer, pre_rope_keys, z_score


@dataclass(frozen=True)
class CompactorOptions(SelectionOptions):
    sink_size_start: int = knob(8, "first context tokens always kept, outside the scoring", low=0)
    sink_size_end: int = knob(4, "last context tokens always kept, outside the scoring", low=0)
    attention_chunk: int = knob(
        256, "non-causal attention: consecutive tokens per chunk; queries attend to every key of their chunk", low=1
    )
    sketch_dimension: int = knob(48, "leverage: columns of the Gaussian sketch", low=1)
    blend_by_ratio: bool = knob(True, "lambda = the share of document tokens evicted, 1 - 1/ratio (kvpress's default)")
    blending: float = knob(0.35, "lambda, the weight of the leverage z-scores, when blend_by_ratio=false", low=0.0)
    seed: int = knob(0, "seed of the Gaussian sketch", low=0)


@dataclass(frozen=True)
class CompactorParts(Memo):
    """Where :func:`compactor_parts` keeps its z-scores: the knobs they depend on (not the blend)."""

    sink_size_start: int
    sink_size_end: int
    attention_chunk: int
    sketch_dimension: int
    seed: int


def compactor_parts(req: Request, opts: CompactorOptions) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, (z_leverage, z_attention), each [H_kv, M] over the scored middle of the context
    (tokens sink_size_start .. N - sink_size_end); ratio-free, kept per context."""
    ctx, lm = req.ctx, req.ctx.lm
    start, end = middle(ctx.length, opts)

    def make() -> list[tuple[torch.Tensor, torch.Tensor]]:
        sketches = gaussian_sketches(opts.seed, lm.n_layers, lm.n_kv_heads, lm.head_dim, opts.sketch_dimension)
        out = []
        for i, q in enumerate(ctx.queries["context"]):
            lev = leverage(pre_rope_keys(req, i)[:, start:end], sketches[i])
            att = non_causal_layer(
                q[:, start:end],
                ctx.full.keys[i][:, start:end],
                ctx.full.values[i][:, start:end],
                opts.attention_chunk,
                lm.geometry[i].scaling,
            )
            out.append((z_score(lev), z_score(att)))
        return out

    key = CompactorParts(
        opts.sink_size_start, opts.sink_size_end, opts.attention_chunk, opts.sketch_dimension, opts.seed
    )
    return ctx.cached(key, make)


def middle(length: int, opts: CompactorOptions) -> tuple[int, int]:
    """The scored tokens [start, end) of a context of ``length``: kvpress's sinks, clipped to the context."""
    start = min(opts.sink_size_start, length)
    return start, length - min(opts.sink_size_end, length - start)


@register
class Compactor(EvictionMethod):
    name = "compactor"
    summary = "leverage of the pre-RoPE keys blended with non-causal chunked attention (both z-scored); sinks kept"
    paper = Paper(
        "Chari, Van Durme",
        2025,
        "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage Scores",
        arxiv="2507.08143",
    )
    family = "selection"
    bf16_tolerance = "near_ties"
    Options = CompactorOptions
    # lambda follows the ratio by default; the two z-scored parts under it are kept per context.
    keep_scores = False

    def scores(self, req: Request) -> list[torch.Tensor]:
        opts, ctx = self.options, req.ctx
        blend = 1.0 - 1.0 / req.ratio if opts.blend_by_ratio else opts.blending
        start, end = middle(ctx.length, opts)
        out = []
        for lev, att in compactor_parts(req, opts):
            score = torch.full((lev.shape[0], ctx.length), float("inf"), device=lev.device)
            score[:, start:end] = blend * lev + att
            out.append(score[:, ctx.prefix_len :])
        return out
