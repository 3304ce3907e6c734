"""Answer scoring against known answers, normalised as SQuAD and lm-eval do.

Every scorer takes the model's prediction and one gold answer or a list of
aliases, and scores against the best alias.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
# SQuAD's punctuation is ASCII's; the typographic quotes join it here: a model that copies a book's
# curly quotes would otherwise glue them to the word it quotes ("‘champagne.’" never matching "champagne").
_PUNCT = str.maketrans("", "", string.punctuation + "\u2018\u2019\u201a\u201c\u201d\u201e\u00ab\u00bb\u2039\u203a")


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, collapse whitespace.

    The order (case, punctuation, articles, whitespace) is SQuAD v1.1's
    official evaluation script's, so scores are comparable with published ones;
    its punctuation is ASCII's, to which the typographic quotes are added.
    """
    text = text.lower().translate(_PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _aliases(gold: str | Sequence[str]) -> list[str]:
    """The gold answer as a list of aliases (a bare string is one alias)."""
    return [gold] if isinstance(gold, str) else list(gold)


def exact_match(prediction: str, gold: str | Sequence[str]) -> bool:
    """True when the normalised prediction equals some normalised alias."""
    pred = normalize_answer(prediction)
    return any(pred == normalize_answer(g) for g in _aliases(gold))


def contains_match(prediction: str, gold: str | Sequence[str]) -> bool:
    """True when some normalised alias appears in the normalised prediction.

    Matching is on whole words: gold "1234" is not found in "12345", which a
    plain substring test would accept (needle values differ by one digit
    often enough to matter). An alias that normalises to nothing never matches.
    """
    pred = f" {normalize_answer(prediction)} "
    for g in _aliases(gold):
        norm = normalize_answer(g)
        if norm and f" {norm} " in pred:
            return True
    return False


def token_f1(prediction: str, gold: str | Sequence[str]) -> float:
    """SQuAD token F1 on normalised words, the maximum over aliases (0 to 1)."""
    pred_tokens = normalize_answer(prediction).split()
    best = 0.0
    for g in _aliases(gold):
        gold_tokens = normalize_answer(g).split()
        if not pred_tokens or not gold_tokens:
            # SQuAD's convention: two empty answers agree, one empty one does not.
            best = max(best, float(pred_tokens == gold_tokens))
            continue
        common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
        if common:
            precision = common / len(pred_tokens)
            recall = common / len(gold_tokens)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best
