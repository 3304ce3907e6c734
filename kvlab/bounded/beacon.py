"""BeaconKV's budgeted decoding: greedy generation with at most a fixed number of keys per head.

This is the paper's own setting (long reasoning outputs): the cache never
holds more than ``budget`` keys per layer and head; before it would, each
layer evicts by the beacon scores of the running query history
(kvlab.methods.families.beacon_core: the recent queries + beacons chosen by continual
FPS over everything read and written), keeping the template prefix and a
recent window. It evicts ``evict_chunk`` tokens at a time, so it scores once
every ``evict_chunk`` written tokens rather than at every step. The policy itself is
:class:`kvlab.bounded.policies.beaconkv.BeaconPolicy`; :func:`beacon_generate` runs it after a document.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.bounded.loop import run_policy
from kvlab.bounded.policies.beaconkv import EVICT_CHUNK, BeaconPolicy
from kvlab.context import Context
from kvlab.methods import MethodError
from kvlab.methods.families.beacon_core import BeaconOptions, document_state
from kvlab.runtime.decode import Generation
from kvlab.runtime.model import LoadedModel


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
        lm,
        token_budget,
        ctx.full.stored if ctx is not None else None,
        opts,
        protected=ctx.prefix_len if ctx is not None else 0,
        evict_chunk=evict_chunk,
        state=document_state(ctx, opts, None) if ctx is not None else None,
    )
    run = run_policy(policy, prompt_ids, max_new_tokens, chunk=policy.evict_chunk, stop=stop)
    return BeaconGeneration(
        ids=run.ids, text=run.text, logprobs=run.logprobs, max_cache_len=run.max_size, evictions=len(run.events)
    )
