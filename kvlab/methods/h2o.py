"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference
of Large Language Models").

A key's score is the attention it has accumulated from the context's own
queries (the prefill, causal), divided by the number of queries that can see
it: a plain sum would favour early tokens only because more queries come
after them. Scores are averaged over the query heads of each KV head's
group (kvpress's ObservedAttentionPress does the same). As in the paper, part
of each head's budget (``recent_share``) goes to the most recent tokens
("heavy hitters + recent window").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.compression.interface import EvictionMethod
from kvlab.compression.options import knob
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.compression.scoring import per_context, pool_group, protect, received_attention
from kvlab.compression.selection import SelectionOptions


@dataclass(frozen=True)
class H2OOptions(SelectionOptions):
    recent_share: float = knob(
        0.5, "share of each head's budget kept as the most recent tokens (the paper: 0.5; 0: heavy hitters only)",
        low=0.0, high=1.0)


def h2o_scores(req: Request) -> list[torch.Tensor]:
    """Per layer [H_kv, T_doc]: mean attention received from the queries that can see each key."""
    ctx = req.ctx

    def make() -> list[torch.Tensor]:
        # Key j is seen by queries j..N-1.
        seen_by = torch.arange(ctx.length, 0, -1, dtype=torch.float32, device=ctx.lm.device)
        out = []
        for layer, q in enumerate(ctx.queries["context"]):
            received = received_attention(q, ctx.full.keys[layer], reduce="sum", causal=True,
                                          scale=ctx.lm.geometry[layer].scaling)
            out.append(pool_group(received / seen_by, ctx.lm.n_kv_heads, "mean")[:, ctx.prefix_len :])
        return out

    return per_context(ctx, ("h2o",), make)


@register
class H2O(EvictionMethod):
    name = "h2o"
    summary = "heavy hitters: attention accumulated from the document's own queries (per seeing query) + recent window"
    learn = (
        "\"Heavy hitters\": tokens that received much attention while the document was read are likely to "
        "receive it again. A key's score is the attention it received from the prefill's own queries, "
        "averaged over the queries that could see it (causal) and over the query heads of its group, "
        "$s_j=\\tfrac{1}{T-j}\\sum_{i\\ge j}a_{ij}$; a share `recent_share` of each head's budget is kept for "
        "the most recent tokens."
    )
    paper = Paper(
        "Zhang et al.", 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models",
        arxiv="2306.14048")
    family = "selection"
    bf16_tolerance = "same_tokens"  # attention summed over the whole prefill: no near ties
    Options = H2OOptions
    # The recent window is a share of the budget; the heavy-hitter scores under it are kept per context.
    keep_scores = False

    def scores(self, req: Request) -> list[torch.Tensor]:
        recent = min(round(self.options.recent_share * req.doc_budget), req.ctx.doc_len)
        out = []
        for score in h2o_scores(req):
            score = score.clone()
            if recent:
                protect(score, slice(req.ctx.doc_len - recent, None))
            out.append(score)
        return out
