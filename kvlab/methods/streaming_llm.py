"""StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks").

Keep the first few tokens (attention sinks) and the most recent window; the
window is whatever the budget leaves after the sinks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.compression.interface import EvictionMethod
from kvlab.compression.options import Options, knob
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request


@dataclass(frozen=True)
class StreamingOptions(Options):
    n_sink: int = knob(4, "attention-sink tokens kept at the start of the context", low=0)
    rerotate: bool = knob(
        False, "the paper's positions: the kept keys turned to their places in the cache, what follows right "
        "after them (kvpress: KeyRerotationPress over StreamingLLMPress); false keeps each key at its token's")


@register
class StreamingLLM(EvictionMethod):
    name = "streaming_llm"
    summary = "the first 'sink' tokens + the most recent window (position only, no attention)"
    learn = (
        "Keeps the first `n_sink` tokens (\"attention sinks\", which soak up attention in every layer) and the "
        "most recent ones: $\\text{keep}=\\{1..s\\}\\cup\\{T-(B-s)+1..T\\}$. It looks at positions only, never "
        "at attention, so it is the cheapest method and forgets everything in the middle of the document. "
        "The paper gives positions within the cache, not in the text: `rerotate=true` (preset `paper`) turns the "
        "kept keys to $0..B-1$ and the question follows at $B$."
    )
    paper = Paper("Xiao et al.", 2024, "Efficient Streaming Language Models with Attention Sinks", arxiv="2309.17453")
    family = "selection"
    bf16_tolerance = "same_tokens"  # position only
    Options = StreamingOptions
    presets = {"paper": {"rerotate": True}}  # positions within the cache (section 3.2); kvpress issue #158
    scores_are_importance = False  # recency is position, not importance

    def scores(self, req: Request) -> list[torch.Tensor]:
        ctx = req.ctx
        # Recency is the score; the sinks are the context's first tokens, which
        # the template prefix usually already holds.
        score = torch.arange(ctx.doc_len, dtype=torch.float32, device=ctx.lm.device)
        score[: max(0, self.options.n_sink - ctx.prefix_len)] = float("inf")
        return [score.expand(ctx.lm.n_kv_heads, -1) for _ in range(ctx.lm.n_layers)]
