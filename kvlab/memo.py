"""Values made once however many callers race, and the bytes a value keeps alive.

:func:`compute_once` is the concurrency primitive every shared cache of the lab
is built on (a document's prepared context, what runs derive from it, the
result store); :func:`held_bytes` is how those caches count their memory.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from concurrent import futures
from concurrent.futures import Future
from typing import Callable, Hashable, TypeVar

import torch

from kvlab import cancellation

T = TypeVar("T")

#: What a ``find`` returns when nothing is kept for the key.
MISSING = object()


def recently_used(kept: OrderedDict[Hashable, T], key: Hashable) -> T | object:
    """``kept[key]``, moved to the most recently used end, or ``MISSING`` (a ``find`` for
    :func:`compute_once` over a least-recently-used dict; under the caller's lock)."""
    if key not in kept:
        return MISSING
    kept.move_to_end(key)
    return kept[key]


def compute_once(
    lock: threading.Lock,
    flights: dict[Hashable, Future],
    key: Hashable,
    find: Callable[[], object],
    make: Callable[[], T],
    keep: Callable[[T], None],
    on_follow: Callable[[], None] | None = None,
) -> T:
    """``find()`` (under ``lock``), else ``make()`` once per key however many callers race.

    find: the kept value or ``MISSING``; the first caller that misses runs
    ``make()`` with ``lock`` released (so nobody else is blocked meanwhile) and
    ``keep``s the value under it; callers asking for the same key in the
    meantime wait for that value, or get its exception (nothing is kept then).
    Whatever fails, ``make`` or ``keep``, the key's future is resolved with the
    exception, so no caller ever waits on it forever. A leader stopped by its
    own request (kvlab.cancellation.Cancelled) is not a failure of the value: a
    waiter then computes it itself. A waiter's own request is checked while
    it waits (kvlab.cancellation.wait), and that wait counts as waiting, not work,
    against its time limit. ``on_follow()`` is called when this caller joins a
    computation already in flight (before it waits for it).
    """
    while True:
        with lock:
            found = find()
            if found is not MISSING:
                return found  # type: ignore[return-value]
            flight = flights.get(key)
            leader = flight is None
            if leader:
                flight = flights[key] = Future()
        if leader:
            break
        if on_follow is not None:
            on_follow()
        if cancellation.current() is not None:  # a request: it may be stopped while it waits (not its work)
            cancellation.wait(lambda timeout: bool(futures.wait([flight], timeout).done))
        try:
            return flight.result()
        except cancellation.Cancelled:
            continue  # the leader's request was stopped, not the computation: make it here
    try:
        value = make()
        with lock:
            del flights[key]
            keep(value)
    except BaseException as exc:
        with lock:
            flights.pop(key, None)
        flight.set_exception(exc)
        raise
    flight.set_result(value)
    return value


def held_bytes(obj: object, seen: set[int] | None = None) -> int:
    """Bytes of the tensor storages ``obj`` keeps alive, each storage counted once.

    Tensors are found inside lists, tuples, dict values and dataclass
    instances (their cached properties included). A view costs its whole
    storage: a small slice of a large tensor keeps all of it alive.
    """
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(obj, dict):
        parts = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        parts = obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        parts = list(vars(obj).values())
    else:
        return 0
    return sum(held_bytes(part, seen) for part in parts)
