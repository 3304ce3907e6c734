"""PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on
Pyramidal Information Funneling").

SnapKV's scores, with per-layer budgets that shrink linearly with depth:
lower layers spread their attention widely and get more keys, upper layers
focus and get fewer. The total stays what the ratio allows.

The slope is the paper's ``beta``: the top layer keeps B / beta document
tokens per head and the bottom layer 2B - B / beta, where B = T / ratio is
the uniform budget (mean over layers = B). beta = 1 is uniform (SnapKV); a
larger beta is a steeper pyramid. When the bottom layer would exceed the
document (2B - B / beta > T), it is capped at T and the top layer gets
2B - T, as in the paper's code (KVCache-Factory) and kvpress.

Deliberate difference from kvpress's PyramidKVPress: kvpress (after
KVCache-Factory) falls back to uniform SnapKV budgets whenever the top
layer's budget is smaller than the observation window; kvlab always applies
the pyramid, and a layer whose budget is below the window keeps the window's
most recent tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.compression.interface import EvictionMethod
from kvlab.compression.options import knob
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.methods.families.scorers import SnapKVOptions, snap_scores


@dataclass(frozen=True)
class PyramidKVOptions(SnapKVOptions):
    beta: float = knob(
        20.0, "pyramid slope (the paper's beta): top layer keeps B/beta, bottom 2B - B/beta (1 = uniform)", low=1.0
    )


def pyramid_budgets(n_layers: int, budget: int, length: int, beta: float) -> torch.Tensor:
    """[n_layers] integer budgets decreasing linearly with depth, summing to ``n_layers * budget``.

    budget: the uniform per-layer budget B; length: the document's T (the cap).
    On the CPU (a small integer problem); the method moves them to the model's device.
    """
    total = n_layers * budget
    if n_layers == 1 or beta <= 1:
        return torch.full((n_layers,), budget, dtype=torch.long, device="cpu")
    low = budget / beta
    high = 2 * budget - low
    if high > length:
        high, low = float(length), 2 * budget - float(length)
    raw = torch.linspace(high, low, n_layers, dtype=torch.float64, device="cpu").clamp(1, length)
    out = raw.floor().long()
    # Hand rounding leftovers to the largest remainders (or, when the floor of 1
    # overshot, take them back from the biggest layers), so the total is exact.
    left = total - int(out.sum())
    if left > 0:
        room = torch.where(out < length, raw - raw.floor(), -1.0)
        out[torch.argsort(room, descending=True)[:left]] += 1
    elif left < 0:
        out[torch.argsort(torch.where(out > 1, out, 0), descending=True)[:-left]] -= 1
    return out


@register
class PyramidKV(EvictionMethod):
    name = "pyramidkv"
    summary = "SnapKV scores with per-layer budgets shrinking linearly with depth (slope beta), same total"
    paper = Paper(
        "Cai et al.",
        2024,
        "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling",
        arxiv="2406.02069",
    )
    family = "selection"
    bf16_tolerance = "same_tokens"
    Options = PyramidKVOptions

    def head_budgets(self, req: Request) -> torch.Tensor:
        lm = req.ctx.lm
        # The pyramid runs over the layers a method compresses: a sliding-window layer keeps its window.
        layers = lm.compressed_layers
        per_layer = torch.full((lm.n_layers,), req.doc_budget, dtype=torch.long, device="cpu")
        if layers:
            per_layer[layers] = pyramid_budgets(len(layers), req.doc_budget, req.ctx.doc_len, self.options.beta)
        return per_layer.unsqueeze(1).expand(-1, lm.n_kv_heads).to(lm.device)

    def allocation(self) -> tuple[str, str]:
        return "pyramid", f"PyramidKV's layer budgets, shrinking with depth (beta={self.options.beta:g})"

    def scores(self, req: Request) -> list[torch.Tensor]:
        window = min(self.options.window, req.ctx.doc_len)
        out = []
        for score in snap_scores(req, self.options.window, self.options.kernel, from_question=False):
            # SnapKV gives the whole window +inf; rank it by recency instead, above every
            # other token, so a layer whose budget is below the window keeps its newest part.
            rest = score[:, : score.shape[1] - window]
            top = float(rest.max()) if rest.numel() else 0.0
            score[:, score.shape[1] - window :] = top + 1 + torch.arange(window, dtype=score.dtype, device=score.device)
            out.append(score)
        return out
