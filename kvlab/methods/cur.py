"""CurDKV (Sengupta, Chowdhury, Goyal, Chakraborty, 2025, "Value-Guided KV Compression for LLMs
via Approximated CUR Decomposition", arXiv 2509.15038), as kvpress's CURPress.

Leverage scores stand in for a CUR decomposition's row choice: a token whose
key (or value) row has a large share of the squared norm is hard to rebuild
from the others. With ``use_local_approximation`` (default) the squared norms
are normalised within windows of ``local_window_size`` (default 16)
consecutive context tokens, so every stretch of the context competes on its
own; the key and value leverages are combined by ``leverage_type`` (default
their product, ``kv_product``) and normalised over the context. The first
``num_sinks`` (default 4) context tokens are always kept.

As kvpress, the windows start at the context's first token (the template
prefix included). kvpress's optional random Gaussian sketch of the rows
(``use_random_leverage``, off by default) is not offered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from kvlab.compression.interface import EvictionMethod, context_scores
from kvlab.compression.options import knob
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.compression.scoring import protect
from kvlab.compression.selection import SelectionOptions


@dataclass(frozen=True)
class CUROptions(SelectionOptions):
    num_sinks: int = knob(4, "first context tokens always kept (attention sinks)", low=0)
    leverage_type: Literal["kv_product", "kv_avg", "key", "value"] = knob(
        "kv_product", "combine key and value leverages: product, mean, or one of them"
    )
    use_local_approximation: bool = knob(True, "normalise the squared norms within local windows")
    local_window_size: int = knob(16, "tokens per local window", low=1)


def local_shares(x: torch.Tensor, window: int) -> torch.Tensor:
    """[H, N] -> [H, N]: each entry's share of its window's sum (windows of ``window`` from 0, the last
    padded with 0)."""
    n = x.shape[-1]
    padded = F.pad(x, (0, (window - n % window) % window)).reshape(x.shape[0], -1, window)
    return (padded / padded.sum(dim=-1, keepdim=True)).reshape(x.shape[0], -1)[:, :n]


def cur_layer_scores(keys: torch.Tensor, values: torch.Tensor, opts: CUROptions) -> torch.Tensor:
    """One layer's context [H_kv, N, d] keys and values -> [H_kv, N] leverage scores; sinks +inf."""
    k2, v2 = keys.float().pow(2).sum(dim=-1), values.float().pow(2).sum(dim=-1)
    if opts.use_local_approximation:
        k2, v2 = local_shares(k2, opts.local_window_size), local_shares(v2, opts.local_window_size)
    combined = {"kv_product": lambda: k2 * v2, "kv_avg": lambda: (k2 + v2) / 2, "key": lambda: k2, "value": lambda: v2}
    score = combined[opts.leverage_type]()
    score = score / score.sum(dim=-1, keepdim=True)
    return protect(score, slice(0, opts.num_sinks))


@register
class CUR(EvictionMethod):
    name = "cur"
    summary = "leverage scores of the keys and values (CurDKV's CUR approximation), local windows, no attention"
    paper = Paper(
        "Sengupta, Chowdhury, Goyal, Chakraborty",
        2025,
        "Value-Guided KV Compression for LLMs via Approximated CUR Decomposition",
        arxiv="2509.15038",
        note="CurDKV",
    )
    family = "selection"
    bf16_tolerance = "same_tokens"
    Options = CUROptions

    def scores(self, req: Request) -> list[torch.Tensor]:
        return context_scores(req, lambda keys, values: cur_layer_scores(keys, values, self.options))
