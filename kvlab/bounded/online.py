"""Online compaction: a bounded cache that compacts itself while the model reads and writes on.

Whenever the physical cache (keys stored per head, padded) reaches a budget,
it is compacted by Attention Matching to half the budget and reading goes on
from the compacted cache; positions stay logical throughout. The reference
queries of each compaction are the queries of everything read since the
document, so the fit never looks at tokens still to come. Here: the compactions and
:func:`bounded_logprobs` (teacher-forced); the generation policy is
:class:`kvlab.bounded.policies.online_am.OnlineAMPolicy`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvlab.cancellation import checkpoint
from kvlab.methods.families.am_recipe import AMOptions
from kvlab.methods.families.compaction import compact_cache, is_window
from kvlab.runtime.cache import CompressedKV, DenseSegment, Segment, segment_from_view, select_keys, window_segment
from kvlab.runtime.decode import Session, extend, open_session
from kvlab.runtime.hooks import QueryCapture
from kvlab.runtime.model import LoadedModel


@dataclass
class Compaction:
    """One compaction event: at which logical position, physical length before and after, seconds."""

    position: int
    before: int
    after: int
    seconds: float


@dataclass
class OnlineResult:
    """Teacher-forced log-probabilities [m] of the target under the bounded cache, and the events."""

    logprobs: torch.Tensor
    compactions: list[Compaction] = field(default_factory=list)


def physical_length(stored: CompressedKV, appended: int) -> int:
    """Longest head's stored keys plus the tokens appended since, in the layers compaction bounds
    (a sliding-window layer keeps its own window)."""
    bounded = [i for i, layer in enumerate(stored.layers) if not is_window(layer)]
    return (int(stored.kept_per_head()[bounded].max()) if bounded else 0) + appended


def moved_window(lm: LoadedModel, session: Session, layer: int) -> list[Segment]:
    """A sliding-window layer of a session, as stored: its window now (the layer holds the latest
    tokens, consecutive, up to the session's position)."""
    work = session.cache.layers[layer]
    keys, values = work.keys[0], work.values[0]
    return [window_segment(keys, values, lm.geometry[layer].window, session.position - keys.shape[1])]


def read_so_far(lm: LoadedModel, session: Session) -> CompressedKV:
    """A session that started from an empty cache, as one stored cache: every token read (positions
    0..), a sliding-window layer's window."""
    layers: list[list[Segment]] = []
    for i, work in enumerate(session.cache.layers):
        if lm.geometry[i].window is not None:
            layers.append(moved_window(lm, session, i))
            continue
        keys, values = work.keys[0], work.values[0]
        n_heads, length = keys.shape[:2]
        index = torch.arange(length, device=keys.device).expand(n_heads, length)
        lengths = torch.full((n_heads,), length, device=keys.device)
        layers.append([DenseSegment.from_padded(keys, values, lengths, index, fate="read")])
    return CompressedKV(layers, session.position, scales=[g.scaling for g in lm.geometry])


def with_appended(lm: LoadedModel, stored: CompressedKV, session: Session, appended: int) -> CompressedKV:
    """The stored cache plus the tokens a session appended to it, as one stored cache.

    The appended tokens sit after each layer's padded stored view in the
    session's working layers; they get fate "read" and their logical positions.
    A sliding-window layer is stored as its window now.
    """
    layers = []
    first = session.position - appended
    for i, segments in enumerate(stored.layers):
        if lm.geometry[i].window is not None:
            layers.append(moved_window(lm, session, i))
            continue
        work = session.cache.layers[i]
        keys, values = work.keys[0, :, -appended:], work.values[0, :, -appended:]
        n_heads, device = keys.shape[0], keys.device
        index = torch.arange(first, session.position, device=device).expand(n_heads, appended)
        lengths = torch.full((n_heads,), appended, device=device)
        new = DenseSegment.from_padded(keys, values, lengths, index, fate="read")
        layers.append(list(segments) + [new])
    return CompressedKV(layers, session.position, meta=dict(stored.meta), scales=[g.scaling for g in lm.geometry])


# (cache to shrink, queries read so far per layer [H, n, d], keys to keep per head
# outside the protected prefix, protected prefix length) -> smaller cache
Compactor = Callable[[CompressedKV, list[torch.Tensor], int, int], CompressedKV]


def am_compactor(opts: AMOptions = AMOptions()) -> Compactor:
    """Re-compact with Attention Matching (the cache's own biases enter the targets)."""

    def compact(stored: CompressedKV, queries: list[torch.Tensor], keep: int, protected: int) -> CompressedKV:
        first = stored.layer_view(0).keys
        budgets = torch.full((stored.n_layers, first.shape[0]), keep, device=first.device)
        return compact_cache(stored, queries, budgets, opts, protected)

    return compact


def window_compactor(stored: CompressedKV, queries: list[torch.Tensor], keep: int, protected: int) -> CompressedKV:
    """The sliding-window baseline: keep the protected prefix and the ``keep`` most recent tokens
    (a sliding-window layer keeps its own window)."""
    layers: list[list[Segment]] = []
    for i in range(stored.n_layers):
        if is_window(stored.layers[i]):
            layers.append(list(stored.layers[i]))
            continue
        view = stored.layer_view(i)
        recent = view.token_index >= 0
        cut = torch.sort(torch.where(recent, view.token_index, -1), dim=1, descending=True).values
        threshold = cut[:, min(keep, cut.shape[1]) - 1 : min(keep, cut.shape[1])]
        kept = select_keys(view, (view.token_index >= threshold) | ((view.token_index < protected) & recent))
        layers.append([segment_from_view(kept, fate="kept")])
    return CompressedKV(layers, stored.logical_len, meta=dict(stored.meta))


def bounded_logprobs(
    lm: LoadedModel,
    stored: CompressedKV,
    ids: torch.Tensor,
    n_target: int,
    budget: int,
    protected: int,
    compactor: Compactor | None = None,
) -> OnlineResult:
    """Read ``ids`` [n] after ``stored`` with at most ``budget`` keys per head, shrinking
    the cache to budget/2 (Attention Matching by default) whenever the budget is reached.

    Returns the log-probabilities of the last ``n_target`` tokens of ``ids``
    (each predicted from what came before it), and the compaction events.
    protected: leading tokens (the template prefix) never compacted.
    """
    if budget <= 2 * protected + 2:
        raise ValueError(f"budget {budget} leaves no room after {protected} protected tokens")
    compactor = compactor or am_compactor()
    session, appended = open_session(lm, stored), 0
    capture = QueryCapture(lm.n_layers)
    logits: list[torch.Tensor] = []
    events: list[Compaction] = []
    done = 0
    while done < ids.numel():
        checkpoint()
        room = budget - physical_length(stored, appended)
        if room <= 0:
            start = time.perf_counter()
            before = physical_length(stored, appended)
            full = with_appended(lm, stored, session, appended)
            stored = compactor(full, capture.per_layer(), budget // 2 - protected, protected)
            session, appended = open_session(lm, stored), 0
            events.append(Compaction(session.position, before, physical_length(stored, 0), time.perf_counter() - start))
            continue
        chunk = ids[done : done + room]
        logits.append(extend(lm, session, chunk, capture))
        done += chunk.numel()
        appended += chunk.numel()
    all_logits = torch.cat(logits)[-n_target - 1 : -1]
    target = ids[-n_target:]
    logp = torch.log_softmax(all_logits, dim=-1).gather(1, target.unsqueeze(1)).squeeze(1)
    return OnlineResult(logp.cpu(), events)
