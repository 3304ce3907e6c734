"""BeaconKV under a budget while writing: keys scored by the query history (the method's own
maths, kvlab.methods.families.beacon_core, and its options), the template prefix and a window kept.
:func:`kvlab.bounded.beacon.beacon_generate` runs it after a document (the paper's setting)."""

from __future__ import annotations

from collections import Counter

import torch

from kvlab.bounded.loop import BeaconSnapshot, EvictionPolicy
from kvlab.bounded.policy_registry import register_policy
from kvlab.compression.selection import top_k_per_head
from kvlab.methods import MethodError
from kvlab.methods.families.beacon_core import (
    BeaconBank,
    BeaconOptions,
    BeaconState,
    max_attention_scores,
    stack_layers,
)
from kvlab.runtime.cache import CompressedKV
from kvlab.runtime.model import LoadedModel
from kvlab.runtime.rope import row_cos_sin

#: Tokens evicted at once (the budget keeps room for them).
EVICT_CHUNK = 16


@register_policy
class BeaconPolicy(EvictionPolicy):
    """BeaconKV under a budget: keys scored by the query history, the template prefix and a window kept.

    protected: leading tokens (the template prefix) never evicted; state: the beacon
    state after a starting cache (default: empty, the history starts with the prompt).
    """

    name = "beaconkv"
    label = "BeaconKV"
    summary = "scores keys by recent queries + FPS beacons of the history; evicts 16 at a time"
    Options = BeaconOptions
    wants_queries = True

    def __init__(
        self,
        lm: LoadedModel,
        budget: int | None = None,
        stored: CompressedKV | None = None,
        options: BeaconOptions | None = None,
        protected: int = 0,
        evict_chunk: int = EVICT_CHUNK,
        state: BeaconState | None = None,
    ):
        super().__init__(lm, budget, stored, options, protected)
        opts = self.options
        if opts.beacon_source != "context":
            raise MethodError("budgeted BeaconKV scores with the model's own query history (beacon_source=context)")
        self.evict_chunk = max(1, evict_chunk)
        self.state = state or BeaconState(opts.n_recent, BeaconBank(opts.n_beacons, opts.buffer))

    def reserved(self) -> int:
        return self.protected + self.options.window

    def check(self, chunk: int) -> None:
        super().check(max(chunk, self.evict_chunk))

    def target(self, n: int) -> int:
        return self.budget - max(n, self.evict_chunk)

    def observe(self, queries: list[torch.Tensor] | None, positions: torch.Tensor) -> None:
        super().observe(queries, positions)
        cos, sin = row_cos_sin(self.lm, positions)
        self.state.observe(stack_layers(queries), positions, cos, sin)

    def choose(self, target: int) -> list[torch.Tensor]:
        now = self.session.position
        device = self.lm.device
        cos_now, sin_now = row_cos_sin(self.lm, torch.tensor([now], device=device))
        queries, q_pos, beacon_pos = self.state.scoring_set(cos_now, sin_now, now)
        counts = Counter(beacon_pos.flatten().tolist())
        self.beacons.append(BeaconSnapshot(now, sorted(counts), [counts[t] for t in sorted(counts)]))
        n_heads, n_kv, length = self.lm.n_heads, self.lm.n_kv_heads, self.size()
        out = []
        for layer in self.bounded:
            keys = self.session.cache.layers[layer].keys[0]
            rows = slice(layer * n_heads, (layer + 1) * n_heads)
            score = max_attention_scores(queries[rows], q_pos, keys, self.k_pos[layer], self.lm.geometry[layer].scaling)
            score[:, : self.protected] = float("inf")
            score[:, max(self.protected, length - self.options.window) :] = float("inf")
            out.append(top_k_per_head(score, torch.full((n_kv,), target, device=device)))
        return out
