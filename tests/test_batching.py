"""Batched decode steps (kvlab.runtime.batching) against each session's own lone steps, and the compute
slot a run leaves once its answer decodes step by step (kvlab.cancellation.leave_slot).

The reference is the lone lean pass (:func:`kvlab.runtime.decode.extend`), which tests/test_lean.py
checks against transformers' eager forward. A batched pass computes each row by a matrix product
instead of a matrix-vector one: the tolerance is float32 rounding (eps) for sums of D products per
projection, over the layers, times the logits' size.
"""

from __future__ import annotations

import copy
import dataclasses
import threading

import pytest
import torch

from kvlab import cancellation, scheduler
from kvlab.context import prepare_context
from kvlab.methods import Request, get_method
from kvlab.runtime import batching
from kvlab.runtime.batching import StepBatcher
from kvlab.runtime.decode import batched_passes, extend, greedy_from_draft, open_session
from kvlab.runtime.lean import LeanItem, lean_forward_many, lean_model
from kvlab.testing.random_models import random_model

DOC = " ".join(f"w{(i * 5) % 50 + 3}" for i in range(80))
EPS = torch.finfo(torch.float32).eps


@pytest.fixture(scope="module")
def lm():
    return random_model("llama", seed=11)


@pytest.fixture(scope="module")
def caches(lm):
    """Three stored caches of one context: the full one, SnapKV's at 4x (kept tokens) and
    Attention Matching's at 4x (fitted keys, biases and values)."""
    ctx = prepare_context(lm, DOC)
    return [
        ctx.full.stored,
        get_method("snapkv").compress(Request(ctx, 4.0)),
        get_method("attention_matching").compress(Request(ctx, 4.0)),
    ]


def tolerance(lm, logits: torch.Tensor) -> float:
    hidden, layers = lm.model.config.hidden_size, lm.model.config.num_hidden_layers
    return 16 * EPS * hidden * layers * float(logits.abs().max())


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(2, 60, (n,), generator=torch.Generator().manual_seed(seed))


def test_one_pass_over_several_sequences_gives_each_its_lone_logits(lm, caches):
    """Three caches (plain, kept tokens, fitted biases), each with its own tokens (one, or four at
    once) at its own positions, in one pass: each item's logits and appended keys as alone."""
    lean = lean_model(lm.model)
    feeds = [tokens(1, 1), tokens(4, 2), tokens(1, 3)]
    alone, together = [open_session(lm, c) for c in caches], [open_session(lm, c) for c in caches]
    want = [extend(lm, s, ids) for s, ids in zip(alone, feeds)]
    with torch.inference_mode():
        got = lean_forward_many(
            lean,
            [
                LeanItem(s.cache, ids, torch.arange(s.position, s.position + ids.numel()), s.key_bias)
                for s, ids in zip(together, feeds)
            ],
        )
    for w, g, a, t in zip(want, got, alone, together):
        assert g.shape == w.shape
        assert torch.allclose(g.float(), w, atol=tolerance(lm, w))
        assert torch.allclose(
            t.cache.layers[1].keys, a.cache.layers[1].keys, atol=tolerance(lm, a.cache.layers[1].keys)
        )


