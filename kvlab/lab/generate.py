"""The Generate tab's work without gradio: every bounded-cache policy writing after the same prompt.

The unbounded cache writes first (the reference). Each bounded policy then
writes on its own copy of nothing but the prompt (greedy), and re-reads the
reference's text teacher-forced, so its log-probabilities of the reference
text can be compared position by position. When the prompt is the copy-codes
task's (kvlab.tasks.copying), every answer is scored too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvlab import cancellation, limits, messages, models
from kvlab.bounded.loop import PROMPT_CHUNK, BoundedRun, run_policy
from kvlab.bounded.policies import REFERENCE, bounded_policies, make_policy, policy_class
from kvlab.context import Progress, no_progress
from kvlab.lab.explore import token_texts
from kvlab.lab.inputs import (
    InputError,
    check_new_tokens,
    check_prompt,
    check_question,
    check_question_tokens,
    check_window,
    document_text,
    whole_number,
)
from kvlab.prompts import Template, context_tokens, encode, question_tokens
from kvlab.tasks.copying import CopyScore, codes_in_prompt, score_copy

#: The most tokens one request may write (``KVLAB_MAX_GENERATE_TOKENS``, read at import: the slider's end).
MAX_GENERATE_TOKENS = limits.LIMITS.generate_tokens
DEFAULT_GENERATE_TOKENS = 200


@dataclass
class MethodGeneration:
    """One policy's result beside the reference.

    run: its own greedy text and cache trace; forced: log-probabilities [m] of the
    reference's tokens under its cache (teacher-forced); divergence: the first
    token index where its text leaves the reference's (None: identical);
    logppl: -mean(forced); same / rest: its text before and from the divergence;
    task: the copy task's score (None when the prompt is not the task's).
    """

    method: str
    label: str
    run: BoundedRun
    forced: list[float]
    divergence: int | None
    logppl: float
    same: str
    rest: str
    task: CopyScore | None = None


@dataclass
class Generated:
    """Every policy after one prompt: the prompt's size, the budget, the reference and the bounded runs."""

    model: str
    prompt_tokens: int
    protected: int
    budget: int
    max_new_tokens: int
    reference: MethodGeneration
    runs: list[MethodGeneration] = field(default_factory=list)
    wall_s: float = 0.0


def divergence(ids: list[int], reference: list[int]) -> int | None:
    """First index where ``ids`` and ``reference`` differ (a shorter one ends there); None when equal."""
    for i, (a, b) in enumerate(zip(ids, reference)):
        if a != b:
            return i
    return None if len(ids) == len(reference) else min(len(ids), len(reference))


def prompt_ids(tokenizer, prompt: str | None, document: str | None, question: str | None) -> tuple[torch.Tensor, int]:
    """The chat-templated prompt [n] and its template prefix length: the prompt as one user turn,
    or the document then the question (as Explore asks it)."""
    if prompt is not None:
        ctx = context_tokens(tokenizer, prompt)
        return torch.cat([ctx.ids, encode(tokenizer, Template.of(tokenizer).suffix)]), ctx.prefix_len
    ctx = context_tokens(tokenizer, document)
    return torch.cat([ctx.ids, question_tokens(tokenizer, question)]), ctx.prefix_len


def check_methods(methods: list[str] | None) -> list[str]:
    """The bounded policies asked for, in the registry's order (default: all); InputError for unknown ones."""
    offered = bounded_policies()
    chosen = offered if methods is None else [m for m in methods if m != REFERENCE]
    unknown = [m for m in chosen if m not in offered]
    if unknown:
        raise InputError(messages.unknown("generation method", unknown, offered))
    if not chosen:
        raise InputError("Pick at least one bounded-cache method.")
    return [m for m in offered if m in chosen]


def _beside(lm, name: str, run: BoundedRun, forced: list[float], reference: list[int], codes) -> MethodGeneration:
    cut = divergence(run.ids, reference)
    pieces = token_texts(lm.tokenizer, run.ids)
    split = len(pieces) if cut is None else cut
    logppl = -sum(forced) / len(forced) if forced else 0.0
    return MethodGeneration(
        name,
        policy_class(name).label,
        run,
        forced,
        cut,
        logppl,
        "".join(pieces[:split]),
        "".join(pieces[split:]),
        score_copy(run.text, codes) if codes else None,
    )


