"""Your pick (kvlab issue #43): a learner keeps the document's parts they choose within the ratio's
budget, and sees where that pick ranks among the methods at the same ratio on the same question.

:func:`read_for_pick` gives what a front end shows to pick from (the document's tokens and
sentences, before any prefill) and :func:`token_budget` how many tokens a ratio allows;
:func:`pick` runs the pick (the ``manual`` method, kvlab.methods.manual) and the rivals through the
lab's own path, each run a finished Explore run kept in the result store (kvlab.results: computed
once per model, document, question, method, options and ratio, and served again to a later pick or
to the Explore tab), then ranks them.

The ranking rule (:data:`RANK_RULE`): when the gold answer is known, a right answer ranks above a
wrong one; then the lower log-perplexity of the full cache's answer under the compressed cache
(``RunResult.logppl_compressed``: how well the cache still predicts what the full cache says);
runs equal on both share a rank.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

from kvlab import cancellation, models, results
from kvlab.context import Progress, no_progress
from kvlab.lab.compare import SweepError, not_run
from kvlab.lab.explore import explore, prepared_context, sub_progress, token_texts
from kvlab.lab.inputs import InputError, check_ratio, check_sweep, document_text, expected_answer
from kvlab.lab.spec import RunSpec, run_spec
from kvlab.lab.views import RunView, present
from kvlab.memo import MISSING
from kvlab.methods import MethodError
from kvlab.methods.manual import NONE, Manual, pick_ranges
from kvlab.pipeline import DEFAULT_MAX_NEW_TOKENS, RunResult
from kvlab.prompts import context_tokens
from kvlab.sentences import Sentence, split_sentences
from kvlab.tasks.marking import contains_match

log = logging.getLogger("kvlab.lab")

#: The rivals a pick is ranked among by default: the field's eviction baselines and the lab's compaction.
DEFAULT_RIVALS = ("snapkv", "kvzip", "h2o", "streaming_llm", "knorm", "attention_matching", "random")
RANK_RULE = (
    "right answers before wrong ones when the gold answer is known, then the lower log-perplexity of the "
    "full cache's answer under the compressed cache; equal runs share a rank"
)


def token_budget(doc_tokens: int, ratio: float) -> int:
    """The document tokens a head keeps at ``ratio``: T / ratio rounded, at least one (the rounding of
    kvlab.compression.request.Request.doc_budget, which every method's budget follows). InputError
    for a ratio outside kvlab's range."""
    return max(1, round(doc_tokens / check_ratio(ratio)))


@dataclass
class PickDocument:
    """What a learner picks from: the document's tokens and sentences (document-relative, 0-based).

    token_texts: each document token's text (as the token view shows them); sentences: the split
    the ``s<k>`` spans name (kvlab.sentences.split_sentences), covering every token once.
    """

    doc_tokens: int
    token_texts: list[str]
    sentences: list[Sentence]

    def budget(self, ratio: float) -> int:
        """The tokens a pick may hold at ``ratio`` (:func:`token_budget`)."""
        return token_budget(self.doc_tokens, ratio)


def read_for_pick(
    text: str | None, file: str | None, model: str | None = None, progress: Progress = no_progress
) -> PickDocument:
    """The document as the model reads it, split into tokens and sentences: tokenising only, no prefill.

    The same token ids as the run's context (kvlab.prompts.context_tokens), so a span means the
    same tokens here and in :func:`pick`. Raises DocumentError or ModelLoadError for the user.
    """
    document = document_text(text, file)
    progress(0.0, f"loading the model {model or ''} (the first use of a model takes a while)")
    lm = models.get_model(model or None)
    tokens = context_tokens(lm.tokenizer, document)
    ids = tokens.ids.tolist()
    progress(0.5, "splitting the document into sentences")
    doc_ids = ids[tokens.prefix_len :]
    sentences = split_sentences(lm.tokenizer, doc_ids)
    progress(1.0, "done")
    return PickDocument(len(doc_ids), token_texts(lm.tokenizer, ids)[tokens.prefix_len :], sentences)


def keep_text(keep: str | Sequence[str] | None) -> str:
    """The ``keep`` knob's text of a pick: spans as one text or a list of spans (``["s0", "40-59"]``);
    nothing (None, blank, an empty list) is the floor, ``none``."""
    if keep is None:
        return NONE
    text = keep if isinstance(keep, str) else ",".join(str(s).strip() for s in keep if str(s).strip())
    return text.strip() or NONE


@dataclass
class Ranked:
    """One run of the ranking: a method (``manual``: the pick) at the pick's ratio.

    rank: 1 for the best (equal runs share one); right: the answer contains the gold one
    (None: no gold answer known).
    """

    rank: int
    method: str
    right: bool | None
    logppl_compressed: float
    answer: str
    kept_tokens_mean: float
    memory_ratio: float
    result: RunResult

    @property
    def is_pick(self) -> bool:
        return self.method == Manual.name


@dataclass
class Picked:
    """A pick run and ranked among the rivals at its ratio on its question.

    view: the pick's run as the Explore tab shows it (its token fates show the pick); rows: the
    ranking, best first (the pick among them); rank / of: the pick's place ("3rd of 8": ``rank_text``);
    pick_tokens / budget: the pick's document tokens and the most the ratio allows; expected: the gold
    answer's aliases (None: unknown); errors: rivals that could not run (the ranking goes on without
    them); stopped: what was not run when the request's time limit ended it early, else "".
    """

    keep: str
    ratio: float
    question: str
    view: RunView
    rows: list[Ranked]
    rank: int
    pick_tokens: int
    budget: int
    expected: tuple[str, ...] | None
    rule: str = RANK_RULE
    errors: list[SweepError] = field(default_factory=list)
    stopped: str = ""
    wall_s: float = 0.0

    @property
    def result(self) -> RunResult:
        """The pick's run."""
        return self.view.result

    @property
    def of(self) -> int:
        return len(self.rows)

    @property
    def rank_text(self) -> str:
        """ "3rd of 8", with the methods the pick ties with."""
        tied = [r.method for r in self.rows if r.rank == self.rank and not r.is_pick]
        return f"{ordinal(self.rank)} of {self.of}" + (f" (tied with {', '.join(tied)})" if tied else "")


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, ..., 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def rank_key(right: bool | None, logppl: float) -> tuple[int, float]:
    """The sort key of :data:`RANK_RULE`: wrong answers after right and unmarked ones, then log-perplexity
    (a run that gave no finite one last)."""
    return (1 if right is False else 0, logppl if math.isfinite(logppl) else math.inf)


def ranking(runs: list[RunResult], expected: tuple[str, ...] | None) -> list[Ranked]:
    """``runs`` ranked by :data:`RANK_RULE`, best first; runs equal on both keys share a rank (1, 2, 2, 4)."""
    marked = [(None if expected is None else contains_match(r.answer_compressed, expected), r) for r in runs]
    keys = [rank_key(right, r.logppl_compressed) for right, r in marked]
    rows = [
        Ranked(
            1 + sum(other < key for other in keys),
            r.method,
            right,
            r.logppl_compressed,
            r.answer_compressed,
            r.kept_tokens_mean,
            r.memory_ratio,
            r,
        )
        for key, (right, r) in zip(keys, marked)
    ]
    return sorted(rows, key=lambda row: (row.rank, not row.is_pick, row.method))


def served_run(spec: RunSpec, progress: Progress) -> tuple[RunView, results.Served]:
    """The run as the Explore tab computes it (kvlab.lab.explore, kvlab.lab.views.present), through the
    result store under the Explore run's own key: computed once, then served to any later request;
    -> (the run, how it was served: stored, shared or computed)."""
    return results.store().serve(spec.key(), lambda: present(explore(spec, progress)))


def unstored(specs: list[RunSpec]) -> list[RunSpec]:
    """The specs whose runs the result store does not hold yet (what a pick will compute)."""
    return [spec for spec in specs if results.store().get(spec.key()) is MISSING]


def pick_specs(
    text: str | None,
    keep: str | Sequence[str] | None,
    ratio: float,
    question: str,
    methods: Sequence[str] = DEFAULT_RIVALS,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    model: str | None = None,
) -> list[RunSpec]:
    """The runs of :func:`pick`: the learner's pick (``manual``) first, then each rival at the same ratio
    and question. Raises InputError (and the others :func:`kvlab.lab.run_spec` raises) for bad inputs."""
    rivals = list(dict.fromkeys(m.strip() for m in methods if m.strip() and m.strip() != Manual.name))
    names, (ratio,) = check_sweep([Manual.name, *rivals], [ratio])
    mine = run_spec(text, None, Manual.name, ratio, question, max_new_tokens, {"keep": keep_text(keep)}, model)
    return [mine, *(mine.with_method(name) for name in names[1:])]


def run_order(specs: list[RunSpec]) -> list[RunSpec]:
    """``specs`` (the pick first) in the order to run them: the rivals already stored (warmed, or run by
    an earlier pick: no work), then the pick, then the rivals to compute. A class's picks then each take
    the compute slot in one stretch, where handing it over around stored rivals would make every pick
    in line take turns with all the others and finish last."""
    mine, *rivals = specs
    todo = unstored(rivals)
    return [*(spec for spec in rivals if spec not in todo), mine, *todo]


def pick(
    text: str | None,
    file: str | None,
    keep: str | Sequence[str] | None,
    ratio: float,
    question: str,
    methods: Sequence[str] = DEFAULT_RIVALS,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    progress: Progress = no_progress,
    model: str | None = None,
    gold: str | Sequence[str] | None = None,
) -> Picked:
    """Run the learner's pick (``keep``: :func:`keep_text`) at ``ratio`` and rank it among ``methods``.

    Every run is an Explore run of its method with default knobs (the pick: ``manual`` with
    ``keep``) at the same ratio on the same question, served by the result store (computed once).
    gold: the expected answer or its aliases (default: the bundled example's, when the question
    is one). The ranking follows :data:`RANK_RULE`. The pick is checked on the document before any
    run (MethodError: one line, the spans' problem); a rival that fails is recorded in
    ``errors``. The runs go in :func:`run_order`; each run that computed is a unit of the request
    (kvlab.cancellation.between_units): when the time limit passes after the pick ran, the ranking
    holds the runs done and ``stopped`` says what was not run. Raises DocumentError, MethodError,
    ModelLoadError or InputError for the user.
    """
    start = time.perf_counter()
    keep = keep_text(keep)
    planned = pick_specs(document_text(text, file), keep, ratio, question, methods, max_new_tokens, model)
    mine, ratio = planned[0], planned[0].ratio
    specs = run_order(planned)
    expected = expected_answer(mine.question) if gold is None else ((gold,) if isinstance(gold, str) else tuple(gold))
    progress(0.0, f"loading the model {mine.model or ''} (the first use of a model takes a while)")
    lm = models.get_model(mine.model)
    ctx, _ = prepared_context(lm, mine.document, sub_progress(progress, 0.02, 0.08))
    pick_tokens = sum(b - a for a, b in pick_ranges(keep, ctx, ratio))  # refused here, before any run
    views: dict[str, RunView] = {}
    errors: list[SweepError] = []
    stopped, how = "", "stored"
    for k, spec in enumerate(specs):
        name = spec.method
        label = f"{'your pick' if spec is mine else name} at {ratio:g}x ({k + 1}/{len(specs)}): "
        try:
            # Waiting requests take the slot after a run that computed (run_order: not after a stored one).
            if k and how == "computed":
                cancellation.between_units(f"{k} of {len(specs)} runs done")
            elif k:
                cancellation.checkpoint(f"{k} of {len(specs)} runs done")
            point = sub_progress(progress, 0.1 + 0.9 * k / len(specs), 0.9 / len(specs), label)
            views[name], how = served_run(spec, point)
        except cancellation.Cancelled as exc:
            if exc.reason != cancellation.TIME or Manual.name not in views:
                raise
            stopped = not_run(exc, k, [(s.build(), ratio) for s in specs[k:]])
            break
        except Exception as exc:  # noqa: BLE001 - a rival that fails must not lose the ranking
            if spec is mine:
                raise
            if not isinstance(exc, (MethodError, InputError)):
                log.exception("a rival of the pick failed (%s at %gx)", name, ratio)
            errors.append(SweepError(name, ratio, f"{type(exc).__name__}: {exc}"))
    rows = ranking([v.result for v in views.values()], expected)
    mine = next(r for r in rows if r.is_pick)
    return Picked(
        keep=keep,
        ratio=ratio,
        question=views[Manual.name].result.question,
        view=views[Manual.name],
        rows=rows,
        rank=mine.rank,
        pick_tokens=pick_tokens,
        budget=token_budget(ctx.doc_len, ratio),
        expected=expected,
        errors=errors,
        stopped=stopped,
        wall_s=time.perf_counter() - start,
    )


def spans_of(indices: Sequence[int]) -> str:
    """Sentence indices as the ``keep`` knob's text, runs joined (``[0, 1, 2, 3, 7]`` -> ``"s0-s3,s7"``);
    none is the floor, ``none``."""
    ordered = sorted(set(indices))
    runs: list[list[int]] = []
    for i in ordered:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(f"s{a}" if a == b else f"s{a}-s{b}" for a, b in runs) or NONE


def tally(sentences: Sequence[Sentence], ticked: Sequence[str], ratio: float) -> tuple[str, str]:
    """(the counter line, the ``keep`` text) of the sentences ticked by their labels (``s<k>``).

    The counter reads "picked N of B tokens (budget at Rx)", B the ratio's budget over the whole
    document (:func:`token_budget`), with a note when N is over it. Labels that name no sentence
    are ignored (a stale tick after the document changed). InputError for a ratio outside kvlab's range.
    """
    chosen = set(ticked)
    picked = [s for s in sentences if s.label in chosen]
    n = sum(s.n_tokens for s in picked)
    budget = token_budget(sum(s.n_tokens for s in sentences), ratio)
    line = f"picked {n} of {budget} tokens (budget at {ratio:g}x)"
    if n > budget:
        line += f": {n - budget} over, untick a sentence"
    return line, spans_of([s.index for s in picked])
