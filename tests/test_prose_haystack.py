"""The needle tasks' prose haystack and value shapes (issue #33), without a model.

Documents are sized with a word counter instead of a tokenizer, so every
length below is in words; the checks count sentences, paragraphs and words
of the text themselves rather than asking the generator where it put things.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvlab.tasks import synthetic
from kvlab.tasks.items import TaskError
from kvlab.tasks.marking import contains_match
from kvlab.tasks.task_registry import build_items

ROOT = Path(__file__).resolve().parent.parent
PROSE = ROOT / "assets" / "haystack" / "prose.txt"


def words(text: str) -> int:
    return len(text.split())


def paragraphs_of_asset() -> list[str]:
    """The asset's paragraphs read straight from the file, one line each."""
    return [" ".join(b.split()) for b in PROSE.read_text(encoding="utf-8").split("\n\n") if b.strip()]


def first_sentence(paragraph: str) -> str:
    """A paragraph's marker: its first sentence, which a needle (put between sentences) never splits."""
    return re.split(r"(?<=[.!?])\s", paragraph, maxsplit=1)[0]


def body(doc: str) -> str:
    """The document without its instruction line (the first paragraph)."""
    return doc.split("\n\n", 1)[1]


def needle_text(noun: str, key: str, value: str) -> str:
    return f"The special magic {noun} for {key} is: {value}."


def key_of(question: str) -> str:
    return re.search(r" for (\S+) in the text above", question).group(1)


# --- the asset ---------------------------------------------------------------


def test_prose_asset_is_long_varied_and_free_of_digits():
    paras = paragraphs_of_asset()
    assert len(paras) >= 60
    assert sum(map(words, paras)) >= 5000
    assert len(set(paras)) == len(paras)  # no paragraph twice in the file
    # No digits: a number or a code in the document is the needle's.
    assert not re.search(r"\d", PROSE.read_text(encoding="utf-8"))


def test_prose_asset_is_packaged():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = data["tool"]["setuptools"]["package-data"]["kvlab.assets"]
    assert any(PROSE in (ROOT / "assets").glob(p) for p in patterns)


# --- the documents -----------------------------------------------------------


@pytest.mark.parametrize("values", synthetic.VALUE_SHAPES)
def test_prose_items_are_deterministic_per_seed(values):
    a = synthetic.niah_single(words, 3, 7, 400, haystack="prose", values=values)
    b = synthetic.niah_single(words, 3, 7, 400, haystack="prose", values=values)
    c = synthetic.niah_single(words, 3, 8, 400, haystack="prose", values=values)
    assert a == b
    assert [i.document for i in a] != [i.document for i in c]


def test_prose_and_noise_items_share_keys_values_and_depths():
    """The filler's order has its own generator, so the two haystacks pose the same needles."""
    noise = synthetic.niah_single(words, 5, 0, 300)
    prose = synthetic.niah_single(words, 5, 0, 300, haystack="prose")
    assert [(i.question, i.answers, i.depth) for i in noise] == [(i.question, i.answers, i.depth) for i in prose]
    assert [i.task for i in prose] == ["niah_single[prose]"] * 5
    assert prose[0].item_id == "niah_single[prose]-L300-s0-0"


def test_defaults_keep_the_noise_task_as_before():
    item = synthetic.niah_single(words, 1, 0, 120)[0]
    assert item.task == "niah_single" and item.item_id == "niah_single-L120-s0-0"
    assert re.fullmatch(r"\d{7}", item.answers[0])
    assert synthetic.NOISE in item.document
    assert not any(p in item.document for p in paragraphs_of_asset())


@pytest.mark.parametrize("values, noun", [("number", "number"), ("code", "code"), ("name", "name")])
def test_needle_is_present_exactly_once(values, noun):
    for item in synthetic.niah_single(words, 4, 1, 500, haystack="prose", values=values):
        needle = needle_text(noun, key_of(item.question), item.answers[0])
        assert item.document.count(needle) == 1
        assert item.document.count(item.answers[0]) == 1
        assert item.answer_prefix == f"The special magic {noun} for {key_of(item.question)} is"


def test_needle_sits_at_the_requested_depth():
    """Grid depths 0, 1/4, 1/2, 3/4, 1: the share of the filler's sentences before the needle."""
    items = synthetic.needle_grid(words, 5, 0, 1500, haystack="prose")
    assert [i.depth for i in items] == [0.0, 0.25, 0.5, 0.75, 1.0]
    for item in items:
        before, after = body(item.document).split(needle_text("number", key_of(item.question), item.answers[0]))
        # A filler sentence ends in ". " or ".\n\n"; count them on each side.
        n_before = len(re.findall(r"[.!?](?:\s|$)", before))
        n_after = len(re.findall(r"[.!?](?:\s|$)", after))
        share = n_before / (n_before + n_after)
        assert share == pytest.approx(item.depth, abs=1.0 / (n_before + n_after) + 1e-9)


def test_depth_zero_and_one_are_the_ends():
    first, *_, last = synthetic.needle_grid(words, 5, 2, 600, haystack="prose")
    assert body(first.document).startswith(needle_text("number", key_of(first.question), first.answers[0]))
    assert body(last.document).rstrip().endswith(needle_text("number", key_of(last.question), last.answers[0]))


@pytest.mark.parametrize("length", [300, 1500, 4000])
def test_document_fits_the_requested_length(length):
    for item in synthetic.niah_multikey(words, 2, 0, length, haystack="prose"):
        n = words(item.document)
        # At most length, and no further sentence would fit (the longest sentence is under 60 words).
        assert length - 60 < n <= length


