"""Tasks with known answers: scoring, generators, runner, resume, shards, report."""

from __future__ import annotations

import pytest

from kvlab.tasks.scoring import (
    all_contained,
    contains_match,
    exact_match,
    normalize_answer,
    token_f1,
)


# --- scoring, against hand-worked SQuAD-style cases -------------------------

@pytest.mark.parametrize(
    "text, expected",
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  An   apple, a day ", "apple day"),
        ("Theatre", "theatre"),  # "the" inside a word stays
        ("U.S.A.", "usa"),
        ("", ""),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_exact_match_aliases():
    assert exact_match("the Denver Broncos.", "Denver Broncos")
    assert exact_match("Broncos", ["Denver Broncos", "broncos"])
    assert not exact_match("Denver Broncos won", "Denver Broncos")


def test_contains_match_whole_words():
    assert contains_match("The special number is 48213.", "48213")
    assert not contains_match("The special number is 482137.", "48213")
    assert contains_match("It was a red-fox, maybe", ["blue", "redfox"])
    assert not contains_match("anything", "")
    assert not contains_match("", "x")


def test_token_f1_hand_worked():
    # prediction 3 words, gold 2 words, 1 in common: P=1/3 R=1/2 F1=0.4
    assert token_f1("the cat sat down", "a cat ran") == pytest.approx(0.4)
    assert token_f1("Denver Broncos", ["Panthers", "the Denver Broncos"]) == 1.0
    assert token_f1("", "") == 1.0
    assert token_f1("", "x") == 0.0
    # repeated words count by multiplicity: common = min(2, 1) = 1
    assert token_f1("go go", "go") == pytest.approx(2 * 0.5 * 1 / 1.5)


def test_all_contained():
    assert all_contained("values: 11, 22 and 33", ["11", "22", "33"])
    assert not all_contained("values: 11, 22", ["11", "22", "33"])
