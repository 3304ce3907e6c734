"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs").

Token Omission Via Attention: a token's score is the attention the last
context token pays it, averaged over all the query heads of the layer, so
every KV head of a layer keeps the same tokens (kvpress's TOVAPress does the
same). The last token itself is always kept. The scores are shared with the merging family's
``scorer`` knob (kvlab.methods.families.scorers).
"""

from __future__ import annotations

import torch

from kvlab.compression.interface import EvictionMethod
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.compression.selection import SelectionOptions
from kvlab.methods.families.scorers import tova_scores


@register
class TOVA(EvictionMethod):
    name = "tova"
    Options = SelectionOptions
    summary = "attention of the document's last token, averaged over all heads (same tokens in every head of a layer)"
    paper = Paper(
        "Oren, Hassid, Yarden, Adi, Schwartz",
        2024,
        "Transformers are Multi-State RNNs",
        arxiv="2401.06104",
        note="TOVA",
    )
    family = "selection"
    bf16_tolerance = "near_ties"

    def scores(self, req: Request) -> list[torch.Tensor]:
        return tova_scores(req)
