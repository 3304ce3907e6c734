"""StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks").

Keep the first few tokens (attention sinks) and the most recent window; the
window is whatever the budget leaves after the sinks. The scores are shared with simlayerkv and
bounded generation (kvlab.methods.families.scorers.recency_scores, sink_window_scores).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.compression.interface import EvictionMethod
from kvlab.compression.options import Options, knob
from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.compression.stage import Stage
from kvlab.compression.wrappers import key_rerotation
from kvlab.methods.families.scorers import N_SINK, recency_scores


@dataclass(frozen=True)
class StreamingOptions(Options):
    n_sink: int = knob(N_SINK, "attention-sink tokens kept at the start of the context", low=0)
    rerotate: bool = knob(
        False,
        "the paper's positions: the kept keys turned to their places in the cache, what follows right "
        "after them (kvpress: KeyRerotationPress over StreamingLLMPress); false keeps each key at its token's",
    )


@register
class StreamingLLM(EvictionMethod):
    name = "streaming_llm"
    summary = "the first 'sink' tokens + the most recent window (position only, no attention)"
    paper = Paper("Xiao et al.", 2024, "Efficient Streaming Language Models with Attention Sinks", arxiv="2309.17453")
    family = "selection"
    bf16_tolerance = "same_tokens"  # position only
    Options = StreamingOptions
    presets = {"paper": {"rerotate": True}}  # positions within the cache (section 3.2); kvpress issue #158
    scores_are_importance = False  # recency is position, not importance

    def scores(self, req: Request) -> list[torch.Tensor]:
        return recency_scores(req, self.options.n_sink)

    def key_stages(self) -> list[Stage]:
        """Key re-rotation by its own ``rerotate`` knob (its options are not the selection wrappers')."""
        return [key_rerotation.STAGE] if self.options.rerotate else []
