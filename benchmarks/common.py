"""The shared benchmark setting: the embedded model on the QuALITY story with its five questions.

Reads the evaluation data (not part of the product) from ``$KVLAB_DATA``
(:func:`kvlab.tasks.datasets.data_dir`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvlab.context import Context, prepare_context
from kvlab.methods import Method, Request
from kvlab.metrics import head_errors, log_perplexity
from kvlab.pipeline import Evaluation, evaluation
from kvlab.runtime.cache import CompressedKV
from kvlab.runtime.decode import continuation_logprobs
from kvlab.runtime.model import LoadedModel

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def quality_story() -> dict:
    return json.loads((DATA / "quality_examples.json").read_text())[0]


def first_tokens(lm: LoadedModel, text: str, n: int) -> str:
    return lm.tokenizer.decode(lm.tokenizer(text, add_special_tokens=False).input_ids[:n])


def question_with_options(q: dict) -> str:
    letters = "ABCD"
    options = "\n".join(f"{letters[i]}. {opt}" for i, opt in enumerate(q["options"]))
    return f"{q['question']}\n{options}\nAnswer with the letter and a short reason."


@dataclass
class Setting:
    """A prepared document and its held-out evaluations."""

    ctx: Context
    evaluations: list[Evaluation]

    @property
    def eval_queries(self) -> list[torch.Tensor]:
        """Per layer [H, n, d]: the five question turns' held-out queries together
        (the questions with their options, asked after the document)."""
        return [
            torch.cat([ev.queries[i][:, : ev.question_ids.numel()] for ev in self.evaluations], dim=1)
            for i in range(self.ctx.lm.n_layers)
        ]


def quality_setting(lm: LoadedModel, tokens: int = 1500, max_new_tokens: int = 32) -> Setting:
    story = quality_story()
    ctx = prepare_context(lm, first_tokens(lm, story["text"], tokens))
    evs = [evaluation(ctx, question_with_options(q), max_new_tokens) for q in story["questions"]]
    return Setting(ctx, evs)


@dataclass
class Measured:
    """One method at one ratio on the setting."""

    method: str
    ratio: float
    output_err: float  # the document block's (template prefix excluded), as the AM paper reports
    mass_err: float
    output_err_cache: float  # the whole cache's, as the app shows
    logppl: float  # mean over the answers of each answer's log-ppl
    answer_gap: float  # mean over the answers of |log-ppl - the full cache's|: no cancelling between answers
    token_gap: float  # mean over the answers of the mean |log p - the full cache's| per answer token
    first_nll: float  # the answers' first token (the option letter): what the document decides
    bytes: int
    compress_s: float
    stored: CompressedKV


def measure(setting: Setting, label: str, method: Method, ratio: float, eval_queries: list[torch.Tensor]) -> Measured:
    ctx = setting.ctx
    start = time.perf_counter()
    stored = method.compress(Request(ctx, ratio))
    seconds = time.perf_counter() - start
    fit = stored.meta.get("fit_s")
    if fit:  # Attention Matching: query generation is timed apart
        seconds -= fit.get("queries", 0.0)
    errors = head_errors(ctx.full.stored, stored, eval_queries, block_start=ctx.prefix_len, lm=ctx.lm)
    whole = head_errors(ctx.full.stored, stored, eval_queries, lm=ctx.lm)
    logps = [
        continuation_logprobs(ctx.lm, stored, ev.question_ids, torch.tensor(ev.answer.ids))
        for ev in setting.evaluations
    ]
    refs = [torch.tensor(ev.answer.logprobs) for ev in setting.evaluations]
    ppl = [log_perplexity(lp) for lp in logps]
    answer_gap = [abs(p - log_perplexity(ref)) for p, ref in zip(ppl, refs)]
    token_gap = [float((lp - ref).abs().mean()) for lp, ref in zip(logps, refs)]
    first = [float(-lp[0]) for lp in logps]
    return Measured(
        label,
        ratio,
        errors.mean_output,
        errors.mean_mass,
        whole.mean_output,
        _mean(ppl),
        _mean(answer_gap),
        _mean(token_gap),
        _mean(first),
        stored.nbytes,
        seconds,
        stored,
    )


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def full_logppl(setting: Setting) -> float:
    vals = [log_perplexity(torch.tensor(ev.answer.logprobs)) for ev in setting.evaluations]
    return sum(vals) / len(vals)


def full_first_nll(setting: Setting) -> float:
    vals = [-ev.answer.logprobs[0] for ev in setting.evaluations if ev.answer.logprobs]
    return sum(vals) / len(vals)
