"""KeyDiff (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for
Long-Context LLM Inference in Resource-Constrained Environments", arXiv 2504.15364).

Distinctive keys matter: the anchor is the mean of the cache's normalised
keys, a_h = mean_j k_j / ||k_j||, and a token's score is minus its key's cosine
similarity to it, s_j = -cos(k_j, a_h). As kvpress's KeyDiffPress, the anchor
is taken over every key of the context (the template prefix included) and the
keys are post-RoPE. The paper evicts block by block while it reads the prompt
(kvpress: BlockPress around KeyDiffPress); kvlab scores the whole document at
once, as KeyDiffPress alone does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvlab.compression.interface import EvictionMethod
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.compression.selection import SelectionOptions


def keydiff_scores(req: Request) -> list[torch.Tensor]:
    """Per layer [H_kv, T_doc]: minus the cosine similarity of each document key to its head's anchor."""
    ctx = req.ctx
    out = []
    for keys in ctx.full.keys:
        keys = keys.float()
        anchor = F.normalize(keys, dim=-1).mean(dim=1, keepdim=True)  # [H_kv, 1, d]
        out.append(-F.cosine_similarity(keys[:, ctx.prefix_len :], anchor, dim=-1))
    return out


@register
class KeyDiff(EvictionMethod):
    name = "keydiff"
    Options = SelectionOptions
    summary = "keys least like the head's mean key direction (the most distinctive); no attention computed"
    paper = Paper(
        "Park et al.",
        2025,
        "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference "
        "in Resource-Constrained Environments",
        arxiv="2504.15364",
    )
    family = "selection"
    bf16_tolerance = "same_tokens"

    def scores(self, req: Request) -> list[torch.Tensor]:
        return keydiff_scores(req)
