"""The Claims section (kvlab.lab.claims): figures and verdicts read from stored runs, never typed in.

- the counting and the interval against hand-worked cases (the Wilson interval of 0/n has the closed
  form z^2 / (n + z^2) at its top);
- each verdict's rule on made-up runs where the answer is known (a claim that holds, one that does not,
  one the model cannot check);
- every claim's link opens its configuration on the page without a note, its command names a kvlab
  entry point;
- the stored file (assets/claims.json) gives every claim a figure, and the figures are the file's own
  rows counted here, item by item.
"""

from __future__ import annotations

from urllib.parse import parse_qsl

import pytest

from kvlab import lab
from kvlab.lab import claims
from kvlab.lab.links import parse_link
from kvlab.ui.page_links import link_choices


def books(model: str, method: str, preset: str, ratio: float | None, right: int, n: int = 24) -> list[dict]:
    return [
        {
            "model": model,
            "method": method,
            "preset": preset,
            "ratio": ratio,
            "item": f"i{i}",
            "correct": i < right,
            "compress_s": 2.0,
        }
        for i in range(n)
    ]


def book_data(recipe_at_50: int) -> dict:
    rows = []
    for model in (claims.SMOL, claims.GEMMA):
        rows += books(model, "full", "", None, 22) + books(model, "no_context", "", None, 0)
        for ratio, right in ((10.0, 21), (20.0, 20), (50.0, recipe_at_50)):
            rows += books(model, "attention_matching", claims.RECIPE, ratio, right)
    return {"books": rows}


def test_a_cell_counts_the_matching_rows_and_bounds_them_by_wilson():
    rows = books(claims.SMOL, "kvzip", "", 10.0, 0) + books(claims.SMOL, "kvzip", "", 20.0, 5)
    zero = claims.cell(rows, method="kvzip", ratio=10.0)
    assert (zero.right, zero.n, zero.seconds) == (0, 24, 2.0)
    z2 = 1.959964**2
    assert zero.text() == f"0/24 [0.00, {z2 / (24 + z2):.2f}]"
    assert claims.cell(rows, method="kvzip", ratio=20.0).right == 5
    with pytest.raises(claims.MissingRuns):
        claims.cell(rows, method="kvzip", ratio=50.0)


def test_fifty_x_holds_only_where_the_recipe_keeps_the_full_caches_needles():
    held = claims.fifty_x(book_data(recipe_at_50=21))
    assert held.verdict.startswith("Holds")
    lost = claims.fifty_x(book_data(recipe_at_50=2))
    assert lost.verdict.startswith("Does not hold") and "up to 20x" in lost.verdict
    assert "2/24" in lost.figure and "full cache 22/24" in lost.figure


def test_six_compactions_cannot_be_checked_when_the_unbounded_model_fails():
    gen = {"task": "t", "steps": 16, "budget": 64}
    fails = {"generation": {**gen, "unbounded": {"right_steps": 3}, "online_am": {"right_steps": 1, "events": 6}}}
    assert claims.six_compactions(fails).verdict.startswith("Cannot be checked")
    keeps = {"generation": {**gen, "unbounded": {"right_steps": 16}, "online_am": {"right_steps": 16, "events": 6}}}
    assert claims.six_compactions(keeps).verdict.startswith("Holds")


def test_a_claim_without_its_runs_says_so():
    got = claims.measure(claims.CLAIMS[0], {"books": []})
    assert got.figure.startswith("not measured here") and got.verdict == "Not checked yet."
    assert claims.measure(claims.CLAIMS[0], None).verdict == "Not checked yet."


def test_every_claims_link_opens_on_the_page_without_a_note_and_every_command_is_kvlabs():
    choices = link_choices(lab.examples(), [spec for _, spec in lab.model_choices()])
    for claim in claims.CLAIMS:
        assert claim.command.split()[0] in ("kvlab", "python"), claim.id
        if claim.link is not None:
            link = parse_link(dict(parse_qsl(claim.link.lstrip("?"))), choices)
            assert link.notes == (), (claim.id, link.notes)


@pytest.fixture(scope="module")
def stored() -> dict:
    data = claims.load()
    assert data is not None, "assets/claims.json is missing: python -m benchmarks.claims --books ..."
    return data


def count(rows: list[dict], mark: str, **match) -> tuple[int, int]:
    """(right, n) of the rows matching every field, counted here."""
    chosen = [r for r in rows if all(r.get(k, object()) == v for k, v in match.items())]
    return sum(1 for r in chosen if r[mark]), len(chosen)


def test_the_stored_file_gives_every_claim_a_figure_and_a_verdict(stored):
    for claim in claims.CLAIMS:
        got = claims.measure(claim, stored)
        assert not got.figure.startswith("not measured"), (claim.id, got.figure)
        assert got.verdict and got.verdict != "Not checked yet."


def test_the_figures_are_the_stored_rows_counted_item_by_item(stored):
    by_id = {c.id: claims.measure(c, stored).figure for c in claims.CLAIMS}
    for claim_id, expected in stored_counts(stored):
        assert expected in by_id[claim_id], (claim_id, expected, by_id[claim_id])


def stored_counts(stored: dict) -> list[tuple[str, str]]:
    """(a claim's id, a count its figure must show), the counts made here from the file's rows (the
    browser test reads them off the page too)."""
    out = []
    for model in (claims.SMOL, claims.GEMMA):
        right, n = count(stored["books"], "correct", model=model, preset=claims.RECIPE, ratio=50.0)
        out.append(("fifty-x", f"{right}/{n} ["))
    for ratio in (5.0, 10.0, 20.0, 50.0):
        right, n = count(stored["books"], "correct", model=claims.SMOL, method="cartridges", ratio=ratio)
        out.append(("seconds-not-hours", f"Cartridges {right}/{n} in"))
    right, _ = count(stored["examples"], "right", example="patient_record", method="summarisation", ratio=10.0)
    out.append(("summaries-fall", f"summarisation {right}/5"))
    right, _ = count(stored["examples"], "right", example="story", method="summary_am", ratio=200.0)
    out.append(("summary-am-200x", f"story: summary + AM at 200x {right}/5"))
    out.append(("six-compactions", f"{stored['generation']['online_am']['events']} compactions"))
    return out
