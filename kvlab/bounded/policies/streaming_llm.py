"""StreamingLLM while writing: attention sinks + the most recent tokens, by the method's own keep
rule (:func:`kvlab.methods.families.scorers.sink_window_scores`) and its options."""

from __future__ import annotations

import torch

from kvlab.bounded.loop import EvictionPolicy
from kvlab.bounded.policy_registry import register_policy
from kvlab.compression.selection import top_k_per_head
from kvlab.methods.families.scorers import sink_window_scores
from kvlab.methods.streaming_llm import StreamingOptions


@register_policy
class WindowPolicy(EvictionPolicy):
    """StreamingLLM: the first ``n_sink`` tokens (attention sinks) and the most recent ones.

    Once full, writing evicts exactly one token per step (the oldest after the sinks).
    """

    name = "streaming_llm"
    label = "StreamingLLM (sinks + a sliding window)"
    summary = "4 attention sinks + the most recent tokens; evicts one per step"
    Options = StreamingOptions

    def reserved(self) -> int:
        return self.options.n_sink

    def choose(self, target: int) -> list[torch.Tensor]:
        # The cache is in reading order: a slot's index is its recency, the sinks are the first slots.
        n_kv = self.lm.n_kv_heads
        score = sink_window_scores(self.size(), self.options.n_sink, self.lm.device).expand(n_kv, -1)
        index = top_k_per_head(score, torch.full((n_kv,), target, device=self.lm.device))
        return [index for _ in self.bounded]
