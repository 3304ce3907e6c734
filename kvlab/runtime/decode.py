"""Running the model over a stored cache: prefill, greedy answers, teacher-forced scores.

Every call works on a fresh working copy of the stored cache, so answering
never changes it and one compression serves many questions. Positions are
always passed explicitly and continue from the cache's logical length (less
its position shift, for a cache whose keys were re-rotated): transformers
would otherwise take them from the physical (compressed) length.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvlab.cancellation import checkpoint, leave_slot
from kvlab.prompts import answer_end_ids
from kvlab.runtime.batching import batcher
from kvlab.runtime.cache import CompressedKV, FullKV
from kvlab.runtime.hooks import ForwardContext, QueryCapture
from kvlab.runtime.lean import LeanItem, lean_forward, lean_model
from kvlab.runtime.model import LoadedModel


class GrowingLayer(DynamicLayer):
    """A working cache layer that appends into spare capacity.

    transformers' DynamicLayer re-concatenates the whole layer for every new
    token, which dominates decoding time on a CPU; this one copies only the
    new token and doubles its buffer when full. ``keys``/``values`` are views
    [1, H_kv, n, d] of the buffers.

    keep: a sliding-window layer's ``window - 1``: before each append the
    layer lets go of the keys older than that, so it holds what the model
    keeps (its window) plus the tokens of its latest append, which a rewind of
    those tokens needs (kvlab's attention masks the window itself). None:
    every key stays.
    """

    def __init__(self, keys: torch.Tensor | None = None, values: torch.Tensor | None = None, keep: int | None = None):
        super().__init__()
        self.keep = keep
        self._start = self._length = 0  # the held keys are buffer slots [_start, _length)
        if keys is not None:
            self._allocate(keys, values, keys.shape[-2] + 64)
            self._append(keys, values)

    def _allocate(self, like_k: torch.Tensor, like_v: torch.Tensor, capacity: int) -> None:
        shape = list(like_k.shape)
        shape[-2] = capacity
        self._k, self._v = like_k.new_empty(shape), like_v.new_empty(shape[:-1] + [like_v.shape[-1]])
        self.device, self.is_initialized = like_k.device, True

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.keep is not None:
            self._start = max(self._start, self._length - self.keep)
        held, n = self._length - self._start, k.shape[-2]
        if self._length + n > self._k.shape[-2]:
            old_k, old_v = self._k[..., self._start : self._length, :], self._v[..., self._start : self._length, :]
            self._allocate(k, v, max(held + n, 2 * held))
            self._k[..., :held, :], self._v[..., :held, :] = old_k, old_v
            self._start, self._length = 0, held
        end = self._length + n
        self._k[..., self._length : end, :], self._v[..., self._length : end, :] = k, v
        self._length = end
        self._view()

    def _view(self) -> None:
        self.keys = self._k[..., self._start : self._length, :]
        self.values = self._v[..., self._start : self._length, :]

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` held tokens (the buffers stay; later appends overwrite the rest)."""
        self._length = min(self._length, self._start + max_length)
        self._view()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._allocate(key_states, value_states, key_states.shape[-2])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._append(key_states, value_states)
        return self.keys, self.values


def _working_cache(layers: list[GrowingLayer] | None = None) -> DynamicCache:
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    cache.layers = layers or []
    return cache


@dataclass
class Session:
    """A working copy of a cache that the model appends to while it reads and writes.

    key_bias: per layer [H_kv, L] for the stored keys (None for a layer without
    one), or None for a plain cache; position: the logical position of the next token.
    """

    cache: DynamicCache
    key_bias: list[torch.Tensor | None] | None
    position: int


def open_session(lm: LoadedModel, stored: CompressedKV | None = None, every_key: bool = False) -> Session:
    """Start from an empty cache, or from a stored one (which is left untouched).

    A sliding-window layer holds only its window (:class:`GrowingLayer`'s
    ``keep``), unless ``every_key``: the prefill keeps every layer's keys,
    which the methods score.
    """
    keeps = [None if g.window is None or every_key else g.window - 1 for g in lm.geometry]
    if stored is None:
        return Session(_working_cache([GrowingLayer(keep=keep) for keep in keeps]), None, 0)
    views = [stored.layer_view(i) for i in range(stored.n_layers)]
    # A window layer is stored as its plain window (kvlab.runtime.cache.keep_windows): no bias to
    # carry, so its keys may go as the window moves on; any other stays whole, with its bias.
    plain = [keep is not None and bool((v.bias == 0).all()) for keep, v in zip(keeps, views)]
    layers = [
        GrowingLayer(
            v.keys.unsqueeze(0).to(lm.device, lm.dtype),
            v.values.unsqueeze(0).to(lm.device, lm.dtype),
            keep if windowed else None,
        )
        for v, keep, windowed in zip(views, keeps, plain)
    ]
    position = stored.logical_len - stored.position_shift
    if stored.is_plain():
        return Session(_working_cache(layers), None, position)
    bias = [None if windowed else v.bias.to(lm.device) for v, windowed in zip(views, plain)]
    return Session(_working_cache(layers), bias, position)


@torch.inference_mode()
def extend(
    lm: LoadedModel, session: Session, ids: torch.Tensor, capture: QueryCapture | None = None, logits_to_keep: int = 0
) -> torch.Tensor:
    """Feed ``ids`` [n] after the session's tokens; returns float32 logits [n or logits_to_keep, V]."""
    n = ids.numel()
    positions = torch.arange(session.position, session.position + n, device=lm.device).unsqueeze(0)
    lean = lean_model(lm.model)
    if lean is not None:
        logits = lean_forward(
            lean, session.cache, ids.to(lm.device), positions, session.key_bias, capture, logits_to_keep
        )
    else:
        logits = lm.model(
            input_ids=ids.to(lm.device).unsqueeze(0),
            position_ids=positions,
            cache=session.cache,
            use_cache=True,
            logits_to_keep=logits_to_keep,
            kvlab=ForwardContext(key_bias=session.key_bias, capture=capture),
        ).logits[0]
    session.position += n
    return logits.float()


def read_chunked(
    lm: LoadedModel,
    session: Session,
    ids: torch.Tensor,
    capture: QueryCapture | None = None,
    chunk_size: int = 2048,
    on_chunk: Callable[[int, int], None] | None = None,
) -> None:
    """Feed ``ids`` [n] after the session's tokens, ``chunk_size`` at a time, keeping no logits.

    Chunks bound the transient [H, chunk, kv] score matrix of a long read;
    on_chunk(done, total) reports progress in tokens.
    """
    total = ids.numel()
    for start in range(0, total, chunk_size):
        extend(lm, session, ids[start : start + chunk_size], capture, logits_to_keep=1)
        if on_chunk is not None:
            on_chunk(min(start + chunk_size, total), total)


def prefill(
    lm: LoadedModel,
    ids: torch.Tensor,
    capture: QueryCapture | None = None,
    chunk_size: int = 2048,
    on_chunk: Callable[[int, int], None] | None = None,
) -> FullKV:
    """Encode a context ``ids`` [T] and return its full cache (post-RoPE keys, values).

    Chunked so that long documents never build a T x T score matrix.
    on_chunk(done, total) reports progress in tokens. The cache is copied out
    of the working buffers (which grow by doubling) into tensors of exactly T
    tokens, so the spare capacity is not held with the document. Every layer
    keeps every token's keys, a window layer's too (the methods score them);
    the model's cache of the document is ``FullKV.stored``.
    """
    session = open_session(lm, every_key=True)
    read_chunked(lm, session, ids, capture, chunk_size, on_chunk)
    layers = session.cache.layers
    return FullKV(
        keys=[layer.keys[0].contiguous() for layer in layers],
        values=[layer.values[0].contiguous() for layer in layers],
        windows=[g.window for g in lm.geometry],
        scales=[g.scaling for g in lm.geometry],
    )


def stop_token_ids(lm: LoadedModel) -> set[int]:
    """End-of-sequence and end-of-turn tokens: where a chat answer ends (a base model's: its line's end,
    kvlab.prompts.answer_end_ids)."""
    tok = lm.tokenizer
    stops = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    stops |= answer_end_ids(tok)
    for marker in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>"):
        token_id = tok.convert_tokens_to_ids(marker)
        if isinstance(token_id, int) and token_id != tok.unk_token_id:
            stops.add(token_id)
    return stops


@dataclass
class Generation:
    """A greedy answer: its tokens, text, and each token's log-probability."""

    ids: list[int]
    text: str
    logprobs: list[float]


def greedy(
    lm: LoadedModel,
    stored: CompressedKV,
    prompt_ids: torch.Tensor,
    max_new_tokens: int = 48,
    capture: QueryCapture | None = None,
) -> Generation:
    """Answer greedily from a stored cache (a manual loop: ``generate()`` mis-slices
    inputs when the cache is shorter than the tokens seen).

    With ``capture``, the queries of the prompt and of every generated token that
    is fed back are recorded (the evaluation queries).
    """
    session = open_session(lm, stored)
    first = extend(lm, session, prompt_ids, capture, logits_to_keep=1)[-1]
    feed = lambda token: extend(lm, session, token, capture, logits_to_keep=1)[-1]  # noqa: E731
    return greedy_loop(lm, first, feed, max_new_tokens, stop_token_ids(lm))


@contextmanager
def batched_passes(lm: LoadedModel, session: Session) -> Iterator[Callable[[torch.Tensor, int], torch.Tensor]]:
    """run(ids [n], logits_to_keep) -> float32 logits [keep, V], as :func:`extend` gives them, with each
    pass run batched with the passes of other threads' sessions (kvlab.runtime.batching) while inside.

    A model the lean pass does not run goes through :func:`extend`, alone.
    """
    lean = lean_model(lm.model)
    if lean is None:
        yield lambda ids, keep: extend(lm, session, ids, logits_to_keep=keep)
        return
    passes = batcher(lean)

    @torch.inference_mode()
    def run(ids: torch.Tensor, keep: int) -> torch.Tensor:
        positions = torch.arange(session.position, session.position + ids.numel(), device=lm.device)
        logits = passes.step(LeanItem(session.cache, ids.to(lm.device), positions, session.key_bias, None, keep))
        session.position += ids.numel()
        return logits.float()

    with passes.joined():
        yield run


def greedy_loop(
    lm: LoadedModel,
    logits: torch.Tensor,
    feed: Callable[[torch.Tensor], torch.Tensor],
    max_new_tokens: int,
    stops: set[int],
) -> Generation:
    """Pick the most likely token, feed it back, until a stop token or ``max_new_tokens``.

    logits: [V] after the prompt; feed(ids [1]) -> the next logits [V] (whatever
    cache policy the caller runs behind it).
    """
    ids: list[int] = []
    logprobs: list[float] = []
    while len(ids) < max_new_tokens:
        checkpoint()
        logp = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logp))
        if token in stops:
            break
        ids.append(token)
        logprobs.append(float(logp[token]))
        if len(ids) < max_new_tokens:
            logits = feed(torch.tensor([token], device=lm.device))
    text = lm.tokenizer.decode(ids, skip_special_tokens=True).strip()
    return Generation(ids=ids, text=text, logprobs=logprobs)


