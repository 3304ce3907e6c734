"""BeaconKV's budgeted decoding: greedy generation with at most a fixed number of keys per head.

This is the paper's own setting (long reasoning outputs): the cache never
holds more than ``budget`` keys per layer and head; before it would, each
layer evicts by the beacon scores of the running query history
(kvlab.compression.beacon_core: the recent queries + beacons chosen by continual
FPS over everything read and written), keeping the template prefix and a
recent window. It evicts ``evict_chunk`` tokens at a time, so it scores once
every ``evict_chunk`` written tokens rather than at every step.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from kvlab.bounded.generate import BeaconSnapshot, EvictionPolicy, run_policy
from kvlab.compression.beacon_core import BeaconBank, BeaconState, max_attention_scores, stack_layers
from kvlab.compression.selection import top_k_per_head
from kvlab.context import Context
from kvlab.methods import MethodError
from kvlab.methods.beaconkv import BeaconOptions, document_state
from kvlab.runtime.cache import CompressedKV
from kvlab.runtime.decode import Generation
from kvlab.runtime.model import LoadedModel
from kvlab.runtime.rope import row_cos_sin

#: Tokens evicted at once (the budget keeps room for them).
EVICT_CHUNK = 16


class BeaconPolicy(EvictionPolicy):
    """BeaconKV under a budget: keys scored by the query history, the template prefix and a window kept.

    protected: leading tokens (the template prefix) never evicted; state: the beacon
    state after a starting cache (default: empty, the history starts with the prompt).
    """

    name = "beaconkv"
    wants_queries = True

    def __init__(self, lm: LoadedModel, budget: int | None = None, stored: CompressedKV | None = None,
                 options: BeaconOptions | None = None, protected: int = 0, evict_chunk: int = EVICT_CHUNK,
                 state: BeaconState | None = None):
        super().__init__(lm, budget, stored)
        self.opts = options or BeaconOptions()
        if self.opts.beacon_source != "context":
            raise MethodError("budgeted BeaconKV scores with the model's own query history (beacon_source=context)")
        self.protected, self.evict_chunk = protected, max(1, evict_chunk)
        self.state = state or BeaconState(self.opts.n_recent, BeaconBank(self.opts.n_beacons, self.opts.buffer))

    def reserved(self) -> int:
        return self.protected + self.opts.window

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
            score[:, max(self.protected, length - self.opts.window) :] = float("inf")
            out.append(top_k_per_head(score, torch.full((n_kv,), target, device=device)))
        return out


@dataclass
class BeaconGeneration(Generation):
    """A greedy answer under a token budget: also the largest physical cache seen and how often it evicted."""

    max_cache_len: int = 0
    evictions: int = 0


def beacon_generate(
    lm: LoadedModel,
    ctx: Context | None,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    token_budget: int,
    options: BeaconOptions | None = None,
    evict_chunk: int = EVICT_CHUNK,
    stop: bool = True,
) -> BeaconGeneration:
    """Greedy decoding with at most ``token_budget`` keys per layer and head, after ``ctx``'s document.

    Starts from a copy of ``ctx``'s full cache (or an empty one) and its beacon
    state, reads ``prompt_ids`` then its own tokens, ``evict_chunk`` at a time;
    before the cache would exceed the budget, each layer evicts down to
    ``token_budget - evict_chunk`` keys per head (see :class:`BeaconPolicy`).
    """
    opts = options or BeaconOptions()
    if opts.beacon_source != "context":
        raise MethodError("beacon_generate scores with the model's own query history (beacon_source=context)")
    policy = BeaconPolicy(
        lm, token_budget, ctx.full.stored if ctx is not None else None, opts,
        protected=ctx.prefix_len if ctx is not None else 0, evict_chunk=evict_chunk,
        state=document_state(ctx, opts, None) if ctx is not None else None,
    )
    run = run_policy(policy, prompt_ids, max_new_tokens, chunk=policy.evict_chunk, stop=stop)
    return BeaconGeneration(ids=run.ids, text=run.text, logprobs=run.logprobs,
                            max_cache_len=run.max_size, evictions=len(run.events))
