"""KNorm (Devoto, Zhao, Scardapane, Minervini, 2024, "A Simple and Effective L2 Norm-Based
Strategy for KV Cache Compression", EMNLP 2024, arXiv 2406.11430).

Keys with a small L2 norm draw high attention (the paper's observation), so a
token's score is minus its key's norm, s_j = -||k_j||_2. No attention, no
query, no knob (as the paper and kvpress's KnormPress). RoPE rotates each key
without changing its norm, so kvlab's post-RoPE keys give the paper's scores. The scores are
shared with the merging family's ``scorer`` knob (kvlab.methods.families.scorers).
"""

from __future__ import annotations

import torch

from kvlab.compression.interface import EvictionMethod
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.compression.selection import SelectionOptions
from kvlab.methods.families.scorers import knorm_scores


@register
class KNorm(EvictionMethod):
    name = "knorm"
    Options = SelectionOptions
    summary = "keys with the smallest L2 norm (they draw the most attention); no attention computed"
    paper = Paper(
        "Devoto, Zhao, Scardapane, Minervini",
        2024,
        "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression",
        arxiv="2406.11430",
    )
    family = "selection"
    bf16_tolerance = "near_ties"  # the same word some positions on has a key norm within a few bf16 roundings

    def scores(self, req: Request) -> list[torch.Tensor]:
        return knorm_scores(req)
