"""Links to a configuration (kvlab.lab.links) and what the page makes of them (kvlab.ui.page_links): the Your pick
tab, Explore's method knobs, and the round trip through "Link to this"."""

from __future__ import annotations

import dataclasses
import json
from urllib.parse import parse_qsl

import gradio as gr
import pytest

from kvlab.catalog import knobs
from kvlab.lab import links
from kvlab.methods import REGISTRY
from kvlab.ui import page_links
from kvlab.ui.knobs import build_panel, link_panel

CHOICES = links.LinkChoices(
    examples=("story", "contract"),
    methods=tuple(sorted(REGISTRY)),
    ratio_range=(1.0, 20.0),
    sweep_ratios=(2.0, 5.0, 10.0),
    sweep_range=(1.0, 50.0),
    generate_methods=("h2o", "streaming_llm"),
)


def parse(query: str) -> links.Link:
    return links.parse_link(dict(parse_qsl(query.lstrip("?"))), CHOICES)


def test_a_pick_link_reads_the_example_question_and_ratio():
    link = parse("?tab=pick&example=story&ratio=10&question=Who+was+the+ferryman%3F")
    assert (link.tab, link.example, link.ratio, link.question, link.notes) == (
        "pick",
        "story",
        10.0,
        "Who was the ferryman?",
        (),
    )
    assert parse("?tab=pick&ratio=500").ratio is None  # Explore's range: one note, the default kept
    assert "is not a number from 1 to 20" in parse("?tab=pick&ratio=500").note()


def test_a_pick_link_to_an_example_the_pick_tab_does_not_list_is_refused_with_a_note():
    # A long example (read by its own model) is on Explore's menu, not on Your pick's: a pick link naming it
    # leaves Your pick's menu as it is (an id it does not list would blank it) and says why.
    choices = dataclasses.replace(CHOICES, examples=("story", "time_machine"), pick_examples=("story",))
    link = links.parse_link({"tab": "pick", "example": "time_machine"}, choices)
    assert link.example is None and "not offered on this tab (one of story)" in link.note()
    assert links.parse_link({"example": "time_machine"}, choices).example == "time_machine"  # Explore lists it
    assert links.parse_link({"tab": "pick", "example": "story"}, choices).example == "story"


def test_an_explore_link_carries_its_methods_knobs_checked_as_the_method_checks_them():
    link = parse("?tab=explore&example=story&method=attention_matching:budgets=uniform:self_study_weight=4&ratio=5")
    assert link.method == "attention_matching" and dict(link.options) == {"budgets": "uniform", "self_study_weight": 4}
    assert not link.notes
    for bad, says in [
        ("attention_matching:budgets=sideways", "budgets must be"),  # not a choice
        ("snapkv:wndow=8", "not knob=value"),  # not a knob of the method
        ("snapkv:window_size=-3", "window_size"),  # a value the method's Options refuse
    ]:
        refused = parse(f"?tab=explore&method={bad}&ratio=5")
        assert refused.method == bad.split(":")[0] and refused.options == ()
        assert says in refused.note() and "defaults are used" in refused.note()


def test_link_to_this_gives_the_knobs_and_the_pick_back():
    for query in (
        "?tab=explore&example=story&method=attention_matching:budgets=uniform&ratio=5",
        "?tab=pick&example=contract&question=Who+signed%3F&ratio=8",
    ):
        link = parse(query)
        assert parse(links.link_query(link)) == link


@pytest.fixture(scope="module")
def story():
    from kvlab.lab import examples

    ex = next(e for e in examples() if e.id == "story")
    return ex, ex.text()


@pytest.fixture(scope="module")
def panel():
    """Explore's knob panel as the page builds it."""
    with gr.Blocks():
        return build_panel(sorted(REGISTRY), "snapkv", gr.Markdown())


def updates(link: links.Link, story, panel=None) -> dict[str, object]:
    """What the page's load sets, by the names of wire_links's outputs (gr.update() left out); with ``panel``,
    each knob the panel then shows by its name, and the panel's hidden box as ``knobs``."""
    names = [
        *("note tabs tab example text suggested question method ratio model".split()),
        *("compare_methods compare_ratios more_ratios compare_models source generate_methods budget".split()),
        *("pick_example pick_text pick_suggested pick_question pick_ratio".split()),
        "link_knobs",
    ]
    ex, doc = story if link.example else (None, None)
    values = page_links.link_updates(link, ex, doc, CHOICES)
    assert len(values) == len(names)
    got = {n: v for n, v in zip(names, values) if not (isinstance(v, dict) and v == gr.update())}
    chosen = got.pop("link_knobs", None)
    if chosen and panel is not None:  # as the hidden box's change sets the panel (kvlab.ui.knobs.link_panel)
        info, _preset, _wrappers, *slots, box = link_panel(panel, chosen)
        assert info.startswith(("Query", "**Query")), info
        got.update({slot["label"]: slot["value"] for slot in slots if slot.get("visible")})
        got["knobs"] = box
    return got


def test_a_link_to_the_first_tab_or_none_leaves_the_tab_a_visitor_clicked_while_loading(story):
    """The page opens on Explore; the load answering with Explore selected again would switch a visitor
    who clicked another tab meanwhile back (a browser test once failed so)."""
    for query in ("", "?tab=explore&example=story", "?tab=nowhere"):
        got = updates(parse(query), story)
        assert "tabs" not in got and "tab" not in got, query
    assert updates(parse("?tab=compare"), story)["tabs"].selected == "compare"


def test_the_page_opens_a_pick_link_on_the_pick_tab_with_its_document_question_and_ratio(story):
    got = updates(parse("?tab=pick&example=story&ratio=10&question=Who+was+the+ferryman%3F"), story)
    assert got["tab"] == "pick" and got["tabs"].selected == "pick"
    assert (got["pick_example"], got["pick_text"], got["pick_question"], got["pick_ratio"]) == (
        "story",
        story[1],
        "Who was the ferryman?",
        10.0,
    )
    assert "ratio" not in got  # Explore's own ratio stays as it was


def test_the_page_sets_an_explore_links_knobs_and_only_those(story, panel):
    got = updates(parse("?tab=explore&example=story&method=attention_matching:budgets=uniform&ratio=5"), story, panel)
    assert (got["method"], got["ratio"]) == ("attention_matching", 5.0)
    # The panel shows the method's knobs (and no other), the link's at its value, the others at their defaults.
    defaults = {k.name: k.default for k in knobs("attention_matching")}
    assert {name: got[name] for name in defaults} == {**defaults, "budgets": "uniform"}
    assert json.loads(got["knobs"]) == {"budgets": "uniform"}  # what Run then sends
    assert "pick_ratio" not in got
