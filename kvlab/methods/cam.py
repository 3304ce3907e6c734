"""CaM (Zhang et al., ICML 2024, "CaM: Cache Merging for Memory-efficient LLMs Inference";
kvpress's CAMPress, kvpress/presses/cam_press.py): an evicted token's value is merged into the
kept tokens that follow it instead of being dropped.

Tokens are chosen as by the base scorer (``scorer``: kvpress's ``base_press``), per head, with
the selection wrappers. Each evicted token ``i`` then has a merge window: the ``merge_budget``
(kvpress's name; the paper's m) kept tokens after it in reading order, ``W_i`` (fewer near the
end of the document). It is merged with the probability the paper derives from its attention,

    p_i = clamp( A_i / mean_{j in W_i} A_j, 0, 1 ),   M_i ~ Bernoulli(p_i),
    v_j <- v_j + sum_{i : j in W_i} M_i v_i / |W_i|     for each kept j,

where ``A`` is the attention a token received (the paper's and kvpress's cumulative attention
of the decoding queries). kvlab compresses once, after the document's prefill, so ``A`` is the
attention received from the prefill's own queries per query that could see the token
(kvlab.methods.families.scorers.h2o_scores): in decoding every cached token is seen by every query, and a
causal prefill's plain sum would favour early tokens only for being early. Keys are kept as
they are. Every evicted token is a merge candidate (kvpress's per-step algorithm merges the
token a step evicts; its batched one the ``compression_interval`` best-scored evicted tokens;
a single compression evicts them all at once). kvpress keeps one token set for all heads (the
scores' mean over heads); kvlab keeps each head's own top budget, as its other scorers do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvlab.compression.options import knob
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.compression.selection import SelectionOptions
from kvlab.methods.families.merging_core import MergingMethod, kept_mask
from kvlab.methods.families.scorers import h2o_scores


def cam_windows(kept: torch.Tensor, lengths: torch.Tensor, merge_budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each evicted token's merge window, in rank among the kept tokens of its head.

    kept: [H, T] bool; lengths: [H] kept count -> (first, count), both [H, T] long: the window of
    evicted token i is the kept tokens of ranks first[i] .. first[i] + count[i] - 1, the
    ``merge_budget`` kept tokens after i (fewer at the end); count is 0 for a kept token.
    """
    taken = kept.long()
    first = taken.cumsum(dim=1) - taken  # kept tokens before i: the rank of the first one after it
    count = (lengths.to(kept.device).unsqueeze(1) - first).clamp(0, merge_budget)
    return first, count.masked_fill(kept, 0)


def cam_merge_probability(
    attention: torch.Tensor, kept_index: torch.Tensor, first: torch.Tensor, count: torch.Tensor
) -> torch.Tensor:
    """p_i = clamp(A_i / mean of A over i's window, 0, 1); 0 without a window.

    attention: [H, T]; kept_index: [H, K] ascending positions (padded); first, count: [H, T]
    (:func:`cam_windows`) -> [H, T] float32. A zero window mean gives 1 (0 when A_i is 0 too),
    as kvpress maps inf and NaN.
    """
    attention = attention.float()
    kept_attention = attention.gather(1, kept_index.clamp(min=0))  # [H, K]
    last = kept_index.shape[1] - 1
    total = torch.zeros_like(attention)
    for offset in range(int(count.max()) if count.numel() else 0):
        inside = offset < count
        total += torch.where(inside, kept_attention.gather(1, (first + offset).clamp(max=last)), 0.0)
    ratio = attention / (total / count.clamp(min=1))
    ratio = torch.nan_to_num(ratio, nan=0.0, posinf=1.0)
    return torch.where(count > 0, ratio.clamp(0.0, 1.0), 0.0)


def cam_merge(
    values: torch.Tensor, kept_index: torch.Tensor, first: torch.Tensor, count: torch.Tensor, merged: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept values after CaM's merge, v_j + sum over the merged i whose window holds j of v_i / |W_i|.

    values: [H, T, d]; kept_index: [H, K] ascending positions (padded); first, count: [H, T]
    (:func:`cam_windows`); merged: [H, T] bool, the drawn M_i -> (values [H, K, d] float32,
    absorbed [H, K] bool: a kept slot that received a value).
    """
    n_heads, width, dim = kept_index.shape[0], kept_index.shape[1], values.shape[-1]
    values = values.float()
    # One spare slot per head takes what goes nowhere.
    out = torch.zeros(n_heads, width + 1, dim, device=values.device)
    out[:, :width] = values.gather(1, kept_index.clamp(min=0).unsqueeze(-1).expand(-1, -1, dim))
    hits = torch.zeros(n_heads, width + 1, device=values.device)
    share = torch.where(merged, 1.0 / count.clamp(min=1), 0.0)  # [H, T]
    contribution = values * share.unsqueeze(-1)
    for offset in range(int(count.max()) if count.numel() else 0):
        slot = torch.where(merged & (offset < count), first + offset, width)
        out.scatter_add_(1, slot.unsqueeze(-1).expand(-1, -1, dim), contribution)
        hits.scatter_add_(1, slot, merged.float())
    return out[:, :width], hits[:, :width] > 0


@dataclass(frozen=True)
class CaMOptions(SelectionOptions):
    scorer: Literal["h2o", "streaming_llm", "knorm", "snapkv", "tova"] = knob(
        "h2o", "the scoring method that decides which tokens stay (kvpress's base_press; the paper: H2O's)"
    )
    merge_budget: int = knob(32, "kept tokens after an evicted one that share its value (the paper's m)", low=1)
    seed: int = knob(0, "seed of the Bernoulli merge draws (same seed, same merges)", low=0)


@register
class CaM(MergingMethod):
    name = "cam"
    summary = "evicted values merged into the kept tokens after them, each with a probability from its attention"
    paper = Paper(
        "Zhang et al.",
        2024,
        "CaM: Cache Merging for Memory-efficient LLMs Inference",
        url="https://openreview.net/forum?id=LCTmppB165",
        note="ICML 2024; kvpress's CAMPress, applied once after the prefill",
    )
    family = "merging"
    # Bernoulli draws against p compare two float32 numbers computed from bf16 keys: a p within a
    # few roundings of its draw flips one merge, as near ties flip a kept token.
    bf16_tolerance = "near_ties"
    Options = CaMOptions
    # kvpress's evaluate_registry.py configurations (its cam_* entries).
    presets = {
        "cam_streaming_llm": {"scorer": "streaming_llm"},
        "cam_knorm": {"scorer": "knorm"},
        "cam_adakv_snapkv": {"scorer": "snapkv", "budgets": "document"},
        "cam_tova": {"scorer": "tova"},
    }

    def fold(
        self, req: Request, layer: int, kept_index: torch.Tensor, lengths: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = req.ctx
        attention = h2o_scores(req)[layer]  # [H_kv, T_doc]
        kept = kept_mask(kept_index, lengths, ctx.doc_len)
        first, count = cam_windows(kept, lengths, self.options.merge_budget)
        p = cam_merge_probability(attention, kept_index, first, count)
        # Drawn on a CPU generator seeded by (seed, layer): the same merges on every device.
        draws = torch.Generator().manual_seed(self.options.seed * ctx.lm.n_layers + layer)
        uniform = torch.rand(p.shape, generator=draws, device="cpu").to(p.device)
        return cam_merge(ctx.full.values[layer][:, ctx.prefix_len :], kept_index, first, count, uniform < p)
