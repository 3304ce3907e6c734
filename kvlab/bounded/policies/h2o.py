"""H2O while writing: heavy hitters by accumulated attention + a recent window, by the method's own
maths (:func:`kvlab.methods.families.scorers.received_per_group`,
:func:`kvlab.methods.families.scorers.protect_recent`) and options."""

from __future__ import annotations

import torch

from kvlab.bounded.loop import EvictionPolicy
from kvlab.bounded.policy_registry import register_policy
from kvlab.compression.selection import top_k_per_head
from kvlab.methods.families.scorers import protect_recent, received_per_group
from kvlab.methods.h2o import H2OOptions
from kvlab.runtime.cache import CompressedKV
from kvlab.runtime.model import LoadedModel


@register_policy
class H2OPolicy(EvictionPolicy):
    """H2O in its decoding setting: every key accumulates the attention it receives (summed over
    the queries read so far, averaged over its GQA group); when full, each head keeps the
    ``recent_share`` most recent keys and the heaviest hitters among the others. Once full,
    writing evicts one token per step."""

    name = "h2o"
    label = "H2O"
    summary = "accumulated attention (heavy hitters) + a recent half; evicts one per step"
    Options = H2OOptions
    wants_queries = True

    def __init__(
        self,
        lm: LoadedModel,
        budget: int | None = None,
        stored: CompressedKV | None = None,
        options: H2OOptions | None = None,
        protected: int = 0,
    ):
        super().__init__(lm, budget, stored, options, protected)
        # A starting cache's keys have received no attention that this policy saw.
        self.scores = [torch.zeros(p.shape, dtype=torch.float32, device=p.device) for p in self.k_pos]

    def reserved(self) -> int:
        return round(self.options.recent_share * self.budget) if self.budget is not None else 0

    def observe(self, queries: list[torch.Tensor] | None, positions: torch.Tensor) -> None:
        super().observe(queries, positions)
        n_kv, n = self.lm.n_kv_heads, positions.numel()
        for layer in self.bounded:
            keys = self.session.cache.layers[layer].keys[0]
            received = received_per_group(queries[layer], keys, n_kv, self.lm.geometry[layer].scaling)
            fresh = torch.zeros(n_kv, n, device=keys.device)
            self.scores[layer] = torch.cat([self.scores[layer], fresh], dim=1) + received

    def choose(self, target: int) -> list[torch.Tensor]:
        out = []
        for layer in self.bounded:
            score = protect_recent(self.scores[layer].clone(), self.options.recent_share, target)
            out.append(top_k_per_head(score, torch.full((self.lm.n_kv_heads,), target, device=score.device)))
        return out

    def keep(self, layer: int, index: torch.Tensor) -> None:
        super().keep(layer, index)
        self.scores[layer] = self.scores[layer].gather(1, index)
