"""Reference queries: which post-RoPE query vectors a method looks at.

Each source returns, per layer, a [H, n, d] tensor of queries recorded while
the model reads something after the full document cache. Results are kept on
the Context, so a source is computed once per document. The user's question
is a source only for methods that say they are query-aware.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import torch

from kvlab.cancellation import report
from kvlab.context import Context, Memo
from kvlab.memo import MISSING
from kvlab.prompts import REPEAT_INSTRUCTION, question_tokens, repeat_tokens
from kvlab.results import RunKey, code_identity, loaded_identity, store, text_digest
from kvlab.runtime.cache import CompressedKV
from kvlab.runtime.decode import Session, extend, greedy, open_session, read_chunked
from kvlab.runtime.hooks import QueryCapture

SELF_STUDY_PROMPTS = (
    "Summarise the main points of the text above.",
    "List the key facts in the text above: names, numbers, dates.",
    "Structure the information in the text above as JSON.",
    "Write three questions about the text above and answer them.",
)


@dataclass(frozen=True)
class RepeatQueries(Memo):
    """Where :func:`repeat_pass` keeps the repeat pass after ``instruction``."""

    store = "queries"
    instruction: str


@dataclass(frozen=True)
class QuestionQueries(Memo):
    """Where :func:`question_queries` keeps the queries of the turn asking ``question``."""

    store = "queries"


@dataclass(frozen=True)
class SelfStudyQueries(Memo):
    """Where :func:`self_study_queries` keeps the self-study queries of ``token_budget`` generated tokens."""

    store = "queries"
    token_budget: int


def _session_after(
    ctx: Context,
    ids: torch.Tensor,
    capture: QueryCapture,
    stored: CompressedKV | None = None,
    on_chunk: Callable[[int, int], None] | None = None,
) -> Session:
    """The working session after the model read ``ids`` after a stored cache (default: the full one);
    on_chunk(done, total) hears each chunk read (kvlab.runtime.decode.read_chunked)."""
    session = open_session(ctx.lm, stored or ctx.full.stored)
    read_chunked(ctx.lm, session, ids, capture, on_chunk=on_chunk)
    return session


def read_after(
    ctx: Context, ids: torch.Tensor, stored: CompressedKV | None = None, layers: int | None = None
) -> list[torch.Tensor]:
    """Queries [H, n, d] of the first ``layers`` layers (default all) while the model
    reads ``ids`` after a stored cache (default: the full one)."""
    capture = QueryCapture(layers or ctx.lm.n_layers)
    _session_after(ctx, ids, capture, stored)
    return capture.per_layer()


def read_after_into(ctx: Context, ids: torch.Tensor, capture: QueryCapture) -> None:
    """The model reads ``ids`` [n] after the full cache in one pass (not chunked), into ``capture``
    (one that changes what each layer reads, kvlab.runtime.hooks.QueryCapture.attended, sees the whole text)."""
    session = open_session(ctx.lm, ctx.full.stored)
    extend(ctx.lm, session, ids, capture, logits_to_keep=1)


def context_queries(ctx: Context) -> list[torch.Tensor]:
    """The document's own prefill queries (recorded at prefill)."""
    return ctx.queries["context"]


@dataclass(frozen=True)
class RepeatPass:
    """The model asked to repeat the document, then teacher-forced through it again.

    queries: per layer [H, n, d] post-RoPE queries of the n repeat tokens
    (instruction turn + document), [H, 0, d] on a sliding-window layer (it keeps
    its window whatever it read: no method fits or scores it, and on a long
    document those queries would be most of the pass's memory); keys: per layer [H_kv, n, d] the same
    tokens' own keys in the model's dtype on its device (KVzip's softmax
    includes them), None on a sliding-window layer: its working cache held
    only its window, not the repeat's keys in order (and a window layer
    keeps its window whatever its scores, so no method scores it).
    """

    queries: list[torch.Tensor]
    keys: list[torch.Tensor | None]


def repeat_pass(ctx: Context, instruction: str = REPEAT_INSTRUCTION) -> RepeatPass:
    """The repeat pass after the full cache, recorded once per context and instruction
    (kept in ``ctx.queries`` beside the other sources, under :class:`RepeatQueries`)."""

    def make() -> RepeatPass:
        ids = repeat_tokens(ctx.lm.tokenizer, ctx.tokens.ids[ctx.prefix_len :], instruction)
        windowed = frozenset(i for i, g in enumerate(ctx.lm.geometry) if g.window is not None)
        capture = QueryCapture(ctx.lm.n_layers, skip=windowed)

        # As long as the prefill on a long document: each chunk a step to report and to stop at.
        def chunk(done: int, total: int) -> None:
            report(done / total, f"repeat pass, {done:,}/{total:,} tokens")

        session = _session_after(ctx, ids, capture, on_chunk=chunk)
        # A copy: a slice would keep the whole working cache (document included) alive.
        keys = [
            None if g.window is not None else layer.keys[0, :, ctx.length :].clone()
            for g, layer in zip(ctx.lm.geometry, session.cache.layers)
        ]
        return RepeatPass(capture.per_layer(), keys)

    return ctx.cached(RepeatQueries(instruction), make)


