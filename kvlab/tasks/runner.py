"""Run task items over methods and ratios: one prefill per document, scored answers.

For each document: one prefill (shared by every method, ratio and question
on it), the full cache's answer once per item (the ceiling), "no_context"
once per item (the floor), then every method at every ratio. A method that
never reads the question compresses each document once per ratio, whatever
the number of questions on it.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from kvlab.context import Context, Progress, no_progress, prepare_context
from kvlab.methods import Method, get_method
from kvlab.pipeline import compressed
from kvlab.prompts import encode, question_tokens
from kvlab.runtime.cache import CompressedKV
from kvlab.runtime.decode import continuation_logprobs, greedy
from kvlab.runtime.model import LoadedModel
from kvlab.tasks.items import TaskItem
from kvlab.tasks.marking import contains_match, exact_match, normalize_answer, token_f1

FULL = "full"
"""The uncompressed cache: the ceiling (not a registered method)."""
FLOOR = "no_context"
"""The registered method that drops the document: the floor."""


@dataclass(frozen=True)
class MethodSpec:
    """A method to run: its registered name, an optional preset, and option overrides."""

    name: str
    preset: str = ""
    options: tuple[tuple[str, Any], ...] = ()

    def instantiate(self) -> Method:
        extra = {"preset": self.preset} if self.preset else {}
        return get_method(self.name, **extra, **dict(self.options))

    @property
    def variant(self) -> str:
        """The preset and the knob overrides as results record them ("AM-OMP", "self_study_weight=4"; "": defaults)."""
        return " ".join([self.preset] * bool(self.preset) + [f"{k}={v}" for k, v in self.options])


def result_key(model: str, task: str, item_id: str, method: str, preset: str, ratio: float | None) -> str:
    """The identity of one result: what resume skips and shard merges deduplicate."""
    return json.dumps([model, task, item_id, method, preset, ratio])


@dataclass
class TaskResult:
    """One item answered from one cache (a method at a ratio, or the full cache).

    preset: the preset and any knob overrides (:attr:`MethodSpec.variant`).
    ratio: None for the full cache and for methods that ignore the ratio (no_context).
    score: the task's measure in [0, 1] (contains match, fraction of values
    found, token F1, or option accuracy); correct: score == 1.
    exact / f1: exact match and token F1 of the generated answer (free text;
    for multiple choice, of the chosen option's text).
    agrees_full: the same answer as the full cache's (normalised text, or the same option).
    gold_logprob: summed log-probability of the gold answer (free text and
    multiple choice), None for the synthetic tasks.
    correct_norm: multiple choice only, accuracy with each option's
    log-likelihood divided by its length in bytes (lm-eval's acc_norm).
    """

    task: str
    item_id: str
    method: str
    preset: str
    ratio: float | None
    model: str
    score: float
    correct: bool
    exact: bool
    f1: float
    answer: str
    answer_full: str
    agrees_full: bool
    gold_logprob: float | None
    correct_norm: bool | None
    depth: float | None
    doc_tokens: int
    compress_s: float
    answer_s: float

    @property
    def key(self) -> str:
        return result_key(self.model, self.task, self.item_id, self.method, self.preset, self.ratio)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Outcome:
    """An item answered from one cache, before it is compared with the full cache's answer."""

    answer: str
    choice: int | None
    score: float
    exact: bool
    f1: float
    gold_logprob: float | None
    correct_norm: bool | None
    seconds: float


def item_prompt_ids(lm: LoadedModel, item: TaskItem) -> torch.Tensor:
    """The question turn, then the answer prefix that opens the model's answer: ids [n]."""
    ids = question_tokens(lm.tokenizer, item.question)
    if item.answer_prefix:
        ids = torch.cat([ids, encode(lm.tokenizer, item.answer_prefix)])
    return ids


def _continuation(lm: LoadedModel, text: str) -> torch.Tensor:
    # The answer follows the prompt after a space, as lm-eval's continuations do.
    return encode(lm.tokenizer, " " + text.strip())


def answer_item(lm: LoadedModel, stored: CompressedKV, item: TaskItem, prompt: torch.Tensor) -> Outcome:
    """Answer ``item`` from ``stored`` and score it against its gold answer."""
    start = time.perf_counter()
    if item.scoring == "choice":
        logprobs = [float(continuation_logprobs(lm, stored, prompt, _continuation(lm, o)).sum()) for o in item.choices]
        choice = max(range(len(logprobs)), key=logprobs.__getitem__)
        per_byte = [lp / max(1, len(o.encode())) for lp, o in zip(logprobs, item.choices)]
        norm_choice = max(range(len(per_byte)), key=per_byte.__getitem__)
        answer = item.choices[choice]
        return Outcome(
            answer,
            choice,
            float(choice == item.gold_index),
            choice == item.gold_index,
            token_f1(answer, item.answers),
            logprobs[item.gold_index],
            norm_choice == item.gold_index,
            time.perf_counter() - start,
        )
    answer = greedy(lm, stored, prompt, item.max_new_tokens).text
    if item.scoring == "all":
        score = sum(contains_match(answer, g) for g in item.answers) / len(item.answers)
    elif item.scoring == "f1":
        score = token_f1(answer, item.answers)
    else:
        score = float(contains_match(answer, item.answers))
    gold_logprob = None
    if item.scoring == "f1":
        gold_logprob = float(continuation_logprobs(lm, stored, prompt, _continuation(lm, item.answers[0])).sum())
    return Outcome(
        answer,
        None,
        score,
        exact_match(answer, item.answers),
        token_f1(answer, item.answers),
        gold_logprob,
        None,
        time.perf_counter() - start,
    )


def _agrees(full: Outcome, other: Outcome) -> bool:
    if full.choice is not None:
        return full.choice == other.choice
    return normalize_answer(full.answer) == normalize_answer(other.answer)


def _result(
    item: TaskItem,
    ctx: Context,
    method: str,
    preset: str,
    ratio: float | None,
    out: Outcome,
    full: Outcome,
    compress_s: float,
) -> TaskResult:
    return TaskResult(
        task=item.task,
        item_id=item.item_id,
        method=method,
        preset=preset,
        ratio=ratio,
        model=ctx.lm.name,
        score=out.score,
        correct=out.score >= 1.0,
        exact=out.exact,
        f1=out.f1,
        answer=out.answer,
        answer_full=full.answer,
        agrees_full=_agrees(full, out),
        gold_logprob=out.gold_logprob,
        correct_norm=out.correct_norm,
        depth=item.depth,
        doc_tokens=ctx.doc_len,
        compress_s=compress_s,
        answer_s=out.seconds,
    )


@dataclass(frozen=True)
class Plan:
    """Every (method, variant, ratio) run on each item: the floor first, then the methods.

    A ratio of None marks a method that ignores the ratio (run once per item).
    """

    runs: tuple[tuple[MethodSpec, Method, float | None], ...]

    @classmethod
    def of(cls, methods: Sequence[MethodSpec], ratios: Sequence[float]) -> "Plan":
        runs = []
        specs = [MethodSpec(FLOOR)] + [m for m in methods if m.name not in (FULL, FLOOR)]
        for spec in specs:
            method = spec.instantiate()
            for ratio in [None] if method.fixed_budget else ratios:
                runs.append((spec, method, ratio))
        return cls(tuple(runs))

    def keys(self, model: str, item: TaskItem) -> list[str]:
        """The keys of every result this plan gives for ``item``, the full cache's first."""
        full = [result_key(model, item.task, item.item_id, FULL, "", None)]
        return full + [result_key(model, item.task, item.item_id, s.name, s.variant, r) for s, _, r in self.runs]


def group_by_document(items: Iterable[TaskItem]) -> list[list[TaskItem]]:
    """Items grouped by document text, in first-seen order (one prefill per group)."""
    groups: dict[str, list[TaskItem]] = {}
    for item in items:
        groups.setdefault(item.document, []).append(item)
    return list(groups.values())


def run_items(
    lm: LoadedModel,
    items: Sequence[TaskItem],
    methods: Sequence[MethodSpec],
    ratios: Sequence[float],
    progress: Progress = no_progress,
    done: Iterable[str] = (),
    on_result: Callable[[TaskResult], None] | None = None,
    context_of: Callable[[LoadedModel, str], Context] = prepare_context,
) -> list[TaskResult]:
    """Answer every item from the full cache, no_context, and each method at each ratio.

    context_of(lm, document): how a document is read (the bench prefills each on its own; a live needle
    test reads them through the lab's shared store, where the page prepared them).

    done: result keys to skip (resume); a document whose results are all done
    is not even prefilled. on_result: called with each new result as soon as
    it exists (the bench appends it to its JSONL file). Returns the new results.
    progress(fraction, description) hears each finished result.
    """
    plan = Plan.of(methods, ratios)
    done = set(done)
    total = max(1, len(items) * (1 + len(plan.runs)))
    finished = 0
    results: list[TaskResult] = []

    def emit(result: TaskResult) -> None:
        nonlocal finished
        results.append(result)
        if on_result is not None:
            on_result(result)
        finished += 1
        progress(
            finished / total, f"{result.task} {result.method} {'' if result.ratio is None else f'{result.ratio:g}x'}"
        )

    for group in group_by_document(items):
        todo = [it for it in group if not set(plan.keys(lm.name, it)) <= done]
        finished += (len(group) - len(todo)) * (1 + len(plan.runs))
        if not todo:
            continue
        progress(finished / total, f"prefill of a {group[0].task} document")
        ctx = context_of(lm, group[0].document)
        for item in todo:
            keys = plan.keys(lm.name, item)
            prompt = item_prompt_ids(lm, item)
            # Always computed (cheap next to the prefill): every other run is compared with it.
            full = answer_item(lm, ctx.full.stored, item, prompt)
            if keys[0] in done:
                finished += 1
            else:
                emit(_result(item, ctx, FULL, "", None, full, full, 0.0))
            for (spec, method, ratio), key in zip(plan.runs, keys[1:]):
                if key in done:
                    finished += 1
                    continue
                # The pipeline's own compression, kept on the context: a method that never reads the
                # question compresses the document once per ratio, whatever the number of questions.
                made, _ = compressed(ctx, method, ratio or 1.0, item.question, no_progress, record_importance=False)
                out = answer_item(lm, made.stored, item, prompt)
                emit(_result(item, ctx, spec.name, spec.variant, ratio, out, full, made.compress_s))
    return results


@dataclass
class SummaryRow:
    """Accuracy of one (task, method, preset, ratio) over its items.

    accuracy: mean score; exact: fraction fully right; agreement: fraction
    with the full cache's answer; f1, gold_logprob, accuracy_norm: means where
    the task has them, else None. note: says when the full cache itself scores
    below ``LOW_CEILING`` on the task.
    """

    task: str
    method: str
    preset: str
    ratio: float | None
    n: int
    accuracy: float
    exact: float
    agreement: float
    f1: float | None
    gold_logprob: float | None
    accuracy_norm: float | None
    note: str = ""
    # The Wilson score interval (95 %) of the accuracy over the n items.
    accuracy_low: float = 0.0
    accuracy_high: float = 1.0

    def to_dict(self) -> dict:
        return asdict(self)


def wilson_interval(successes: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``successes / n`` (95 % by default): (low, high).

    Unlike the normal approximation it stays within [0, 1] and is not empty at 0/n or n/n. A
    fractional ``successes`` (a mean of partial scores) is taken as the proportion it gives.
    """
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5
    return max(0.0, centre - half), min(1.0, centre + half)


LOW_CEILING = 0.6
"""Below this full-cache accuracy a task says too little about compression on this model."""


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def unique(results: Iterable[TaskResult]) -> list[TaskResult]:
    """One result per key (the last one seen), in first-seen order: merges shards and reruns."""
    by_key: dict[str, TaskResult] = {}
    for r in results:
        by_key[r.key] = r
    return list(by_key.values())


def summarise(results: Iterable[TaskResult]) -> list[SummaryRow]:
    """The accuracy table: one row per (task, method, preset, ratio); full first, then no_context."""
    groups: dict[tuple, list[TaskResult]] = {}
    for r in unique(results):
        groups.setdefault((r.task, r.method, r.preset, r.ratio), []).append(r)
    rows = []
    for (task, method, preset, ratio), rs in groups.items():
        low, high = wilson_interval(sum(r.score for r in rs), len(rs))
        rows.append(
            SummaryRow(
                task,
                method,
                preset,
                ratio,
                len(rs),
                accuracy=_mean([r.score for r in rs]),
                exact=_mean([float(r.correct) for r in rs]),
                agreement=_mean([float(r.agrees_full) for r in rs]),
                f1=_mean([r.f1 for r in rs]) if rs[0].gold_logprob is not None else None,
                gold_logprob=_mean([r.gold_logprob for r in rs]),
                accuracy_norm=_mean([None if r.correct_norm is None else float(r.correct_norm) for r in rs]),
                accuracy_low=low,
                accuracy_high=high,
            )
        )
    ceilings = {row.task: row.accuracy for row in rows if row.method == FULL}
    for row in rows:
        if ceilings.get(row.task, 1.0) < LOW_CEILING:
            row.note = f"full cache below {LOW_CEILING:.0%} on this task: {ceilings[row.task]:.0%}"
    order = {FULL: 0, FLOOR: 1}
    rows.sort(key=lambda r: (r.task, order.get(r.method, 2), r.method, r.preset, r.ratio or 0.0))
    return rows
