"""Expected Attention (Devoto, Jeblick, Jégou, 2025, "Expected Attention: KV Cache
Compression by Estimating Attention from Future Queries Distribution"; kvpress).

No attention matrix is computed. The context's queries (before RoPE) are
summarised by their mean mu and covariance Sigma per head; future queries are
assumed to follow that distribution at the next ``n_future_positions``
positions, whose RoPE rotations are averaged into one matrix R. For a
Gaussian query, E[exp(q.k / sqrt(d))] = exp(k.R mu / sqrt(d) + k^T R Sigma R^T k / (2d)),
so a key's expected attention is the softmax of that over the keys; it is
averaged over the query heads of the group and multiplied by ||v||, the
size of what the key would contribute. The first ``n_sink`` context tokens
are left out of the softmax and always kept (they are inside the template
prefix, which kvlab keeps anyway).

Follows kvpress's ExpectedAttentionPress (statistics from all context queries
but the sinks). kvlab records post-RoPE queries; the pre-RoPE ones are
recovered exactly by rotating back with the model's own RoPE tables
(kvlab.runtime.rope). The scores, their options and the query statistics are shared (capkv reads
the statistics, the merging family's ``scorer`` the scores): kvlab.methods.families.scorers.
"""

from __future__ import annotations

import torch

from kvlab.compression.interface import EvictionMethod
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.methods.families.scorers import ExpectedAttentionOptions, expected_attention_scores


@register
class ExpectedAttention(EvictionMethod):
    name = "expected_attention"
    summary = (
        "attention expected from future queries (mean + covariance of the context's queries, averaged RoPE) x ||v||"
    )
    paper = Paper(
        "Devoto, Jeblick, Jégou",
        2025,
        "Expected Attention: KV Cache Compression by Estimating Attention from Future Queries Distribution",
        arxiv="2510.00636",
    )
    family = "selection"
    bf16_tolerance = "near_ties"
    Options = ExpectedAttentionOptions

    def scores(self, req: Request) -> list[torch.Tensor]:
        return expected_attention_scores(req, self.options)
