"""A task item: one question about one document, with its known answer and how to score it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal

from transformers import PreTrainedTokenizerBase

from kvlab.prompts import encode

#: How an item's answer is scored:
#: "contains": some gold alias appears in the generated answer (RULER's string match);
#: "all": the fraction of the gold values that appear (RULER's string_match_all; right when all do);
#: "f1": SQuAD token F1 of the generated answer (free text; exact match kept beside it);
#: "choice": the option with the highest log-likelihood (lm-eval's multiple choice).
AnswerScoring = Literal["contains", "all", "f1", "choice"]

#: Counts a text's tokens the way the context is tokenised.
TokenCounter = Callable[[str], int]


class TaskError(ValueError):
    """A task cannot be built (unknown name, missing data file, bad size); one line says why."""


@dataclass(frozen=True)
class TaskItem:
    """One question about one document.

    item_id: unique within its task and reproducible from the task's seed and
    length, so that results can be resumed and merged by key.
    answers: gold aliases ("contains", "f1"), every value that must come back
    ("all"), or the correct option's text ("choice").
    answer_prefix: text that opens the assistant's answer before the model
    continues (RULER's answer prefix), "" for none.
    choices / gold_index: the options and the 0-based correct one ("choice" only).
    depth: where the needle sits in the document, 0 to 1 (needle tasks), else None.
    """

    task: str
    item_id: str
    document: str
    question: str
    answers: tuple[str, ...]
    scoring: AnswerScoring
    answer_prefix: str = ""
    choices: tuple[str, ...] = ()
    gold_index: int | None = None
    depth: float | None = None
    max_new_tokens: int = 32
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.answers:
            raise TaskError(f"{self.task} item {self.item_id}: no gold answer")
        if self.scoring == "choice" and not (self.gold_index is not None and 0 <= self.gold_index < len(self.choices)):
            raise TaskError(f"{self.task} item {self.item_id}: gold_index outside the {len(self.choices)} options")


def token_counter(tokenizer: PreTrainedTokenizerBase) -> TokenCounter:
    """Document length in the model's tokens, counted as the context is encoded."""
    return lambda text: encode(tokenizer, text).numel()
