"""Leverage scores (Chari & Van Durme, 2025, "Compactor: Calibrated Query-Agnostic KV Cache
Compression with Approximate Leverage Scores", arXiv 2507.08143; kvpress's LeverageScorePress).

A key that the other keys cannot express is an outlier of the key matrix, and statistical
leverage measures exactly that: with X the head's pre-RoPE keys centred over the sequence,
token j's leverage is the j-th diagonal entry of the hat matrix, x_j^T (X^T X)^{-1} x_j.
Compactor approximates it through a right Gaussian sketch Phi [d, k] (entries N(0, 1/k)):
Y = X Phi, s_j = y_j^T (Y^T Y + lambda I)^{-1} y_j, clamped at 0, and z-scored over the
layer (mean and standard deviation over every head and token), as kvpress's press does. The
ridge lambda = 1e-2 is kvpress's first Cholesky jitter (a 48 x 48 Gram matrix of a few
thousand tokens is far larger: the ridge only guards a rank-deficient head).

As in kvpress the keys are the whole context's (template prefix included) before RoPE; kvlab
stores them post-RoPE and rotates them back with the layer's own tables. The sketch is drawn
from a CPU generator seeded with ``seed`` (one draw per layer, in layer order), so a seed
means the same scores on every device; kvpress draws it from torch's global generator. The maths
is shared with compactor (kvlab.methods.families.scorers).
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
from kvlab.methods.families.scorers import gaussian_sketches, leverage, pre_rope_keys, z_score


@dataclass(frozen=True)
class LeverageOptions(SelectionOptions):
    sketch_dimension: int = knob(48, "columns k of the right Gaussian sketch Phi [d, k]", low=1)
    seed: int = knob(0, "seed of the Gaussian sketch", low=0)


def leverage_scores(req: Request, opts: LeverageOptions) -> list[torch.Tensor]:
    """Per layer [H_kv, T_doc]: z-scored approximate leverage of the context's pre-RoPE keys."""
    ctx, lm = req.ctx, req.ctx.lm
    sketches = gaussian_sketches(opts.seed, lm.n_layers, lm.n_kv_heads, lm.head_dim, opts.sketch_dimension)
    return [z_score(leverage(pre_rope_keys(req, i), sketches[i]))[:, ctx.prefix_len :] for i in range(lm.n_layers)]


@register
class Leverage(EvictionMethod):
    name = "leverage"
    summary = "keys the others cannot express: approximate statistical leverage of the pre-RoPE keys (sketched)"
    paper = Paper(
        "Chari, Van Durme",
        2025,
        "Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate Leverage Scores",
        arxiv="2507.08143",
        note="its leverage half",
    )
    family = "selection"
    bf16_tolerance = "near_ties"
    Options = LeverageOptions

    def scores(self, req: Request) -> list[torch.Tensor]:
        return leverage_scores(req, self.options)
