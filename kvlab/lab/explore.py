"""One Explore run: a document, a method, a ratio and a question, measured end to end."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from kvlab import models
from kvlab.context import Context, Memo, Progress, no_progress
from kvlab.context_store import CONTEXTS
from kvlab.lab.head_roles import HeadRoles, head_roles
from kvlab.lab.inputs import check_question_tokens, expected_answer
from kvlab.lab.spec import RunSpec
from kvlab.pipeline import Run, has_evaluation, run
from kvlab.runtime.model import LoadedModel
from kvlab.tasks.marking import contains_match


@dataclass
class Explored:
    """The last run of one user: the run, the decoded text of each context token, and what was reused.

    expected: the gold answer when the question is a bundled example's (its aliases);
    full_right / compressed_right: whether each answer contains the gold one
    (kvlab.tasks.marking.contains_match), None when no gold answer is known;
    query_aware: the method compressed for this question;
    prefill_reused: the document's prefill was not run by this call (an
    earlier run, or the background preparation, did it);
    full_answer_reused: so did the full cache's answer to this question;
    wall_s: the seconds this run took, end to end;
    roles: each KV head's role for the question in the full cache (kvlab.lab.head_roles), the same for
    every method's run on it.
    """

    run: Run
    token_texts: list[str]
    expected: tuple[str, ...] | None = None
    query_aware: bool = False
    prefill_reused: bool = False
    full_answer_reused: bool = False
    wall_s: float = 0.0
    roles: HeadRoles | None = None

    @property
    def full_right(self) -> bool | None:
        return None if self.expected is None else contains_match(self.run.result.answer_full, self.expected)

    @property
    def compressed_right(self) -> bool | None:
        return None if self.expected is None else contains_match(self.run.result.answer_compressed, self.expected)

    @property
    def n_layers(self) -> int:
        return self.run.ctx.lm.n_layers

    @property
    def n_kv_heads(self) -> int:
        return self.run.ctx.lm.n_kv_heads


@dataclass(frozen=True)
class TokenTexts(Memo):
    """Where :func:`explore` keeps each document token's text (:func:`token_texts`; the same for every run)."""


def token_texts(tokenizer: Any, ids: list[int]) -> list[str]:
    """The text each token adds when the ids are decoded in order.

    Streaming detokenisation (decode a short window with and without the
    token, keep the difference) keeps leading spaces of SentencePiece tokens;
    a token that ends inside a multi-byte character gets "" and the character
    goes to the token completing it.
    """
    out: list[str] = []
    prefix_offset = read_offset = 0

    def decode(part: list[int]) -> str:
        return tokenizer.decode(part, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    for i in range(len(ids)):
        prefix_text = decode(ids[prefix_offset:read_offset])
        new_text = decode(ids[prefix_offset : i + 1])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            out.append(new_text[len(prefix_text) :])
            prefix_offset, read_offset = read_offset, i + 1
        else:
            out.append("")
    return out


def prepared_context(lm: LoadedModel, document: str, progress: Progress = no_progress) -> tuple[Context, bool]:
    """(the document's context for ``lm``, whether this call ran its prefill) through the shared cache.

    The prefill runs only for a (model, document) pair not seen recently
    (kvlab.context_store.CONTEXTS); changing the method, ratio or question reuses it.
    """
    prefilled = False

    def on_prefill(fraction: float, desc: str) -> None:
        nonlocal prefilled
        prefilled = True
        progress(fraction, desc)

    return CONTEXTS.get(lm, document, on_prefill), prefilled


def sub_progress(progress: Progress, lo: float, width: float, label: str = "") -> Progress:
    """A progress sink reporting into [lo, lo + width] of ``progress``, its messages prefixed by ``label``."""
    return lambda f, desc: progress(lo + width * min(max(f, 0.0), 1.0), f"{label}{desc}")


@dataclass(frozen=True)
class DoneForIt:
    """What a run's own preparation did just before it (kvlab.lab.ensure_prepared, in the background): the
    prefill, the full cache's answer, a long compression (then this run did them, not an earlier one), in
    ``seconds``."""

    prefill: bool = False
    answer: bool = False
    seconds: float = 0.0
    compression: bool = False


def explore(spec: RunSpec, progress: Progress = no_progress, done_for_it: DoneForIt = DoneForIt()) -> Explored:
    """One Explore run of a checked ``spec`` (kvlab.lab.spec.run_spec): prefill (cached), compress, answer
    twice, measure; ``done_for_it``: what its own preparation did before (counted as this run's).

    Raises DocumentError (incl. ContextTooLong), MethodError, ModelLoadError or
    InputError with a message fit for the user.
    """
    start = time.perf_counter()
    method_obj = spec.build()
    progress(0.0, f"loading the model {spec.model or ''} (the first use of a model takes a while)")
    lm = models.get_model(spec.model)
    check_question_tokens(lm.tokenizer, spec.question)
    ctx, prefilled = prepared_context(lm, spec.document, sub_progress(progress, 0.05, 0.35))
    answered = has_evaluation(ctx, spec.question, spec.max_new_tokens)
    progress(0.4, "each head's role for the question (full cache)")
    roles = head_roles(ctx, spec.question)  # kept on the context: another method's run on it reuses them
    result = run(
        ctx,
        method_obj,
        spec.ratio,
        spec.question,
        spec.max_new_tokens,
        sub_progress(progress, 0.42, 0.58),
        record_importance=True,
    )
    if done_for_it.compression:  # made for this run by its preparation: not an earlier run's
        result = replace(result, compression_reused=False)
    return Explored(
        result,
        ctx.cached(TokenTexts(), lambda: token_texts(lm.tokenizer, ctx.tokens.ids.tolist())),
        expected_answer(spec.question),
        method_obj.uses_question(),
        prefill_reused=not (prefilled or done_for_it.prefill),
        full_answer_reused=answered and not done_for_it.answer,
        wall_s=time.perf_counter() - start + done_for_it.seconds,
        roles=roles,
    )
