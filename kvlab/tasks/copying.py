"""A long-generation task with a known answer: copy a list of codes back, in order.

The prompt lists ``n`` short codes (a capital letter and three digits, one per
line) and asks for the list again. Every code of the answer must come from the
prompt: a cache that drops part of the list while the model writes loses those
codes, whatever the rest of its answer looks like. The embedded model copies
with an unbounded cache, in its own format (each code in a sentence and a code
block, about 20 tokens a code), so the scores read the codes out of the answer
whatever surrounds them.

Scores: token F1 of the answer's codes against the list (order-free, via
kvlab.tasks.marking) and how many of the list's codes the answer holds in the
list's order (their longest common subsequence: one slip costs one code).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from kvlab.tasks.items import TaskItem, TokenCounter
from kvlab.tasks.marking import token_f1

#: Letters of the codes (no I or O: they read like digits).
LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"
INSTRUCTION = "Copy the list of codes above exactly, one code per line, in the same order."
#: Tokens a code takes in the list (letter, three digits, newline) on SmolLM2, for sizing documents.
TOKENS_PER_CODE = 5
#: Tokens the embedded model writes per code when it copies (a sentence and a code block each).
ANSWER_TOKENS_PER_CODE = 20
#: A code as it appears in an answer, whatever surrounds it.
CODE = re.compile(r"\b[A-Z]\d{3}\b")


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
    """How many codes the embedded model copies in about ``new_tokens`` tokens."""
    return max(1, new_tokens // ANSWER_TOKENS_PER_CODE)


@dataclass(frozen=True)
class CopyScore:
    """f1: SQuAD token F1 of the answer's codes against the list (0 to 1, order-free);
    in_order: the list's codes that the answer holds in the list's order; n_codes: the list's length."""

    f1: float
    in_order: int
    n_codes: int


def written_codes(answer: str) -> list[str]:
    """The codes in ``answer``, in order; a code written twice in a row (in a sentence, then in a block) counts once."""
    found = CODE.findall(answer)
    return [c for i, c in enumerate(found) if i == 0 or c != found[i - 1]]


def common_subsequence(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence of ``a`` and ``b`` (dynamic programming, O(len a * len b))."""
    row = [0] * (len(b) + 1)
    for x in a:
        prev_diag = 0
        for j, y in enumerate(b):
            prev_diag, row[j + 1] = row[j + 1], prev_diag + 1 if x == y else max(row[j + 1], row[j])
    return row[-1]


def score_copy(answer: str, codes: list[str]) -> CopyScore:
    """Score an answer against the list it should copy."""
    written = written_codes(answer)
    return CopyScore(token_f1(" ".join(written), " ".join(codes)), common_subsequence(written, codes), len(codes))


def copy_codes(count: TokenCounter, n: int, seed: int, length: int) -> list[TaskItem]:
    """Task-suite items (kvlab.tasks): a list of at most ``length`` tokens to copy, scored by token F1."""
    items = []
    for i in range(n):
        n_codes = max(1, length // TOKENS_PER_CODE)
        codes = make_codes(n_codes, seed * 1000 + i)
        while n_codes > 1 and count(copy_document(codes)) > length:
            n_codes -= max(1, n_codes // 20)
            codes = codes[:n_codes]
        items.append(
            TaskItem(
                task="copy_codes",
                item_id=f"copy_codes-{seed}-{i}-{length}",
                document=copy_document(codes),
                question=INSTRUCTION,
                answers=(" ".join(codes),),
                scoring="f1",
                max_new_tokens=ANSWER_TOKENS_PER_CODE * len(codes) + 8,
                meta={"n_codes": len(codes)},
            )
        )
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
