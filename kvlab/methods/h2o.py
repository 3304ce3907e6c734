"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference
of Large Language Models").

A key's score is the attention it has accumulated from the context's own
queries (the prefill, causal), divided by the number of queries that can see
it: a plain sum would favour early tokens only because more queries come
after them. Scores are averaged over the query heads of each KV head's
group (kvpress's ObservedAttentionPress does the same). As in the paper, part
of each head's budget (``recent_share``) goes to the most recent tokens
("heavy hitters + recent window"). The scores are shared (kvlab.methods.families.scorers:
observed_attention and cam read the heavy hitters too).
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
from kvlab.methods.families.scorers import H2O_RECENT_SHARE, h2o_recent_scores


@dataclass(frozen=True)
class H2OOptions(SelectionOptions):
    recent_share: float = knob(
        H2O_RECENT_SHARE,
        "share of each head's budget kept as the most recent tokens (the paper: 0.5; 0: heavy hitters only)",
        low=0.0,
        high=1.0,
    )


@register
class H2O(EvictionMethod):
    name = "h2o"
    summary = "heavy hitters: attention accumulated from the document's own queries (per seeing query) + recent window"
    paper = Paper(
        "Zhang et al.",
        2023,
        "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
        arxiv="2306.14048",
    )
    family = "selection"
    bf16_tolerance = "same_tokens"  # attention summed over the whole prefill: no near ties
    Options = H2OOptions
    # The recent window is a share of the budget; the heavy-hitter scores under it are kept per context.
    keep_scores = False

    def scores(self, req: Request) -> list[torch.Tensor]:
        return h2o_recent_scores(req, self.options.recent_share)
