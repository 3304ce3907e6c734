"""One generation loop for every bounded-cache policy, and the policies that need no other module.

:func:`run_policy` reads a prompt in chunks, then writes greedily (or re-reads
a given text, teacher-forced), one token per step. Before every forward pass
the policy makes room, so the working cache (counted in keys per KV head, the
longest head) never exceeds its budget, not even during the pass. Every
shrink is recorded as a :class:`CacheEvent`.

Policies are one file each in :mod:`kvlab.bounded.policies` (found by discovery,
named in :mod:`kvlab.bounded.policy_registry`); they build on :class:`CachePolicy`
(never shrinks) or :class:`EvictionPolicy` (evicts the keys it does not choose).

Every policy works on its own session (kvlab.runtime.decode.open_session copies
a stored starting cache), so stored caches are never changed. A policy bounds
the layers a method compresses (kvlab.runtime.model.LoadedModel.compressed_layers):
a sliding-window layer keeps its window by itself, as the model does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvlab.cancellation import checkpoint
from kvlab.methods import MethodError
from kvlab.runtime.cache import CompressedKV, gather_tokens
from kvlab.runtime.decode import GrowingLayer, extend, greedy_loop, open_session, stop_token_ids
from kvlab.runtime.hooks import QueryCapture
from kvlab.runtime.model import LoadedModel

#: Prompt tokens read per forward pass by :func:`run_policy` (a budget must leave room for one chunk).
PROMPT_CHUNK = 16


@dataclass(frozen=True)
class CacheEvent:
    """One shrink of the working cache.

    position: logical position of the token about to be read; before/after:
    keys per head (longest head) around the shrink. ``step`` (generated tokens
    so far, 0 while reading the prompt) is set by :func:`run_policy`.
    """

    position: int
    before: int
    after: int
    step: int = 0


@dataclass(frozen=True)
class BeaconSnapshot:
    """BeaconKV's beacons at one eviction: the token positions they came from and in how many
    (layer, query head) rows each one is a beacon. ``step`` as in :class:`CacheEvent`."""

    position: int
    tokens: list[int]
    rows: list[int]
    step: int = 0


class CachePolicy:
    """A working cache and how it makes room; this base class never shrinks.

    A registered policy (:func:`kvlab.bounded.policy_registry.register_policy`) declares ``name`` (its file's
    name), ``label`` (how the app and the CLI's tables show it) and ``summary`` (one line: what it keeps).
    budget: keys per KV head the cache may hold (None: unbounded);
    stored: a starting cache, copied (never changed);
    options: the knobs of the method whose rule the policy applies (default ``Options()``; None
    when ``Options`` is None); protected: the template prefix length, which a policy may keep.
    """

    name = ""
    label = ""
    summary = ""
    #: The method's Options dataclass the policy takes its knobs from (None: it has none).
    Options: type | None = None
    #: Whether :meth:`observe` needs the queries of each forward pass.
    wants_queries = False

    def __init__(
        self,
        lm: LoadedModel,
        budget: int | None = None,
        stored: CompressedKV | None = None,
        options: Any = None,
        protected: int = 0,
    ):
        self.lm, self.budget, self.protected = lm, budget, protected
        self.options = options if options is not None or self.Options is None else self.Options()
        self.session = open_session(lm, stored)
        self.events: list[CacheEvent] = []
        self.beacons: list[BeaconSnapshot] = []
        #: The layers the policy bounds (and shrinks): all but the sliding-window ones.
        self.bounded = lm.compressed_layers

    def size(self) -> int:
        """Keys per head in the working cache now (the longest head, padding included), in the layers
        the policy bounds (every layer's when all are sliding-window layers: then nothing is shrunk)."""
        layers = self.session.cache.layers
        held = [layers[i] for i in (self.bounded or range(len(layers)))]
        return max((int(layer.keys.shape[-2]) for layer in held if layer.keys is not None), default=0)

    def nbytes(self) -> int:
        """Bytes of the working cache now: keys, values and (Attention Matching) biases."""
        held = [layer for layer in self.session.cache.layers if layer.keys is not None]
        total = sum(layer.keys.nbytes + layer.values.nbytes for layer in held)
        return total + sum(b.nbytes for b in self.session.key_bias or [] if b is not None)

    def check(self, chunk: int) -> None:
        """Raise MethodError when the budget cannot hold what the policy always keeps plus ``chunk`` new tokens."""

    def make_room(self, n: int) -> None:
        """Shrink, if needed, so that ``n`` more tokens fit in the budget."""

    def observe(self, queries: list[torch.Tensor] | None, positions: torch.Tensor) -> None:
        """After a forward pass over ``positions`` [n]: its post-RoPE queries per layer [H, n, d] (if wanted)."""


class EvictionPolicy(CachePolicy):
    """A plain working cache (every head holds the same number of keys) that evicts tokens.

    ``k_pos`` per layer [H_kv, L]: the logical position of every held key.
    Subclasses choose which keys stay (:meth:`choose`), in reading order.
    """

    def __init__(
        self,
        lm: LoadedModel,
        budget: int | None = None,
        stored: CompressedKV | None = None,
        options: Any = None,
        protected: int = 0,
    ):
        super().__init__(lm, budget, stored, options, protected)
        if self.session.key_bias is not None:
            raise MethodError(f"{self.name} needs a plain starting cache (no biases, the same length per head)")
        start = stored.logical_len if stored is not None else 0
        self.k_pos = [
            torch.arange(start, device=lm.device).expand(lm.n_kv_heads, -1).clone() for _ in range(lm.n_layers)
        ]

    def reserved(self) -> int:
        """Keys the policy keeps whatever their score (sinks, template prefix, a window)."""
        return 0

    def check(self, chunk: int) -> None:
        if self.budget is not None and self.budget - chunk < self.reserved() + 1:
            raise MethodError(
                f"{self.name}: a budget of {self.budget} keys per head leaves no room beyond the "
                f"{self.reserved()} it always keeps and {chunk} new tokens; raise the budget"
            )

    def target(self, n: int) -> int:
        """Keys per head to keep when ``n`` new tokens do not fit (the fewest evictions: budget - n)."""
        return self.budget - n

    def choose(self, target: int) -> list[torch.Tensor]:
        """Per bounded layer (``self.bounded``, in order), the slots [H_kv, target] to keep, ascending."""
        raise NotImplementedError

    def make_room(self, n: int) -> None:
        before = self.size()
        if self.budget is None or before + n <= self.budget or not self.bounded:
            return
        for layer, index in zip(self.bounded, self.choose(self.target(n))):
            self.keep(layer, index)
        self.events.append(CacheEvent(self.session.position, before, self.size()))

    def keep(self, layer: int, index: torch.Tensor) -> None:
        """Keep the slots ``index`` [H_kv, n] of one layer (subclasses also gather their own per-key state)."""
        cached = self.session.cache.layers[layer]
        keys, values = cached.keys[0], cached.values[0]
        self.session.cache.layers[layer] = GrowingLayer(
            gather_tokens(keys, index).unsqueeze(0), gather_tokens(values, index).unsqueeze(0)
        )
        self.k_pos[layer] = self.k_pos[layer].gather(1, index)

    def observe(self, queries: list[torch.Tensor] | None, positions: torch.Tensor) -> None:
        n_kv = self.lm.n_kv_heads
        for layer in self.bounded:  # a window layer's positions are its window's: never looked up
            self.k_pos[layer] = torch.cat([self.k_pos[layer], positions.expand(n_kv, -1)], dim=1)


@dataclass
class BoundedRun:
    """One policy's pass over a prompt and a continuation.

    ids / logprobs: the written tokens (greedy) or the given ones (teacher-forced)
    and each one's log-probability under the policy's cache; sizes / nbytes:
    keys per head and bytes of the cache each token was predicted from
    (sizes[i] for token i); max_size: the most keys per head held at any
    moment, prompt included; events / beacons: the shrinks and BeaconKV's
    beacons, with ``step`` = tokens written when they happened;
    prompt_s / decode_s: seconds reading the prompt and writing.
    """

    method: str
    budget: int | None
    ids: list[int]
    text: str
    logprobs: list[float]
    sizes: list[int] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    max_size: int = 0
    events: list[CacheEvent] = field(default_factory=list)
    beacons: list[BeaconSnapshot] = field(default_factory=list)
    prompt_s: float = 0.0
    decode_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return len(self.ids) / self.decode_s if self.decode_s > 0 else 0.0


def run_policy(
    policy: CachePolicy,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    forced: list[int] | None = None,
    chunk: int = PROMPT_CHUNK,
    stop: bool = True,
    on_token: Callable[[int], None] | None = None,
) -> BoundedRun:
    """Read ``prompt_ids`` [n] (``chunk`` tokens per pass), then write up to ``max_new_tokens``
    greedily, stopping at an end-of-turn token when ``stop``; with ``forced`` (token ids), read
    those instead and score each one (teacher forcing). on_token(tokens done) reports progress.
    """
    lm = policy.lm
    if prompt_ids.numel() == 0:
        raise MethodError("the prompt is empty")
    policy.check(max(1, min(chunk, prompt_ids.numel())))
    trace: list[tuple[int, int]] = []  # (keys per head, bytes) after each pass
    biggest = 0

    def feed(ids: torch.Tensor) -> torch.Tensor:
        nonlocal biggest
        policy.make_room(ids.numel())
        capture = QueryCapture(lm.n_layers) if policy.wants_queries else None
        positions = torch.arange(policy.session.position, policy.session.position + ids.numel(), device=lm.device)
        logits = extend(lm, policy.session, ids, capture, logits_to_keep=1)[-1]
        biggest = max(biggest, policy.size())
        policy.observe(capture.per_layer() if capture is not None else None, positions)
        trace.append((policy.size(), policy.nbytes()))
        return logits

    def feed_written(ids: torch.Tensor) -> torch.Tensor:
        logits = feed(ids)
        if on_token is not None:
            on_token(len(trace) - n_prompt_feeds + 1)
        return logits

    start = time.perf_counter()
    for first in range(0, prompt_ids.numel(), chunk):
        checkpoint()
        logits = feed(prompt_ids[first : first + chunk])
    n_prompt_feeds, gen_start = len(trace), policy.session.position
    prompt_s = time.perf_counter() - start
    start = time.perf_counter()
    if forced is None:
        gen = greedy_loop(lm, logits, feed_written, max_new_tokens, stop_token_ids(lm) if stop else set())
        ids, text, logprobs = gen.ids, gen.text, gen.logprobs
    else:
        ids, text, logprobs = list(forced), lm.tokenizer.decode(forced, skip_special_tokens=True).strip(), []
        for i, token in enumerate(ids):
            checkpoint()
            logprobs.append(float(torch.log_softmax(logits, dim=-1)[token]))
            if i + 1 < len(ids):
                logits = feed_written(torch.tensor([token], device=lm.device))
    decode_s = time.perf_counter() - start

    def step(position: int) -> int:
        # The i-th written token (0-based) is read at gen_start + i, after i + 1 were written.
        return max(0, position - gen_start + 1)

    kept = trace[n_prompt_feeds - 1 : n_prompt_feeds - 1 + len(ids)]
    return BoundedRun(
        method=policy.name,
        budget=policy.budget,
        ids=ids,
        text=text,
        logprobs=logprobs,
        sizes=[s for s, _ in kept],
        nbytes=[b for _, b in kept],
        max_size=biggest,
        events=[CacheEvent(e.position, e.before, e.after, step(e.position)) for e in policy.events],
        beacons=[BeaconSnapshot(b.position, b.tokens, b.rows, step(b.position)) for b in policy.beacons],
        prompt_s=prompt_s,
        decode_s=decode_s,
    )