def steps_in_threads(lm, caches, feeds):
    """Each cache's session fed its token list through ``batcher`` in its own thread, all starting
    together; returns each thread's logits [n_i, V]."""
    out: list = [None] * len(caches)
    start = threading.Barrier(len(caches))

    def worker(i: int) -> None:
        session = open_session(lm, caches[i])
        with batched_passes(lm, session) as run:
            start.wait()
            out[i] = torch.stack([run(feeds[i][j : j + 1], 1)[-1] for j in range(feeds[i].numel())])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(caches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return out


def test_threads_decoding_at_once_share_passes_and_each_gets_its_own_logits(lm, caches, monkeypatch):
    """Three sessions step together (the batcher waits for every joined session: a long gather time
    makes that certain), one of them leaving after two steps: every pass holds every session still
    decoding, and each session's logits are its lone steps'."""
    shared = StepBatcher(lean_model(lm.model), gather_s=30.0)
    monkeypatch.setattr("kvlab.runtime.decode.batcher", lambda lean: shared)
    feeds = [tokens(6, 4), tokens(2, 5), tokens(6, 6)]
    got = steps_in_threads(lm, caches, feeds)
    for cache, ids, logits in zip(caches, feeds, got):
        session = open_session(lm, cache)
        want = torch.stack([extend(lm, session, ids[j : j + 1])[-1] for j in range(ids.numel())])
        assert torch.allclose(logits, want, atol=tolerance(lm, want))
    assert (shared.passes, shared.rows, shared.widest) == (6, 2 * 3 + 4 * 2, 3)


def test_a_failed_pass_reaches_every_step_in_it(lm, caches, monkeypatch):
    shared = StepBatcher(lean_model(lm.model), gather_s=30.0)
    monkeypatch.setattr("kvlab.runtime.decode.batcher", lambda lean: shared)

    def broken(lean, items):
        raise RuntimeError(f"pass of {len(items)}")

    monkeypatch.setattr(batching, "lean_forward_many", broken)
    errors: list = []

    def worker(cache) -> None:
        with batched_passes(lm, open_session(lm, cache)) as run:
            barrier.wait()
            try:
                run(tokens(1, 7), 1)
            except RuntimeError as exc:
                errors.append(str(exc))

    barrier = threading.Barrier(2)
    threads = [threading.Thread(target=worker, args=(c,)) for c in caches[:2]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == ["pass of 2", "pass of 2"]


def test_a_lone_session_steps_at_once_as_before(lm, caches):
    """Nobody else decoding: the answer from a draft is what plain lone steps write."""
    stored = caches[1]
    prompt = tokens(3, 8)
    drafted = greedy_from_draft(lm, stored, prompt, [], 6)
    session = open_session(lm, stored)
    logits = extend(lm, session, prompt)[-1]
    ids = []
    for _ in range(6):
        ids.append(int(logits.argmax()))
        logits = extend(lm, session, torch.tensor(ids[-1:]))[-1]
    assert drafted.generation.ids[: len(ids)] == ids[: len(drafted.generation.ids)]


def test_a_run_allowed_to_leave_gives_the_slot_to_the_next_request_at_once():
    slot = scheduler.Slot()
    taken = threading.Event()

    def next_request() -> None:
        with slot.hold():
            taken.set()

    with cancellation.scope(), slot.hold(), scheduler.may_leave(slot):
        other = threading.Thread(target=next_request)
        other.start()
        assert not taken.wait(0.2)  # still held
        cancellation.leave_slot()
        assert taken.wait(30)  # the next request got it while this one goes on
        other.join()
        cancellation.leave_slot()  # a second leave is nothing
    assert not slot.busy


def test_a_run_not_allowed_to_leave_keeps_the_slot():
    """A long job (a sweep) hands the slot over between its units: leave_slot inside it does nothing."""
    slot = scheduler.Slot()
    with cancellation.scope(), slot.hold():
        cancellation.leave_slot()
        assert slot.busy
        with slot._cond:
            assert slot._holder == threading.get_ident()
    assert not slot.busy


def test_a_model_that_answered_can_be_copied_and_the_copy_answers_on_its_own(lm, caches):
    """copy.deepcopy of a model whose batcher exists (a lock, sessions' events): the copy gets a batcher of its
    own over its own weights; it answers as the original does, and changing its weights leaves the original's
    answer alone (the reference: the original's logits before the copy)."""
    ids = tokens(3, 4)
    before = extend(lm, open_session(lm, caches[0]), ids)
    assert batching.batcher(lean_model(lm.model)) is not None  # the model now carries a batcher and its lock
    twin = dataclasses.replace(lm, model=copy.deepcopy(lm.model))
    assert batching.batcher(lean_model(twin.model)) is not batching.batcher(lean_model(lm.model))
    assert torch.equal(extend(twin, open_session(twin, caches[0]), ids), before)
    with torch.no_grad():
        twin.model.lm_head.weight.mul_(2.0)
    assert torch.equal(extend(lm, open_session(lm, caches[0]), ids), before)
    assert not torch.equal(extend(twin, open_session(twin, caches[0]), ids), before)
