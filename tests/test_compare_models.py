"""The model as an axis of Compare: the same document and question on several models, each with its own
full cache (its ceiling); a link naming them; ``kvlab compare --models``. Two tiny random models saved
to folders, as a user's would be: a Llama and a Gemma 3 with sliding-window layers."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from kvlab import lab, models
from kvlab.cli import main
from kvlab.lab import links
from kvlab.testing.random_models import random_model

DOC = " ".join(f"w{(i * 7) % 60 + 2}" for i in range(72))
QUESTION = "w3 w5 w8"
METHODS, RATIOS = ["streaming_llm", "snapkv"], [2.0, 4.0]


@pytest.fixture(scope="module")
def two_models(tmp_path_factory) -> list[str]:
    """Folders of a tiny Llama and a tiny hybrid Gemma 3 (a 16-token window in its first two layers)."""
    specs = []
    for family, overrides in (("llama", None), ("gemma3", {"sliding_window": 16})):
        lm = random_model(family, overrides)
        folder = tmp_path_factory.mktemp(f"tiny-{family}-")
        lm.model.save_pretrained(folder)
        lm.tokenizer.save_pretrained(folder)
        specs.append(str(folder))
    return specs


def test_a_sweep_over_two_models_measures_each_against_its_own_full_cache(two_models, tmp_path):
    """Model after model, every (method, ratio); each model's ceiling and runs are those of a sweep on it
    alone (nothing of one model reaches the other's), and the exports carry both."""
    sweep = lab.compare(DOC, None, METHODS, RATIOS, QUESTION, max_new_tokens=3, models=two_models)
    alone = [lab.compare(DOC, None, METHODS, RATIOS, QUESTION, max_new_tokens=3, model=spec) for spec in two_models]
    assert [c.spec for c in sweep.ceilings] == two_models
    assert [c.model for c in sweep.ceilings] == [s.model for s in alone] and alone[0].model != alone[1].model
    for ceiling, one in zip(sweep.ceilings, alone):
        assert (ceiling.answer_full, ceiling.logppl_full, ceiling.doc_tokens) == (
            one.answer_full,
            one.logppl_full,
            one.doc_tokens,
        )
    expected = [(s.model, r.method, r.ratio, r.bytes_compressed, r.answer_compressed) for s in alone for r in s.results]
    assert [(r.model, r.method, r.ratio, r.bytes_compressed, r.answer_compressed) for r in sweep.results] == expected
    # Every run is measured against its own model's full cache.
    ceiling_of = {c.model: c for c in sweep.ceilings}
    assert all(r.answer_full == ceiling_of[r.model].answer_full for r in sweep.results)
    csv_path, json_path = lab.write_exports(sweep, tmp_path, stem="two")
    with open(csv_path, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert [(r["model"], r["method"]) for r in rows] == [(m, meth) for m, meth, *_ in expected]
    data = json.loads(open(json_path, encoding="utf-8").read())
    assert [c["model"] for c in data["ceilings"]] == [s.model for s in alone]


def test_models_count_toward_the_sweep_limit_before_any_work(monkeypatch):
    monkeypatch.setattr(models, "get_model", lambda spec=None: pytest.fail("loaded a model"))
    per_model = lab.MAX_SWEEP_POINTS // 2 + 1  # within the limit on one model, over it on two
    with pytest.raises(lab.InputError, match="methods x head budgets x ratios x models"):
        lab.compare(
            DOC, None, ["streaming_llm"], [float(r) for r in range(2, 2 + per_model)], QUESTION, models=["a", "b"]
        )


CHOICES = links.LinkChoices(
    examples=("story",),
    methods=("snapkv", "tova"),
    ratio_range=(1.0, 64.0),
    sweep_ratios=(2.0, 5.0),
    sweep_range=(1.0, 1000.0),
    generate_methods=(),
    models=("embedded", "gemma3-270m"),
)


def test_a_compare_link_names_its_models():
    link = links.parse_link({"tab": "compare", "methods": "snapkv", "models": "gemma3-270m, nope,embedded"}, CHOICES)
    assert link.models == ("gemma3-270m", "embedded")
    assert link.notes == ("model `nope` is not offered here.",)
    again = links.parse_link(dict(p.split("=") for p in links.link_query(link)[1:].split("&")), CHOICES)
    assert again.models == link.models and not again.notes
    # Only Compare reads them: elsewhere the page has one model (``model``).
    assert links.parse_link({"tab": "explore", "models": "embedded"}, CHOICES).models is None


def test_cli_compare_on_two_models(two_models, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(
        [
            "compare",
            "--doc",
            str(write_doc(tmp_path)),
            "--methods",
            "streaming_llm",
            "--ratios",
            "2",
            "--question",
            QUESTION,
            "--max-new-tokens",
            "3",
            "--out",
            str(out),
            "--models",
            ",".join(two_models),
        ]
    )
    assert code == 0
    with open(out / "compare.csv", newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    data = json.loads((out / "compare.json").read_text())
    assert [r["model"] for r in rows] == [c["model"] for c in data["ceilings"]] and len(rows) == 2
    printed = capsys.readouterr().out
    assert all(f"full cache's answer ({c['model']})" in printed for c in data["ceilings"])


@pytest.mark.parametrize(
    "extra, message",
    [(["--model", "embedded", "--models", "embedded"], "not both"), (["--models", " , "], "names no model")],
)
def test_cli_compare_bad_models_exit_2_with_one_line(tmp_path, extra, message, capsys):
    argv = [
        "compare",
        "--doc",
        str(write_doc(tmp_path)),
        "--methods",
        "tova",
        "--ratios",
        "2",
        "--question",
        "q",
        "--out",
        str(tmp_path / "o"),
        *extra,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def write_doc(folder: Path) -> Path:
    doc = folder / "doc.txt"
    doc.write_text(DOC)
    return doc