def rewind(session: Session, n: int) -> None:
    """Forget the session's last ``n`` tokens (their keys, values and positions)."""
    if n <= 0:
        return
    for layer in session.cache.layers:
        layer.crop(layer.keys.shape[-2] - n)
    session.position -= n


@dataclass
class Drafted:
    """A greedy answer found by checking a draft, and the draft's teacher-forced log-probabilities.

    draft_logprobs: [m] float32 on the CPU, each draft token's log-probability
    after the prompt and the draft tokens before it; accepted: how many draft
    tokens the answer starts with.
    """

    generation: Generation
    draft_logprobs: torch.Tensor
    accepted: int


def greedy_from_draft(
    lm: LoadedModel, stored: CompressedKV, prompt_ids: torch.Tensor, draft_ids: list[int], max_new_tokens: int
) -> Drafted:
    """:func:`greedy` from ``stored``, with ``draft_ids`` (e.g. the full cache's answer) checked in one pass.

    Greedy decoding is deterministic, so its answer is the longest prefix of
    the draft whose every token is the cache's own pick, then what the cache
    writes from there: one forward pass over prompt + draft (the pass that
    scores the draft teacher-forced, needed anyway) replaces a decode step
    per accepted token, and only the rest is decoded step by step (a
    speculative check with the draft as the guess). The picks are made on
    logits of a several-token pass instead of one-token steps: the same up to
    float rounding, which can flip a near-tie (tests compare the two).
    """
    m = min(len(draft_ids), max_new_tokens)
    draft = torch.tensor(draft_ids[:m], dtype=torch.long, device="cpu")  # token ids, as the prompt's
    # The cache is made: the compute slot goes to the next request, and this answer's passes run
    # batched with those of the other requests answering meanwhile.
    leave_slot()
    session = open_session(lm, stored)
    with batched_passes(lm, session) as run:
        logits = run(torch.cat([prompt_ids, draft]), m + 1)  # [m + 1, V]
        logp = torch.log_softmax(logits, dim=-1)
        draft_logprobs = logp[:m].gather(1, draft.to(logp.device).unsqueeze(1)).squeeze(1)
        picks = logp[:m].argmax(dim=-1).cpu()
        accepted = int((picks == draft).long().cumprod(0).sum())
        rewind(session, m - accepted)
        rest = greedy_loop(
            lm, logits[accepted], lambda token: run(token, 1)[-1], max_new_tokens - accepted, stop_token_ids(lm)
        )
    ids = draft_ids[:accepted] + rest.ids
    logprobs = draft_logprobs[:accepted].tolist() + rest.logprobs
    text = lm.tokenizer.decode(ids, skip_special_tokens=True).strip()
    return Drafted(Generation(ids, text, logprobs), draft_logprobs.cpu(), accepted)


def continuation_logprobs(
    lm: LoadedModel, stored: CompressedKV, prompt_ids: torch.Tensor, target_ids: torch.Tensor
) -> torch.Tensor:
    """Teacher-forced log-probabilities [m] of ``target_ids`` [m] after ``prompt_ids``."""
    if target_ids.numel() == 0:
        return torch.zeros(0, device="cpu")
    session = open_session(lm, stored)
    ids = torch.cat([prompt_ids, target_ids[:-1]])
    logits = extend(lm, session, ids, logits_to_keep=target_ids.numel())
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, target_ids.to(logp.device).unsqueeze(1)).squeeze(1).cpu()
