"""The run spec (kvlab.lab.spec): one run, checked once, and everything it is known by made from it.

A spec round-trips through a link, the command line and a workshop sheet to the same spec and the
same result-store key; spellings of the same run (a preset, its knobs given one by one, the page's
JSON, the command line's text) are the same spec; a change of any input is another key.
"""

from __future__ import annotations

import dataclasses
from urllib.parse import parse_qsl

import pytest

from kvlab import lab
from kvlab.catalog import method_names, method_spec, options_from
from kvlab.cli import build_parser, spec_from_args
from kvlab.compression.request import MAX_RATIO, MIN_RATIO
from kvlab.examples import load_examples
from kvlab.lab.links import LinkChoices, link_query, link_spec, parse_link, spec_link
from kvlab.lab.warm import item_key, parse_sheet
from kvlab.methods import MethodError
from kvlab.methods.families.am_recipe import PRESETS

STORY = next(e for e in load_examples() if e.id == "story")
CHOICES = LinkChoices(
    examples=tuple(e.id for e in load_examples()),
    methods=tuple(method_names()),
    ratio_range=(MIN_RATIO, MAX_RATIO),
    sweep_ratios=(),
    sweep_range=(MIN_RATIO, MAX_RATIO),
    generate_methods=(),
)
KNOBS = {"budgets": "uniform", "max_queries": 4096, "on_policy": True}


def spec_of(**knobs) -> lab.RunSpec:
    return lab.run_spec(STORY.text(), None, "attention_matching", 7.5, "Who was the ferryman?", 32, knobs)


def test_a_spec_round_trips_through_a_link():
    spec = spec_of(**KNOBS)
    query = link_query(spec_link(spec, STORY.id))
    link = parse_link(dict(parse_qsl(query.removeprefix("?"))), CHOICES)
    assert link.notes == ()
    # An Explore link carries no answer length: the page's default.
    back = link_spec(link, STORY.text(), STORY.questions[0])
    assert back == lab.run_spec(STORY.text(), None, "attention_matching", 7.5, "Who was the ferryman?", options=KNOBS)
    assert back.key() != spec.key()  # the answer length is part of the key
    assert back.key() == dataclasses.replace(spec, max_new_tokens=back.max_new_tokens).key()


def test_a_spec_round_trips_through_the_command_line(tmp_path):
    doc = tmp_path / "story.txt"
    doc.write_text(STORY.text(), encoding="utf-8")
    spec = spec_of(**KNOBS)
    args = build_parser().parse_args(spec.cli_args(str(doc)))
    back = spec_from_args(args)
    assert back == spec and back.key() == spec.key()


def test_a_sheet_line_is_the_spec_the_page_runs():
    """``kvlab warm`` stores what the page's Run looks up: a sheet's line, plain or as a link, has the key
    of the spec the page makes from the same inputs."""
    spec = lab.run_spec(STORY.text(), None, "snapkv", 10, STORY.questions[0], options={"window": 8})
    plain = parse_sheet("snapkv:window=8 10 story")
    linked = parse_sheet(link_query(spec_link(spec, STORY.id)))
    assert item_key(plain[0]) == item_key(linked[0]) == spec.key()


def test_spellings_of_one_run_are_one_spec():
    preset = "AM-HighestAttnKeys-ss-plus-repeat"
    by_knobs = spec_of(**PRESETS[preset])
    by_page = spec_of(
        **options_from(
            "attention_matching",
            '{"on_policy": true, "self_study_weight": 1, '
            '"max_queries": 50000, "key_selection": "highest_attn", "scoring": "rms", '
            '"nnls_iters": 2}',
        )
    )
    by_text = spec_of(**options_from("attention_matching", "on_policy=true:self_study_weight=1:max_queries=50000"))
    defaults = spec_of(key_selection="highest_attn", nnls_iters=2)  # every knob at its default
    assert by_knobs == by_page == by_text
    assert defaults == spec_of() and defaults.knobs == ()
    assert dict(by_knobs.knobs) == {"self_study_weight": 1.0, "max_queries": 50000, "on_policy": True}
    assert method_spec(by_knobs.method_text()) == ("attention_matching", by_knobs.knobs)
    assert lab.run_spec(STORY.text(), None, "attention_matching", 7.5, " Who was the ferryman? ", 32) == spec_of()


@pytest.mark.parametrize(
    "change",
    [
        {"ratio": 8},
        {"question": "Who rowed?"},
        {"max_new_tokens": 33},
        {"text": STORY.text() + " Fin."},
        {"options": {"budgets": "uniform"}},
        {"method": "snapkv", "options": {}},
    ],
)
def test_every_input_is_part_of_the_key(change):
    args = {
        "text": STORY.text(),
        "file": None,
        "method": "attention_matching",
        "ratio": 7.5,
        "question": "Who was the ferryman?",
        "max_new_tokens": 32,
        "options": {},
    }
    assert lab.run_spec(**{**args, **change}).key() != lab.run_spec(**args).key()


def test_a_spec_is_checked_once_when_made():
    with pytest.raises(MethodError, match="budgets"):
        spec_of(budgets="sideways")
    with pytest.raises(lab.InputError):
        lab.run_spec(STORY.text(), None, "snapkv", 0.5, "Who?")
    with pytest.raises(lab.InputError):
        lab.run_spec(STORY.text(), None, "snapkv", 5, "   ")
