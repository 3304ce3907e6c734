"""StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks").

Keep the first few tokens (attention sinks) and the most recent window; the
window is whatever the budget leaves after the sinks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.methods.base import EvictionMethod, Options, Request, knob, register


@dataclass(frozen=True)
class StreamingOptions(Options):
    n_sink: int = knob(4, "attention-sink tokens kept at the start of the context", low=0)


@register
class StreamingLLM(EvictionMethod):
    name = "streaming_llm"
    summary = "the first 'sink' tokens + the most recent window (position only, no attention)"
    learn = (
        "Keeps the first `n_sink` tokens (\"attention sinks\", which soak up attention in every layer) and the "
        "most recent ones: $\\text{keep}=\\{1..s\\}\\cup\\{T-(B-s)+1..T\\}$. It looks at positions only, never "
        "at attention, so it is the cheapest method and forgets everything in the middle of the document."
    )
    paper = "Xiao et al., 2024, Efficient Streaming Language Models with Attention Sinks"
    Options = StreamingOptions
    scores_are_importance = False  # recency is position, not importance

    def scores(self, req: Request) -> list[torch.Tensor]:
        ctx = req.ctx
        # Recency is the score; the sinks are the context's first tokens, which
        # the template prefix usually already holds.
        score = torch.arange(ctx.doc_len, dtype=torch.float32, device=ctx.lm.device)
        score[: max(0, self.options.n_sink - ctx.prefix_len)] = float("inf")
        return [score.expand(ctx.lm.n_kv_heads, -1) for _ in range(ctx.lm.n_layers)]
