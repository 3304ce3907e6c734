"""BeaconKV's budgeted decoding: greedy generation with at most a fixed number of keys per head.

This is the paper's own setting (long reasoning outputs): the cache never
holds more than ``token_budget`` keys per layer and head; before it would,
each layer evicts by the beacon scores of the running query history
(kvlab.methods.beacon_core), keeping the template prefix and a recent window.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.context import Context
from kvlab.methods.base import MethodError, top_k_per_head
from kvlab.methods.beacon import BeaconOptions, document_state
from kvlab.methods.beacon_core import BeaconBank, BeaconState, key_scores, stack_layers
from kvlab.models import LoadedModel
from kvlab.runtime.cache import gather_tokens
from kvlab.runtime.decode import GrowingLayer, Generation, extend, greedy_loop, open_session, stop_token_ids
from kvlab.runtime.hooks import QueryCapture
from kvlab.runtime.rope import rope_cos_sin


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
    evict_chunk: int = 16,
    stop: bool = True,
) -> BeaconGeneration:
    """Greedy decoding with at most ``token_budget`` keys per layer and head (the paper's setting).

    Starts from ``ctx``'s full cache (or an empty one) and reads ``prompt_ids``
    then its own tokens, in chunks of at most ``evict_chunk`` tokens. Before a
    chunk would make the physical cache exceed the budget, each layer evicts
    down to ``token_budget - evict_chunk`` keys per head: it keeps the template
    prefix (``ctx.prefix_len`` tokens), the ``window`` most recent tokens and the
    best-scored others, scored by the running query history (recent queries +
    beacons from continual FPS, rotated to the current position). Every head
    keeps the same number of keys, so the working cache stays plain.
    ``options.beacon_source`` must be ``context`` (the model's own queries).
    """
    opts = options or BeaconOptions()
    if opts.beacon_source != "context":
        raise MethodError("beacon_generate scores with the model's own query history (beacon_source=context)")
    chunk = max(1, evict_chunk)
    keep_prefix = ctx.prefix_len if ctx is not None else 0
    if token_budget - chunk < keep_prefix + opts.window + 1:
        raise MethodError(
            f"token_budget {token_budget} leaves no room beyond the template ({keep_prefix}), "
            f"the window ({opts.window}) and one eviction chunk ({chunk})")
    session = open_session(lm, ctx.full.stored if ctx is not None else None)
    if session.key_bias is not None:
        raise MethodError("beacon_generate needs a plain starting cache")
    n_kv = lm.n_kv_heads
    n_heads = lm.n_heads
    k_pos: list[torch.Tensor] = [torch.zeros(n_kv, 0, dtype=torch.long) for _ in range(lm.n_layers)]
    if ctx is not None:
        state = document_state(ctx, opts, None)
        k_pos = [torch.arange(ctx.length).expand(n_kv, -1).clone() for _ in range(lm.n_layers)]
    else:
        state = BeaconState(opts.n_recent, BeaconBank(opts.n_beacons, opts.buffer))
    stats = {"max": 0, "evictions": 0}

    def physical() -> int:
        layers = session.cache.layers
        return int(layers[0].keys.shape[-2]) if layers else 0

    def evict_to(target: int) -> None:
        now = session.position
        cos_now, sin_now = rope_cos_sin(lm, torch.tensor([now]))
        queries, q_pos, _ = state.scoring_set(cos_now, sin_now, now)
        for layer in range(lm.n_layers):
            cached = session.cache.layers[layer]
            keys, values = cached.keys[0], cached.values[0]
            length = keys.shape[1]
            rows = slice(layer * n_heads, (layer + 1) * n_heads)
            score = key_scores(queries[rows], q_pos, keys.float().cpu(), k_pos[layer])
            score[:, :keep_prefix] = float("inf")
            score[:, max(keep_prefix, length - opts.window) :] = float("inf")
            index = top_k_per_head(score, torch.full((n_kv,), target))
            session.cache.layers[layer] = GrowingLayer(
                gather_tokens(keys, index).unsqueeze(0), gather_tokens(values, index).unsqueeze(0))
            k_pos[layer] = k_pos[layer].gather(1, index)
        stats["evictions"] += 1

    def feed(ids: torch.Tensor) -> torch.Tensor:
        n = ids.numel()
        if physical() + n > token_budget:
            evict_to(token_budget - max(n, chunk))
        capture = QueryCapture(lm.n_layers)
        positions = torch.arange(session.position, session.position + n)
        logits = extend(lm, session, ids, capture, logits_to_keep=1)[-1]
        stats["max"] = max(stats["max"], physical())
        cos, sin = rope_cos_sin(lm, positions)
        state.observe(stack_layers(capture.per_layer()), positions, cos, sin)
        for layer in range(lm.n_layers):
            k_pos[layer] = torch.cat([k_pos[layer], positions.expand(n_kv, -1)], dim=1)
        return logits

    logits = None
    for start in range(0, prompt_ids.numel(), chunk):
        logits = feed(prompt_ids[start : start + chunk])
    if logits is None:
        raise MethodError("beacon_generate needs a non-empty prompt")
    gen = greedy_loop(lm, logits, feed, max_new_tokens, stop_token_ids(lm) if stop else set())
    return BeaconGeneration(ids=gen.ids, text=gen.text, logprobs=gen.logprobs,
                            max_cache_len=stats["max"], evictions=stats["evictions"])