def repeat_queries(ctx: Context) -> list[torch.Tensor]:
    """Repeat-prefill: the repeat instruction then the document, teacher-forced (see :func:`repeat_pass`)."""
    return repeat_pass(ctx).queries


def question_queries(ctx: Context, question: str) -> list[torch.Tensor]:
    """The question turn's queries (query-aware methods only)."""
    ids = question_tokens(ctx.lm.tokenizer, question)
    return ctx.cached(QuestionQueries(question=question), lambda: read_after(ctx, ids))


@dataclass(frozen=True)
class SelfStudy:
    """Self-study conversations about a document: per prompt, the prompt turn's tokens then the model's
    greedy answer (``turns``, each [n_i]); ``queries``: per layer [H, n, d] the queries recorded while
    each was read after the full cache on its own."""

    turns: tuple[torch.Tensor, ...]
    queries: list[torch.Tensor]


def self_study_key(ctx: Context, token_budget: int) -> RunKey:
    """Where the result store keeps a document's self-study conversations: by the model's weights, the
    document, the prompts, the budget and the code that wrote them."""
    return RunKey(
        model=loaded_identity(ctx.lm),
        document=text_digest(ctx.text),
        question="",
        method="self_study",
        options=json.dumps(SELF_STUDY_PROMPTS),
        ratio=1.0,
        max_new_tokens=token_budget,
        code=code_identity(),
    )


def conversations(ctx: Context, token_budget: int) -> list[list[int]]:
    """The self-study conversations' tokens, generated greedily: per prompt, its turn then the answer fed
    back (the last generated token never is: nothing reads it)."""
    per_prompt = max(1, token_budget // len(SELF_STUDY_PROMPTS))
    turns = []
    for i, prompt in enumerate(SELF_STUDY_PROMPTS):
        report(i / len(SELF_STUDY_PROMPTS), f"self-study, conversation {i + 1} of {len(SELF_STUDY_PROMPTS)}")
        ids = question_tokens(ctx.lm.tokenizer, prompt)
        answer = greedy(ctx.lm, ctx.full.stored, ids, per_prompt)
        turns.append(ids.tolist() + list(answer.ids[:-1]))
    return turns


def self_study(ctx: Context, token_budget: int = 256) -> SelfStudy:
    """Self-study: the model answers generic prompts about the document (greedily, ``token_budget``
    generated tokens over all prompts: generation is the slow part on a CPU), made once per context.

    The conversations' text is kept in the result store (:func:`self_study_key`), so that a restart or
    another process reads it instead of generating it again; the queries are always those of each
    conversation read after the full cache on its own, the same whether the text was generated now or
    read from the store."""

    def make() -> SelfStudy:
        key = self_study_key(ctx, token_budget)
        kept = store().get(key)
        if kept is MISSING:
            kept = conversations(ctx, token_budget)
            store().put(key, kept)
        ids = ctx.tokens.ids
        turns = tuple(torch.tensor(turn, dtype=ids.dtype, device=ids.device) for turn in kept)
        reads = [read_after(ctx, turn) for turn in turns]
        return SelfStudy(turns, [torch.cat([r[layer] for r in reads], dim=1) for layer in range(ctx.lm.n_layers)])

    return ctx.cached(SelfStudyQueries(token_budget), make)


def self_study_queries(ctx: Context, token_budget: int = 256) -> list[torch.Tensor]:
    """Self-study's queries (:func:`self_study`): the prompts' and the model's own answers'."""
    return self_study(ctx, token_budget).queries


def random_queries(ctx: Context, n: int = 1024, seed: int = 0) -> list[torch.Tensor]:
    """Gaussian N(0, I) vectors in query space: a weak, data-free baseline.

    Drawn by a CPU generator (the same vectors on every device), then moved to the model's device.
    """
    lm = ctx.lm
    gen = torch.Generator().manual_seed(seed)
    shape = (lm.n_heads, n, lm.head_dim)
    return [torch.randn(shape, generator=gen, device="cpu").to(lm.device) for _ in range(lm.n_layers)]
