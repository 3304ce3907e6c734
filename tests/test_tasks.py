"""Tasks with known answers: scoring, generators, runner, resume, shards, report."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from kvlab.cli import main
from kvlab.context import prepare_context
from kvlab.methods import Request, get_method
from kvlab.prompts import context_tokens
from kvlab.tasks import datasets, synthetic, task_registry
from kvlab.tasks.items import TaskError, TaskItem, token_counter
from kvlab.tasks.marking import contains_match, exact_match, normalize_answer, token_f1
from kvlab.tasks.report import needle_heatmap, table_markdown
from kvlab.tasks.runner import (
    FLOOR,
    FULL,
    MethodSpec,
    SummaryRow,
    TaskResult,
    answer_item,
    item_prompt_ids,
    run_items,
    summarise,
    wilson_interval,
)
from kvlab.tasks.store import ResultWriter, Shard, read_results
from kvlab.tasks.task_registry import build_items

# --- scoring, against hand-worked SQuAD-style cases -------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The Eiffel Tower!", "eiffel tower"),
        ("  An   apple, a day ", "apple day"),
        ("Theatre", "theatre"),  # "the" inside a word stays
        ("U.S.A.", "usa"),
        ("\u2018A glass of champagne.\u2019", "glass of champagne"),  # a book's curly quotes, copied
        ("\u201cDrink me,\u201d \u00abshe\u00bb said", "drink me she said"),
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


# --- generators ---------------------------------------------------------------

LENGTH = 150  # tokens of the tiny word-level tokenizer: one per whitespace-separated word


def words(text: str) -> int:
    """An independent token count for the tiny tokenizer: it splits on whitespace only."""
    return len(text.split())


def noise_lines(doc: str) -> list[str]:
    """The lines after the preamble."""
    return doc.split("\n")[1:-1]


@pytest.mark.parametrize("depth", synthetic.GRID_DEPTHS)
def test_needle_sits_at_its_depth(depth):
    item = synthetic.niah_single(words, 1, seed=3, length=LENGTH, depths=[depth])[0]
    lines = noise_lines(item.document)
    needle = [i for i, line in enumerate(lines) if "magic number" in line]
    n_noise = sum(line == synthetic.NOISE for line in lines)
    assert len(needle) == 1 and n_noise == len(lines) - 1
    # the needle has round(depth * n) noise lines before it
    assert needle[0] == round(depth * n_noise)
    assert item.depth == depth


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey", "needle_grid"])
def test_answer_is_recoverable_from_the_text(task, tiny):
    for item in build_items(task, tiny, 4, seed=1, length=LENGTH):
        key = re.search(r"number for (\S+) in the text", item.question).group(1)
        found = re.findall(rf"number for {re.escape(key)} is: (\d+)\.", item.document)
        assert found == list(item.answers)
        assert re.fullmatch(r"\d{7}", item.answers[0])


def test_multikey_has_distractor_keys():
    item = synthetic.niah_multikey(words, 1, seed=0, length=LENGTH)[0]
    keys = re.findall(r"number for (\S+) is: \d+\.", item.document)
    assert len(keys) == len(set(keys)) == 4


def test_multivalue_needles_all_in_text():
    item = synthetic.niah_multivalue(words, 1, seed=0, length=LENGTH)[0]
    key = re.search(r"numbers for (\S+) in the text", item.question).group(1)
    assert re.findall(rf"numbers for {re.escape(key)} is: (\d+)\.", item.document) == sorted(
        item.answers, key=item.document.index
    )
    assert len(set(item.answers)) == 4 and item.scoring == "all"


def resolve_chains(document: str) -> dict[str, str]:
    """Independent resolution of VAR assignments: each variable's final value."""
    env: dict[str, str] = {}
    for name, rhs in re.findall(r"^VAR (\w+) = (.+?)\s*$", document, flags=re.M):
        ref = re.fullmatch(r"VAR (\w+)", rhs)
        env[name] = env[ref.group(1)] if ref else rhs
    return env


def test_variable_tracking_chain_resolves():
    for item in synthetic.variable_tracking(words, 3, seed=5, length=LENGTH):
        value = re.search(r"value (\d+) in the text", item.question).group(1)
        env = resolve_chains(item.document)
        assert sorted(k for k, v in env.items() if v == value) == sorted(item.answers)
        assert len(item.answers) == 5


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey", "niah_multivalue", "variable_tracking"])
def test_lengths_fit_and_seeds_reproduce(task, tiny):
    count = token_counter(tiny.tokenizer)
    a = build_items(task, tiny, 3, seed=7, length=LENGTH)
    b = build_items(task, tiny, 3, seed=7, length=LENGTH)
    c = build_items(task, tiny, 3, seed=8, length=LENGTH)
    assert a == b and a != c
    assert len({it.item_id for it in a}) == 3
    for item in a:
        n = count(item.document)
        assert n <= LENGTH and words(item.document) == n
        # the filler is as long as fits: one more noise line would not
        assert n + words(synthetic.NOISE) > LENGTH