def _checked_request(
    prompt: str | None,
    document: str | None,
    file: str | None,
    question: str | None,
    methods: list[str] | None,
    budget: int | None,
    max_new_tokens: int,
) -> tuple[int, list[str], int | None, str | None, list[str] | None, str | None, str | None]:
    """:func:`generate`'s arguments checked before any model is loaded: (max_new_tokens, chosen methods,
    budget, prompt, its copy-task codes, document, question); InputError or DocumentError if refused."""
    max_new_tokens = check_new_tokens(max_new_tokens)
    chosen = check_methods(methods)
    if budget is not None:
        budget = whole_number(budget, "budget (keys per KV head)")
        if budget < 1:
            raise InputError(f"The budget is in keys per head and must be at least 1, got {budget}.")
    if prompt is not None and prompt.strip():
        prompt = check_prompt(prompt)
        codes = codes_in_prompt(prompt)
    else:
        prompt, codes = None, None
        document, question = document_text(document, file), check_question(question)
    return max_new_tokens, chosen, budget, prompt, codes, document, question


def generate(
    prompt: str | None = None,
    document: str | None = None,
    file: str | None = None,
    question: str | None = None,
    methods: list[str] | None = None,
    budget: int | None = None,
    max_new_tokens: int = DEFAULT_GENERATE_TOKENS,
    model: str | None = None,
    progress: Progress = no_progress,
) -> Generated:
    """Every method in ``methods`` (default: all bounded ones) writing greedily after the same prompt.

    prompt: one user turn; else ``document`` (or the uploaded ``file``) then ``question``.
    budget: keys per KV head (default: a quarter of the unbounded run's final length).
    Raises InputError, DocumentError, MethodError or ModelLoadError with a message fit for the user.
    """
    start = time.perf_counter()
    max_new_tokens, chosen, budget, prompt, codes, document, question = _checked_request(
        prompt, document, file, question, methods, budget, max_new_tokens
    )
    progress(0.0, f"loading the model {model or ''}")
    lm = models.get_model(model or None)
    if question is not None and prompt is None:
        check_question_tokens(lm.tokenizer, question)
    ids, protected = prompt_ids(lm.tokenizer, prompt, document, question)
    check_window(lm, ids.numel(), max_new_tokens)
    if budget is not None:  # a budget too small for a policy is refused before the reference run
        for name in chosen:
            make_policy(name, lm, budget, protected).check(max(1, min(PROMPT_CHUNK, ids.numel())))
    total = max_new_tokens * (1 + 2 * len(chosen))
    done = 0

    def reporter(desc: str):
        def report(tokens: int) -> None:
            if tokens % 8 == 0:
                progress(min(1.0, (done + tokens) / total), f"{desc}: {tokens} tokens")

        return report

    progress(0.01, f"{REFERENCE}: reading {ids.numel()} prompt tokens")
    ref_run = run_policy(
        make_policy(REFERENCE, lm, None, protected), ids, max_new_tokens, on_token=reporter(f"{REFERENCE}, writing")
    )
    done += max_new_tokens
    reference = _beside(lm, REFERENCE, ref_run, ref_run.logprobs, ref_run.ids, codes)
    budget = int(budget) if budget is not None else max(1, (ids.numel() + len(ref_run.ids)) // 4)
    out = Generated(lm.name, ids.numel(), protected, budget, max_new_tokens, reference)
    for name in chosen:
        label = policy_class(name).label
        # Each policy's run is a unit of the request: others' runs may take the compute slot in between.
        cancellation.between_units(f"{len(out.runs) + 1} of {1 + len(chosen)} methods written")
        run = run_policy(
            make_policy(name, lm, budget, protected), ids, max_new_tokens, on_token=reporter(f"{label}, writing")
        )
        done += max_new_tokens
        forced = (
            run_policy(
                make_policy(name, lm, budget, protected),
                ids,
                len(ref_run.ids),
                forced=ref_run.ids,
                on_token=reporter(f"{label}, re-reading the unbounded text"),
            )
            if ref_run.ids
            else None
        )
        done += max_new_tokens
        out.runs.append(_beside(lm, name, run, forced.logprobs if forced else [], ref_run.ids, codes))
    progress(1.0, "done")
    out.wall_s = time.perf_counter() - start
    return out


def generation_record(g: Generated) -> dict:
    """A Generated as plain data (the CLI's --json and the benchmark): one entry per method, the reference first."""
    methods = []
    for m in [g.reference, *g.runs]:
        methods.append(
            {
                "method": m.method,
                "divergence": m.divergence,
                "logppl": m.logppl,
                "task_f1": None if m.task is None else m.task.f1,
                "task_in_order": None if m.task is None else m.task.in_order,
                "events": len(m.run.events),
                "max_keys": m.run.max_size,
                "bytes_end": m.run.nbytes[-1] if m.run.nbytes else 0,
                "tokens": len(m.run.ids),
                "tokens_per_s": m.run.tokens_per_s,
                "text": m.run.text,
            }
        )
    return {
        "model": g.model,
        "prompt_tokens": g.prompt_tokens,
        "budget": g.budget,
        "max_new_tokens": g.max_new_tokens,
        "wall_s": g.wall_s,
        "methods": methods,
    }
