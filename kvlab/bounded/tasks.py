"""A long-generation task with a known answer: copy a list of codes back, in order.

The prompt lists ``n`` short codes (a capital letter and three digits, one per
line) and asks for the list again. The answer is as long as the list (about
five tokens a code on SmolLM2's tokenizer), and every code must come from the
prompt: a cache that drops part of the list while the model writes loses those
codes, whatever the rest of its answer looks like. The embedded model copies
the list well with an unbounded cache.

Scores use kvlab.tasks.scoring: token F1 of the codes (order-free) and the
number copied in order before the first mistake.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from kvlab.tasks.items import TaskItem, TokenCounter
from kvlab.tasks.scoring import normalize_answer, token_f1

#: Letters of the codes (no I or O: they read like digits).
LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"
INSTRUCTION = "Copy the list of codes above exactly, one code per line, in the same order."
#: Tokens a code takes in the answer (letter, three digits, newline) on SmolLM2, for sizing.
TOKENS_PER_CODE = 5


def make_codes(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct codes such as "K472", reproducible from ``seed``."""
    rng = random.Random(seed)
    pool = [f"{letter}{number}" for letter in LETTERS for number in range(100, 1000)]
    return rng.sample(pool, n)


def copy_document(codes: list[str]) -> str:
    """The text that holds the list (the user turn, before the instruction)."""
    return "Here is a list of codes:\n" + "\n".join(codes)


def copy_prompt(codes: list[str]) -> str:
    """The whole request: the list, then the instruction."""
    return copy_document(codes) + "\n\n" + INSTRUCTION


def codes_for_tokens(new_tokens: int) -> int:
    """How many codes make an answer of about ``new_tokens`` tokens."""
    return max(1, new_tokens // TOKENS_PER_CODE)


@dataclass(frozen=True)
class CopyScore:
    """f1: SQuAD token F1 of the answer's codes against the list (0 to 1, order-free);
    in_order: codes copied right, in order, before the first mistake; n_codes: the list's length."""

    f1: float
    in_order: int
    n_codes: int


def score_copy(answer: str, codes: list[str]) -> CopyScore:
    """Score an answer against the list it should copy."""
    written = normalize_answer(answer).split()
    expected = [normalize_answer(c) for c in codes]
    in_order = 0
    for got, want in zip(written, expected):
        if got != want:
            break
        in_order += 1
    return CopyScore(token_f1(answer, " ".join(codes)), in_order, len(codes))


def copy_codes(count: TokenCounter, n: int, seed: int, length: int) -> list[TaskItem]:
    """Task-suite items (kvlab.tasks): a list of at most ``length`` tokens to copy, scored by token F1."""
    items = []
    for i in range(n):
        n_codes = max(1, length // TOKENS_PER_CODE)
        codes = make_codes(n_codes, seed * 1000 + i)
        while n_codes > 1 and count(copy_document(codes)) > length:
            n_codes -= max(1, n_codes // 20)
            codes = codes[:n_codes]
        items.append(TaskItem(
            task="copy_codes", item_id=f"copy_codes-{seed}-{i}-{length}", document=copy_document(codes),
            question=INSTRUCTION, answers=(" ".join(codes),), scoring="f1",
            max_new_tokens=TOKENS_PER_CODE * len(codes) + 8, meta={"n_codes": len(codes)},
        ))
    return items


def codes_in_prompt(text: str) -> list[str] | None:
    """The codes when ``text`` is a copy request built by :func:`copy_prompt`, else None
    (so that a front end scores the task whenever its prompt is given)."""
    head, _, rest = text.strip().partition("\n")
    body, _, instruction = rest.rpartition("\n\n")
    if head != copy_document([]).strip() or instruction.strip() != INSTRUCTION:
        return None
    codes = body.split()
    return codes or None