def test_needle_items_on_a_user_document():
    text = "First sentence here. Second one! A third? The fourth and last."
    items = synthetic.needle_items(text, [0.0, 0.5, 1.0], seed=2)
    assert [it.depth for it in items] == [0.0, 0.5, 1.0]
    for item in items:
        needle = re.search(r"The special magic number for \S+ is: \d+\.", item.document)
        assert needle.group(0).endswith(item.answers[0] + ".")
        # removing the needle gives the document back, and it sits between sentences
        rest = (item.document[: needle.start()] + item.document[needle.end() :]).replace("  ", " ").strip()
        assert rest == text
    starts = [it.document.index("The special magic") for it in items]
    assert starts[0] == 0 and starts[1] == text.index("A third") and starts[2] > len(text) - 2
    with pytest.raises(TaskError):
        synthetic.needle_items(" ", [0.5])
    with pytest.raises(TaskError):
        synthetic.needle_items(text, [1.5])


def test_unknown_task_and_tiny_length(tiny):
    with pytest.raises(TaskError, match="unknown task"):
        build_items("nope", tiny, 1)
    with pytest.raises(TaskError, match="too short"):
        build_items("niah_single", tiny, 1, length=20)


def test_shared_data_missing_is_one_clear_line(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLAB_DATA", str(tmp_path))
    with pytest.raises(TaskError, match="KVLAB_DATA"):
        datasets.quality(5, 0)


def test_hotpot_document_holds_every_paragraph_shuffled_by_seed():
    entry = {
        "_id": "x",
        "title_a": "A",
        "para_a": ["Alpha one.", " Alpha two."],
        "title_b": "B",
        "para_b": ["Beta."],
        "distractors": [["C", ["Gamma."], 1.0], ["D", ["Delta."], 2.0]],
        "question": "q",
        "answer": "a",
    }
    doc = datasets.hotpot_document(entry, 0)
    assert sorted(doc.split("\n\n")) == ["A\nAlpha one. Alpha two.", "B\nBeta.", "C\nGamma.", "D\nDelta."]
    assert doc == datasets.hotpot_document(entry, 0)
    assert len({datasets.hotpot_document(entry, s) for s in range(10)}) > 1


# --- scoring on a model --------------------------------------------------------


def choice_item() -> TaskItem:
    return TaskItem(
        "mc",
        "mc-0",
        " ".join(f"w{i % 40 + 2}" for i in range(60)),
        question="w3 w4 w5",
        answers=("w9 w10 w11",),
        scoring="choice",
        choices=("w7", "w8 w20", "w9 w10 w11", "w12 w13"),
        gold_index=2,
    )


def test_choice_loglikelihood_matches_eager(tiny, tiny_eager):
    item = choice_item()
    from kvlab.context import prepare_context

    ctx = prepare_context(tiny, item.document)
    out = answer_item(tiny, ctx.full.stored, item, item_prompt_ids(tiny, item))
    # Eager reference: the whole sequence in one plain forward pass, no cache.
    tok = tiny_eager.tokenizer
    base = torch.cat([context_tokens(tok, item.document).ids, item_prompt_ids(tiny_eager, item)])
    ref = []
    for option in item.choices:
        cont = torch.tensor(tok(" " + option, add_special_tokens=False).input_ids)
        ids = torch.cat([base, cont])
        with torch.no_grad():
            logp = torch.log_softmax(tiny_eager.model(ids.unsqueeze(0)).logits[0].float(), -1)
        ref.append(float(logp[len(base) - 1 : -1].gather(1, cont.unsqueeze(1)).sum()))
    best = max(range(4), key=ref.__getitem__)
    assert out.choice == best and out.answer == item.choices[best]
    assert out.gold_logprob == pytest.approx(ref[2], abs=1e-3)  # fp32, two attention paths
    per_byte = [lp / len(o) for lp, o in zip(ref, item.choices)]
    assert out.correct_norm == (max(range(4), key=per_byte.__getitem__) == 2)
    assert out.score == float(best == 2)


# --- runner, resume, shards, report ----------------------------------------------

METHODS = [MethodSpec("snapkv"), MethodSpec("streaming_llm")]
RATIOS = [2.0, 4.0]


def short(items: list[TaskItem]) -> list[TaskItem]:
    """Items with 4-token answers: the random tiny model never stops by itself, and CPUs are shared."""
    return [dataclasses.replace(it, max_new_tokens=4) for it in items]


def tiny_items(tiny):
    return short(
        build_items("needle_grid", tiny, 2, seed=0, length=LENGTH)
        + build_items("niah_multivalue", tiny, 1, seed=0, length=LENGTH)
    )


def expected_keys(tiny, items) -> set[str]:
    from kvlab.tasks.runner import result_key

    keys = set()
    for it in items:
        keys.add(result_key(tiny.name, it.task, it.item_id, FULL, "", None))
        keys.add(result_key(tiny.name, it.task, it.item_id, FLOOR, "", None))
        for m in METHODS:
            for r in RATIOS:
                keys.add(result_key(tiny.name, it.task, it.item_id, m.name, "", r))
    return keys


def test_run_items_covers_every_key_and_scores_against_full(tiny):
    items = tiny_items(tiny)
    fractions = []
    results = run_items(tiny, items, METHODS, RATIOS, progress=lambda f, d: fractions.append(f))
    assert {r.key for r in results} == expected_keys(tiny, items)
    assert len(results) == len(items) * (2 + len(METHODS) * len(RATIOS))
    assert fractions[-1] == pytest.approx(1.0) and fractions == sorted(fractions)
    by_item = {}
    for r in results:
        by_item.setdefault(r.item_id, {})[(r.method, r.ratio)] = r
    for item in items:
        rs = by_item[item.item_id]
        full = rs[(FULL, None)]
        assert full.agrees_full and full.answer == full.answer_full
        for r in rs.values():
            assert r.answer_full == full.answer
            assert r.agrees_full == (normalize_answer(r.answer) == normalize_answer(full.answer))
            assert r.correct == (r.score == 1.0)
            assert r.depth == item.depth
    rows = summarise(results)
    assert {(r.task, r.method) for r in rows if r.ratio is None} == {
        (t, m) for t in ("needle_grid", "niah_multivalue") for m in (FULL, FLOOR)
    }
    # hand check of one row: the mean of its items' scores
    row = next(r for r in rows if r.task == "needle_grid" and r.method == "snapkv" and r.ratio == 2.0)
    scores = [r.score for r in results if r.task == "needle_grid" and r.method == "snapkv" and r.ratio == 2.0]
    assert row.n == 2 and row.accuracy == pytest.approx(sum(scores) / 2)


class Stop(Exception):
    pass


def test_resume_after_interruption_gives_the_same_set(tiny, tmp_path):
    items = tiny_items(tiny)
    path = tmp_path / "results.jsonl"
    written = []

    def stop_after_5(result):
        writer.write(result)
        written.append(result)
        if len(written) == 5:
            raise Stop

    with ResultWriter(path) as writer, pytest.raises(Stop):
        run_items(tiny, items, METHODS, RATIOS, on_result=stop_after_5)
    # a line cut short by the interruption is skipped, and the next run starts a fresh line
    with path.open("a") as f:
        f.write('{"task": "niah')
    assert len(read_results(tmp_path)) == 5
    done = {r.key for r in read_results(tmp_path)}
    with ResultWriter(path) as writer:
        new = run_items(tiny, items, METHODS, RATIOS, done=done, on_result=writer.write)
    assert len(new) == len(expected_keys(tiny, items)) - 5
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{") and x.endswith("}")]
    keys = [json.dumps([d["model"], d["task"], d["item_id"], d["method"], d["preset"], d["ratio"]]) for d in lines]
    assert len(keys) == len(set(keys))  # no duplicates
    assert set(keys) == expected_keys(tiny, items)
    # a third run has nothing left to do and prefills nothing
    assert run_items(tiny, items, METHODS, RATIOS, done=set(keys)) == []


def test_shard_parse_and_split():
    assert Shard.parse("2/3").select(list(range(7))) == [1, 4]
    parts = [Shard(k, 3).select(list(range(7))) for k in (1, 2, 3)]
    assert sorted(x for p in parts for x in p) == list(range(7))
    for bad in ("0/3", "4/3", "a/b", "3"):
        with pytest.raises(TaskError):
            Shard.parse(bad)


@pytest.fixture
def tiny_cli(tiny, monkeypatch):
    """The CLI with ``get_model`` answering the tiny model."""
    monkeypatch.setattr("kvlab.models.get_model", lambda spec=None: tiny)
    build = task_registry.build_items
    monkeypatch.setattr(task_registry, "build_items", lambda *a, **k: short(build(*a, **k)))
    return [
        "bench",
        "--tasks",
        "needle_grid,niah_single",
        "--methods",
        "snapkv",
        "--ratios",
        "2,4",
        "--limit",
        "2",
        "--length",
        str(LENGTH),
        "--seed",
        "1",
    ]


def test_shards_merge_to_the_unsharded_run(tiny_cli, tmp_path):
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    assert main(tiny_cli + ["--out", str(whole)]) == 0
    for k in ("1/2", "2/2"):
        assert main(tiny_cli + ["--out", str(sharded), "--shard", k]) == 0
    assert sorted(p.name for p in sharded.glob("*.jsonl")) == ["results-shard1of2.jsonl", "results-shard2of2.jsonl"]
    a, b = read_results(whole), read_results(sharded)
    assert {r.key for r in a} == {r.key for r in b}
    assert len(a) == 4 * (2 + 2)
    # the same items give the same answers, whichever shard ran them
    assert {r.key: r.answer for r in a} == {r.key: r.answer for r in b}


def test_bench_writes_csv_and_html_and_rebuilds_them(tiny_cli, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(tiny_cli + ["--out", str(out)]) == 0
    import csv

    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == len(read_results(out))
    assert {"task", "item_id", "method", "ratio", "score", "agrees_full", "answer"} <= set(rows[0])
    summary = list(csv.DictReader((out / "summary.csv").open()))
    assert {(r["task"], r["method"], r["ratio"]) for r in summary} >= {
        ("needle_grid", "full", ""),
        ("needle_grid", "no_context", ""),
        ("needle_grid", "snapkv", "2.0"),
    }
    page = (out / "report.html").read_text()
    # self-contained: plotly.js itself is in the page, not fetched from a CDN
    assert "Plotly.newPlot" in page and len(page) > 1_000_000 and 'src="https://cdn' not in page
    assert "needles found: snapkv" in page and "needle_grid: accuracy against compression" in page
    assert "<table>" in page
    assert "| snapkv | " in (out / "table.md").read_text()
    # rebuild from the JSONL alone
    for name in ("results.csv", "summary.csv", "report.html", "table.md"):
        (out / name).unlink()
    assert main(["bench", "--report", str(out)]) == 0
    # one heatmap per task with needle depths
    page = (out / "report.html").read_text()
    assert page.count("needles found") == 2
    assert "needles found: snapkv on needle_grid" in page and "needles found: snapkv on niah_single" in page
    assert len(list(csv.DictReader((out / "results.csv").open()))) == len(rows)


def test_bench_knob_overrides_run_the_configured_method(tiny_cli, tiny, tmp_path):
    """``name:knob=value`` runs the method so configured, recorded apart from its defaults."""
    out = tmp_path / "run"
    cli = [a if a != "snapkv" else "snapkv,snapkv:window=2:kernel=1" for a in tiny_cli]
    assert main(cli + ["--out", str(out)]) == 0
    rows = {(r.item_id, r.preset, r.ratio): r for r in read_results(out) if r.method == "snapkv"}
    assert {p for _, p, _ in rows} == {"", "window=2 kernel=1"}
    # Each configured row against the same item answered directly from that configuration.
    method = get_method("snapkv", window=2, kernel=1)
    for item in task_registry.build_items("niah_single", tiny, 2, 1, LENGTH):  # shortened by tiny_cli
        ctx = prepare_context(tiny, item.document)
        stored = method.compress(Request(ctx, 4.0, item.question))
        direct = answer_item(tiny, stored, item, item_prompt_ids(tiny, item))
        assert rows[(item.item_id, "window=2 kernel=1", 4.0)].answer == direct.answer


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--ratios", "0.5"], "ratios"),
        (["--methods", "snapkv:nope=1"], "not knob=value"),
        (["--methods", "snapkv:window"], "not knob=value"),
        (["--methods", "snapkv:window=two"], "window"),
        (["--ratios", "x"], "not a compression ratio"),
        (["--tasks", "nope"], "unknown task"),
        (["--methods", "nope"], "unknown method"),
        (["--limit", "0"], "limit"),
        (["--shard", "3/2"], "shard"),
        (["--preset", "AM-nope"], "preset"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(tiny_cli, tmp_path, capsys, extra, message):
    assert main(tiny_cli + ["--out", str(tmp_path)] + extra) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err


def test_report_of_an_empty_folder_exits_2(tmp_path, capsys):
    assert main(["bench", "--report", str(tmp_path)]) == 2
    assert "no results" in capsys.readouterr().err


# --- the embedded model -----------------------------------------------------------


@pytest.mark.slow  # the embedded model
def test_embedded_full_cache_finds_single_needles(embedded):
    """The ceiling the synthetic tasks are designed for: 3 needles at about 2,000 tokens."""
    items = build_items("niah_single", embedded, 3, seed=0, length=2000)
    results = run_items(embedded, items, [], [2.0])
    full = [r for r in results if r.method == FULL]
    assert all(1900 <= r.doc_tokens <= 2000 for r in full)
    assert [r.correct for r in full] == [True, True, True], [r.answer for r in full]


def test_markdown_table_puts_ceiling_and_floor_in_every_ratio_column():
    def row(method, ratio, accuracy, n=4, note="", exact=None, interval=(0.1, 0.9)):
        return SummaryRow(
            "niah_single",
            method,
            "",
            ratio,
            n,
            accuracy,
            accuracy if exact is None else exact,
            1.0,
            None,
            None,
            None,
            note,
            *interval,
        )

    rows = [row(FULL, None, 1.0), row(FLOOR, None, 0.0), row("kvzip", 2.0, 0.75), row("kvzip", 10.0, 0.5, n=2)]
    assert table_markdown(rows).splitlines() == [
        "**niah_single**",
        "",
        "| method | 2x | 10x |",
        "|---|---|---|",
        "| full | 4/4 [0.10, 0.90] | 4/4 [0.10, 0.90] |",
        "| no_context | 0/4 [0.10, 0.90] | 0/4 [0.10, 0.90] |",
        "| kvzip | 3/4 [0.10, 0.90] | 1/2 [0.10, 0.90] |",
    ]
    # A run of the ceiling and the floor alone (--methods "") has no ratio: one column.
    assert table_markdown(rows[:2]).splitlines()[2:] == [
        "| method | accuracy |",
        "|---|---|",
        "| full | 4/4 [0.10, 0.90] |",
        "| no_context | 0/4 [0.10, 0.90] |",
    ]
    # Partial scores (all values of a multi-value needle) are no count of right items.
    assert "| kvzip | 0.62 (4) [0.10, 0.90] |" in table_markdown([row("kvzip", 2.0, 0.625, exact=0.5)])


@pytest.mark.parametrize(
    "right, n, low, high",
    [
        # Published values of the Wilson score interval at 95 % (e.g. Newcombe 1998, Table I; Brown, Cai and
        # DasGupta 2001): 0/10, 5/10, 10/10, and 81/263 from Newcombe's worked example.
        (0, 10, 0.0, 0.2775),
        (5, 10, 0.2366, 0.7634),
        (10, 10, 0.7225, 1.0),
        (81, 263, 0.2553, 0.3662),
    ],
)
def test_wilson_interval_matches_published_values(right, n, low, high):
    got = wilson_interval(right, n)
    assert got == pytest.approx((low, high), abs=5e-5)


def test_summary_rows_carry_the_wilson_interval_of_their_items():
    results = [
        TaskResult(
            "niah_single",
            f"i{i}",
            "kvzip",
            "",
            2.0,
            "m",
            float(i < 5),
            i < 5,
            i < 5,
            0.0,
            "",
            "",
            True,
            None,
            None,
            None,
            100,
            0.0,
            0.0,
        )
        for i in range(10)
    ]
    row = summarise(results)[0]
    assert (row.n, row.accuracy) == (10, 0.5)
    assert (row.accuracy_low, row.accuracy_high) == pytest.approx((0.2366, 0.7634), abs=5e-5)


def test_needle_heatmap_of_one_task_ignores_the_others_at_the_same_depth():
    def result(task, method, ratio, score):
        return TaskResult(
            task,
            f"{task}-0",
            method,
            "",
            ratio,
            "m",
            score,
            score == 1.0,
            score == 1.0,
            score,
            "a",
            "a",
            True,
            None,
            None,
            0.5,
            100,
            0.0,
            0.0,
        )

    results = [
        result("niah_single", FULL, None, 1.0),
        result("niah_single", "kvzip", 2.0, 1.0),
        result("niah_multikey", FULL, None, 0.0),
        result("niah_multikey", "kvzip", 2.0, 0.0),
    ]
    single = needle_heatmap(results, "kvzip", task="niah_single").data[0]
    assert list(single.x) == ["full", "2x"] and list(single.y) == ["50%"]
    assert single.z == ((1.0, 1.0),) or [list(r) for r in single.z] == [[1.0, 1.0]]
    both = needle_heatmap(results, "kvzip").data[0]
    assert [list(r) for r in both.z] == [[0.5, 0.5]]
