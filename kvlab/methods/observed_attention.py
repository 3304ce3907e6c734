"""ObservedAttention (kvpress's ObservedAttentionPress, after H2O, Zhang et al., 2023, arXiv 2306.14048).

The attention a key received from the prefill's own queries, divided by the number of
queries that could see it, averaged over the query heads of its GQA group: H2O's heavy-hitter
score (kvlab.methods.h2o, kvlab.methods.families.scorers.h2o_scores) with no recent window, every
token of the budget chosen by it.
"""

from __future__ import annotations

import torch

from kvlab.compression.interface import EvictionMethod
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.compression.selection import SelectionOptions
from kvlab.methods.families.scorers import h2o_scores


@register
class ObservedAttention(EvictionMethod):
    name = "observed_attention"
    summary = "mean attention received from the document's own queries (H2O's score, no recent window)"
    paper = Paper(
        "Zhang et al.",
        2023,
        "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
        arxiv="2306.14048",
        note="kvpress's ObservedAttentionPress: its score without the recent window",
    )
    family = "selection"
    bf16_tolerance = "same_tokens"
    Options = SelectionOptions

    # Its scores are H2O's memo itself.
    keep_scores = False

    def scores(self, req: Request) -> list[torch.Tensor]:
        return h2o_scores(req)