def test_length_too_short_for_one_sentence_is_refused():
    with pytest.raises(TaskError):
        synthetic.niah_single(words, 1, 0, 20, haystack="prose")


def test_no_paragraph_repeats_within_2000_words():
    """8,000 words, longer than the whole filler, so paragraphs come back, but each one a filler apart."""
    paras = paragraphs_of_asset()
    item = synthetic.niah_single(words, 1, 3, 8000, haystack="prose")[0]
    text = body(item.document)
    assert len({first_sentence(p) for p in paras}) == len(paras)  # the markers tell paragraphs apart
    for p in paras:
        starts = [m.start() for m in re.finditer(re.escape(first_sentence(p)), text)]
        for a, b in zip(starts, starts[1:]):
            assert words(text[a:b]) >= 2000
    assert any(text.count(first_sentence(p)) == 2 for p in paras)  # the document did cycle the filler


def test_a_2000_word_document_holds_each_paragraph_at_most_once():
    item = synthetic.niah_multivalue(words, 1, 5, 2000, haystack="prose")[0]
    for p in paragraphs_of_asset():
        assert item.document.count(first_sentence(p)) <= 1


# --- the value shapes and the scorer -----------------------------------------


@pytest.mark.parametrize(
    "values, pattern", [("number", r"\d{7}"), ("code", r"\d{4}-[a-z]+"), ("name", r"[A-Z][a-z]+ [A-Z][a-z]+")]
)
def test_value_shapes(values, pattern):
    for item in synthetic.niah_multivalue(words, 3, 0, 300, haystack="prose", values=values):
        assert len(item.answers) == 4 and len(set(item.answers)) == 4
        assert all(re.fullmatch(pattern, v) for v in item.answers)
        assert item.question.startswith(f"What are all the special magic {values}s for ")


def test_names_do_not_occur_in_the_prose():
    text = PROSE.read_text(encoding="utf-8")
    for item in synthetic.niah_single(words, 40, 0, 100, values="name"):
        for part in item.answers[0].split():
            assert not re.search(rf"\b{part}\b", text)


@pytest.mark.parametrize(
    "answer, gold, right",
    [
        # number: whole words only, as before.
        ("The special magic number for amber-anchor is 4821937.", "4821937", True),
        ("The special magic number for amber-anchor is 48219370.", "4821937", False),
        # code: punctuation is dropped on both sides, so the hyphen may change but not go.
        ("The special magic code for amber-anchor is 4821-violet.", "4821-violet", True),
        ("It is: 4821-VIOLET", "4821-violet", True),
        ("It is 4821-violets", "4821-violet", False),
        ("It is 4812-violet", "4821-violet", False),
        ("It is 4821 violet", "4821-violet", False),  # two words do not match the one code
        # name: both parts, in order, any case.
        ("The special magic name for amber-anchor is Amara Lindqvist.", "Amara Lindqvist", True),
        ("it is amara lindqvist", "Amara Lindqvist", True),
        ("It is Amara.", "Amara Lindqvist", False),
        ("It is Lindqvist Amara.", "Amara Lindqvist", False),
    ],
)
def test_value_shapes_score_with_the_contains_scorer(answer, gold, right):
    assert contains_match(answer, gold) is right


# --- the registry and the CLI --------------------------------------------------


def test_tasks_without_needles_refuse_the_needle_options():
    lm = SimpleNamespace(tokenizer=None)  # refused before any token is counted
    with pytest.raises(TaskError, match="no haystack"):
        build_items("variable_tracking", lm, 1, haystack="prose")
    with pytest.raises(TaskError, match="no haystack"):
        build_items("examples", lm, 1, values="name")


def test_unknown_haystack_or_shape_is_refused():
    with pytest.raises(TaskError, match="haystack"):
        synthetic.niah_single(words, 1, 0, 200, haystack="essay")
    with pytest.raises(TaskError, match="shape"):
        synthetic.niah_single(words, 1, 0, 200, values="colour")


def test_bench_parses_the_needle_options():
    import argparse

    from kvlab.bench_command import add_parser

    sub = argparse.ArgumentParser().add_subparsers()
    p = add_parser(sub)
    args = p.parse_args(["--haystack", "prose", "--needle-values", "code", "--out", "x"])
    assert (args.haystack, args.needle_values) == ("prose", "code")
    defaults = p.parse_args([])
    assert (defaults.haystack, defaults.needle_values) == ("noise", "number")
    with pytest.raises(SystemExit):
        p.parse_args(["--haystack", "essay"])


def test_bench_runs_prose_items_under_their_own_task_name(tiny, monkeypatch, tmp_path):
    """End to end on the tiny model: the labelled task keeps prose results apart from noise ones."""
    from kvlab.cli import main
    from kvlab.tasks.store import read_results

    monkeypatch.setattr("kvlab.models.get_model", lambda spec=None: tiny)
    out = tmp_path / "run"
    assert (
        main(
            [
                "bench",
                "--tasks",
                "niah_single",
                "--haystack",
                "prose",
                "--needle-values",
                "code",
                "--methods",
                "snapkv",
                "--ratios",
                "2",
                "--limit",
                "1",
                "--length",
                "150",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    results = read_results(out)
    assert {r.task for r in results} == {"niah_single[prose,code]"}
    assert {r.method for r in results} == {"full", "no_context", "snapkv"}
