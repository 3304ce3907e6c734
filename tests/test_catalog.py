"""kvlab.catalog and option validation: knobs reflected from the Options
dataclasses, bad values refused in one line (library and CLI), the published
Attention Matching presets, and the methods' own Learn text."""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from pathlib import Path

import pytest
import torch

from conftest import method_sections
from kvlab import catalog
from kvlab.cli import build_parser, main
from kvlab.compression.interface import FAMILIES
from kvlab.compression.selection import SelectionOptions
from kvlab.methods import REGISTRY, MethodError, get_method

SELECTION_FIELDS = {f.name for f in dataclasses.fields(SelectionOptions)}

# (method, options, what the message must name): each value is outside what the method can do.
BAD = [
    ("snapkv", {"kernel": 4}, "kernel"),  # even: pooling would shift the scores by one token
    ("pyramidkv", {"kernel": 2}, "kernel"),
    ("snapkv", {"window": -1}, "window"),
    ("snapkv", {"window": 0}, "window"),
    ("attention_matching", {"max_queries": 0}, "max_queries"),
    ("attention_matching", {"query_source": "bogus"}, "query_source"),
    ("attention_matching", {"key_selection": "OMP"}, "key_selection"),
    ("attention_matching", {"keys_per_iter": 0}, "keys_per_iter"),
    ("attention_matching", {"ridge": -1.0}, "ridge"),
    ("attention_matching", {"drop_below": math.nan}, "drop_below"),
    ("attention_matching", {"on_policy": "yes"}, "on_policy"),
    ("attention_matching", {"max_queries": 2.5}, "max_queries"),
    ("attention_topk", {"scoring": "median"}, "scoring"),
    ("summary_am", {"summary_tokens": 0}, "summary_tokens"),
    ("h2o", {"recent_share": 1.5}, "recent_share"),
    ("pyramidkv", {"beta": 0.5}, "beta"),
    ("expected_attention", {"n_future_positions": 0}, "n_future_positions"),
    ("expected_attention", {"epsilon": -0.1}, "epsilon"),
    ("kvzip", {"prune": "none"}, "prune"),
    ("kvzip", {"instruction": "  "}, "instruction"),
    ("streaming_llm", {"n_sink": -1}, "n_sink"),
    ("random", {"seed": -1}, "seed"),
    ("summarisation", {"max_tokens": 0}, "max_tokens"),
    ("summarisation", {"prompt": "Summarise in {n} words"}, "prompt"),
]


@pytest.mark.parametrize(("name", "options", "field"), BAD)
def test_bad_option_values_are_refused_in_one_line(name, options, field):
    with pytest.raises(MethodError) as info:
        get_method(name, **options)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{name}: {field} must be ")
    assert repr(options[field]) in message


# (method, option, the edge of what it allows, the nearest value past it).
EDGES = [
    ("snapkv", "kernel", 1, -1),
    ("snapkv", "window", 1, 0),
    ("h2o", "recent_share", 0.0, -0.01),
    ("h2o", "recent_share", 1, 1.01),
    ("pyramidkv", "beta", 1, 0.99),
    ("attention_matching", "max_queries", 1, 0),
    ("attention_matching", "nnls_iters", 0, -1),
    ("attention_matching", "compaction_chunk", 0, -1),
    ("attention_matching", "drop_below", 0.0, 0.01),
    ("summarisation", "prompt", "Summarise in {words} words", "Summarise in {n} words"),
]


@pytest.mark.parametrize(("name", "field", "edge", "beyond"), EDGES)
def test_the_edges_of_the_allowed_ranges_are_accepted_and_one_step_past_is_not(name, field, edge, beyond):
    assert getattr(get_method(name, **{field: edge}).options, field) == edge
    with pytest.raises(MethodError, match=f"^{name}: {field} must be "):
        get_method(name, **{field: beyond})


def test_odd_kernels_average_each_token_with_its_neighbours(tiny):
    """Pooling with kernel k (odd) replaces each token's score by the sum of the k scores centred
    on it divided by k (SnapKV's avg_pool1d, zero padding counted), over the tokens left of the
    observation window; the window itself scores +inf. The unpooled scores are kernel 1's."""
    from kvlab.context import prepare_context
    from kvlab.methods import Request

    ctx = prepare_context(tiny, " ".join(f"w{i % 60 + 2}" for i in range(40)))
    window = 8
    cut = ctx.doc_len - window  # tokens scored (and pooled) before the window
    raw = get_method("snapkv", kernel=1, window=window).scores(Request(ctx, 4.0))
    for kernel in (3, 7):
        pooled = get_method("snapkv", kernel=kernel, window=window).scores(Request(ctx, 4.0))
        for s1, sk in zip(raw, pooled):
            assert sk.shape == (tiny.n_kv_heads, ctx.doc_len) and torch.isinf(sk[:, cut:]).all()
            for j in range(cut):
                near = s1[:, max(0, j - kernel // 2) : min(cut, j + kernel // 2 + 1)]
                torch.testing.assert_close(sk[:, j], near.sum(dim=1) / kernel)


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--method", "snapkv", "--kernel", "4"], "kernel must be an odd whole number"),
        (["--method", "snapkv", "--window", "-3"], "window must be"),
        (["--method", "attention_matching", "--max-queries", "0"], "max_queries must be"),
        (["--method", "attention_matching", "--query-source", "bogus"], "invalid choice: 'bogus'"),
        (["--method", "attention_matching", "--on-policy", "maybe"], "true or false"),
        (["--method", "attention_matching", "--max-queries", "2.5"], "whole number"),
        (["--method", "attention_matching", "--preset", "AM-Nope"], "invalid choice"),
        (["--method", "snapkv", "--preset", "AM-OMP"], "snapkv has no preset"),
        # One --budgets flag serves Attention Matching's choices and the selection wrappers' (one vocabulary;
        # the old spelling adakv read as document).
        (
            ["--method", "snapkv", "--budgets", "adakv", "--granularity", "chunk"],
            "budgets=document needs granularity=token",
        ),
        (["--method", "knorm", "--budgets", "auto"], "budgets must be one of uniform, profile, document, global"),
    ],
)
def test_cli_refuses_bad_option_values_with_exit_2_and_one_line(tmp_path, capsys, argv, fragment):
    doc = tmp_path / "doc.txt"
    doc.write_text("A short document.")
    code = main(["run", "--doc", str(doc), "--ratio", "4", "--question", "Why?", *argv])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and fragment in err


def _action(parser, flag: str):
    run = parser._subparsers._group_actions[0].choices["run"]
    return next(a for a in run._actions if flag in a.option_strings)


def test_cli_flags_come_from_the_knobs():
    parser = build_parser()
    assert tuple(_action(parser, "--query-source").choices) == ("repeat", "context", "self_study", "random", "question")
    assert tuple(_action(parser, "--prune").choices) == ("global", "layer", "head")
    assert set(_action(parser, "--preset").choices) >= {"AM-HighestAttnKeys", "AM-OMP", "AM-OMP-fast"}
    base = ["run", "--doc", "d", "--method", "m", "--ratio", "2", "--question", "q"]
    args = parser.parse_args(
        base + ["--on-policy", "false", "--max-queries", "64", "--drop-below", "-5", "--key-selection", "omp"]
    )
    assert args.opt_on_policy is False and args.opt_max_queries == 64 and args.opt_drop_below == -5.0
    assert args.opt_key_selection == "omp"
    assert parser.parse_args(base + ["--fill-budget", "TRUE"]).opt_fill_budget is True


def test_knobs_reflect_types_and_choices_and_defaults_read_back():
    # Each knob's kind, choices and default as the app and the CLI see them: a Literal's choices hold its
    # default, a number's or flag's default is of its kind, every knob says what it does.
    for name, knobs in catalog.all_knobs().items():
        for k in knobs:
            if k.choices is not None:
                assert typing.get_origin(k.kind) is typing.Literal and k.default in k.choices, (name, k.name)
            else:
                assert k.kind in (int, float, bool, str), (name, k.name)
                assert isinstance(k.default, k.kind) and (k.kind is not int or not isinstance(k.default, bool))
            assert k.method == name and k.help, (name, k.name)
    every = catalog.all_knobs()
    assert list(every) == sorted(REGISTRY)
    for name, knobs in every.items():
        fields = [f for f in dataclasses.fields(REGISTRY[name].Options) if f.init]
        assert sorted(k.name for k in knobs) == sorted(f.name for f in fields)
        # The method's own knobs first, the selection wrappers' after them.
        shared = [issubclass(REGISTRY[name].Options, SelectionOptions) and k.name in SELECTION_FIELDS for k in knobs]
        assert shared == sorted(shared), name
        assert [k.wrapper for k in knobs] == shared, name
        # A widget or a flag shows a knob's default as text: read back, it is the same setting
        # (right type, inside the knob's range), so an untouched widget changes nothing.
        as_text = {k.name: str(k.default) for k in knobs}
        assert REGISTRY[name].Options(**catalog.options_from(name, as_text)) == REGISTRY[name].Options(), name


def test_knob_conversion_and_options_from():
    max_queries, on_policy = (
        next(k for k in catalog.knobs("attention_matching") if k.name == n) for n in ("max_queries", "on_policy")
    )
    assert max_queries.convert("64") == 64 and max_queries.convert(64.0) == 64 and max_queries.convert(" ") is None
    with pytest.raises(MethodError, match="max_queries must be a whole number"):
        max_queries.convert(2.5)
    assert on_policy.convert("off") is False and on_policy.convert(True) is True
    # The page's JSON by knob name (an emptied widget is the default), the command line's spelling, a dict.
    page = '{"max_queries": 64.0, "on_policy": true, "seed": null, "scoring": ""}'
    for given in (page, "max_queries=64:on_policy=yes:seed=", {"max_queries": "64", "on_policy": "on"}):
        assert catalog.options_from("attention_matching", given) == {"max_queries": 64, "on_policy": True}, given
    for empty in ("", " ", "{}", None, {}):
        assert catalog.options_from("attention_matching", empty) == {}
    for bad, message in (
        ({"query_source": "bogus"}, "query_source must be one of"),
        ('{"window": 3}', "attention_matching has no knob 'window'"),  # another method's knob
        ("window=3", "is not knob=value for one of attention_matching's knobs"),
        ('{"max_queries": 64', "not a JSON object"),
        ("[64]", "not knob=value"),
        ("{64}", "not a JSON object"),
        ([64], "must be a JSON object by knob name"),
    ):
        with pytest.raises(MethodError, match=message):
            catalog.options_from("attention_matching", bad)


# The published configurations as the paper's code names them (see the AM notes):
# HighestAttnKeys: RMS scores, 2 NNLS steps (beta in [-3, 3]); OMP: beta below -7
# dropped, one key per iteration and a refit each time unless "fast" (4 keys, refit
# every 2); the names without "-basic" re-read each layer's queries on-policy.
PUBLISHED = {
    "AM-HighestAttnKeys-basic": {
        "key_selection": "highest_attn",
        "scoring": "rms",
        "nnls_iters": 2,
        "on_policy": False,
    },
    "AM-HighestAttnKeys": {"key_selection": "highest_attn", "scoring": "rms", "nnls_iters": 2, "on_policy": True},
    "AM-OMP-basic": {
        "key_selection": "omp",
        "drop_below": -7.0,
        "keys_per_iter": 1,
        "refit_every": 1,
        "on_policy": False,
    },
    "AM-OMP": {"key_selection": "omp", "drop_below": -7.0, "keys_per_iter": 1, "refit_every": 1, "on_policy": True},
    "AM-OMP-fast": {
        "key_selection": "omp",
        "drop_below": -7.0,
        "keys_per_iter": 4,
        "refit_every": 2,
        "on_policy": True,
    },
    # The headline rows' query configuration "ss-plus-repeat": the repeat and self-study in one pool
    # (no weight per kind), 50,000 queries per KV head, read on-policy.
    "AM-HighestAttnKeys-ss-plus-repeat": {
        "key_selection": "highest_attn",
        "scoring": "rms",
        "nnls_iters": 2,
        "on_policy": True,
        "query_source": "repeat",
        "self_study_weight": 1.0,
        "max_queries": 50000,
    },
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_presets_resolve_to_the_published_configurations(preset):
    assert preset in catalog.presets("attention_matching")
    for name in ("attention_matching", "summary_am"):
        options = get_method(name, preset=preset).options
        for field, value in PUBLISHED[preset].items():
            assert getattr(options, field) == value, (name, field)


def test_defaults_are_the_basic_highest_attn_configuration_and_knobs_override_presets():
    assert (
        get_method("attention_matching").options
        == get_method("attention_matching", preset="AM-HighestAttnKeys-basic").options
    )
    options = get_method("attention_matching", preset="AM-OMP-fast", keys_per_iter=8).options
    assert options.keys_per_iter == 8 and options.refit_every == 2 and options.on_policy is True
    assert catalog.presets("random") == {}  # (scoring methods have the selection presets)
    assert catalog.presets("streaming_llm") == {"paper": {"rerotate": True}}  # its positions within the cache
    with pytest.raises(MethodError, match="no preset"):
        get_method("snapkv", preset="AM-OMP")


def test_cli_preset_with_an_override_reaches_the_method():
    from kvlab.cli import method_from_args

    args = build_parser().parse_args(
        [
            "run",
            "--doc",
            "d",
            "--method",
            "attention_matching",
            "--ratio",
            "2",
            "--question",
            "q",
            "--preset",
            "AM-OMP",
            "--refit-every",
            "3",
        ]
    )
    options = method_from_args("attention_matching", args).options
    assert (options.key_selection, options.keys_per_iter, options.refit_every, options.on_policy) == ("omp", 1, 3, True)


def test_methods_long_prints_every_learn_text_and_knob_table(capsys):
    assert main(["methods", "--long"]) == 0
    out = capsys.readouterr().out
    sections = method_sections(out)
    assert sorted(sections) == sorted(REGISTRY)
    for name, cls in REGISTRY.items():
        family, section = sections[name]  # each method's own section, under its family
        assert family == cls.family.capitalize() and cls.summary in section and cls.learn in section, name
        for f in dataclasses.fields(cls.Options):
            # The row shows the dataclass's own default, in this method's section.
            assert re.search(rf"\| `{f.name}` \| `{re.escape(repr(f.default))}` \|", section), (name, f.name)
    for preset in PUBLISHED:
        assert f"`{preset}`" in out
    # A "|" in a help text is escaped, so every table row keeps its four cells.
    rows = [line for line in out.splitlines() if line.startswith("| `")]
    assert rows and all(len(re.split(r"(?<!\\)\|", row)) == 6 for row in rows)


def test_methods_lists_one_line_each_with_the_shared_tag(capsys):
    assert main(["methods"]) == 0
    *lines, blank, wrappers = capsys.readouterr().out.splitlines()
    assert len(lines) == len(REGISTRY) and not blank
    # The last line names the wrappers' presets: each one a preset every scoring method takes.
    named = re.search(r"\(([^)]*)\)", wrappers).group(1).split(", ")
    assert "key_rerotation" in named and "adakv" in named
    for preset in named:
        assert get_method("snapkv", preset=preset).options != get_method("snapkv").options
    by_name = {line.split()[0]: line for line in lines}
    assert by_name["snapkv_question"].endswith("[query-aware]")
    assert by_name["attention_matching"].endswith("[query-aware with query_source=question]")
    assert "[query-aware" not in by_name["snapkv"]
    for name in REGISTRY:
        tag = catalog.aware_tag(name)
        assert by_name[name].endswith(REGISTRY[name].summary + tag)
        assert catalog.method_label(name).endswith(tag)
    assert {catalog.query_awareness(n) for n in ("snapkv", "snapkv_question", "attention_matching")} == {
        "no",
        "yes",
        "options",
    }
    assert "Query-agnostic" in catalog.method_info("snapkv") and "**Query-aware**" in catalog.method_info(
        "snapkv_question"
    )
    assert "query_source=question" in catalog.method_info("attention_matching")


OWN_LEARN = sorted(set(REGISTRY) - {"beaconkv", "beaconkv_mixed", "kivi"})  # those move with their own module


@pytest.mark.parametrize("name", OWN_LEARN)
def test_every_method_has_a_learn_text_and_no_default_in_its_prose(name):
    cls = REGISTRY[name]
    assert cls.learn.strip()
    for f in dataclasses.fields(cls.Options):
        value = f.default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value in (0, 1):
            continue
        pattern = rf"(?<![\w.-]){re.escape(f'{value:g}')}(?![\w.])"
        assert not re.search(pattern, cls.summary), (f.name, cls.summary)
        assert not re.search(pattern, cls.learn), (f.name, value)


def test_docs_methods_table_is_the_catalogs():
    """docs/methods.md holds methods_table() between its markers (regenerate: python -c "from pathlib import
    Path; import kvlab.methods; from kvlab.catalog import with_methods_table as w;
    p = Path('docs/methods.md'); p.write_text(w(p.read_text()))")."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "methods.md").read_text(encoding="utf-8")
    assert doc == catalog.with_methods_table(doc), "docs/methods.md's methods table is stale: see this test's docstring"


def test_the_methods_table_groups_every_method_under_its_family():
    table = catalog.methods_table()
    sections = re.split(r"^\*\*(\w[\w ]*)\*\*: ", table, flags=re.M)[1:]
    by_family = dict(zip(sections[::2], sections[1::2]))
    assert list(by_family) == [f.capitalize() for f in FAMILIES]
    for name, cls in REGISTRY.items():
        rows = [f for f, text in by_family.items() if re.search(rf"^\| `{name}`", text, flags=re.M)]
        assert rows == [cls.family.capitalize()], name
        assert catalog.source_cell(cls.paper) in by_family[rows[0]]


def test_unknown_methods_are_refused_everywhere():
    for call in (catalog.knobs, catalog.presets, catalog.method_markdown, catalog.method_label):
        with pytest.raises(MethodError, match="unknown method 'nope'"):
            call("nope")


def test_the_front_ends_door_names_every_method_and_which_prepare_ahead():
    """The UI reads the methods through the catalog: every registered one, sorted; KVzip's reconstruction pass
    and Attention Matching's repeat pass are document-only work done ahead, StreamingLLM has none."""
    assert catalog.method_names() == sorted(REGISTRY) and len(catalog.method_names()) == len(set(REGISTRY))
    assert catalog.prepares("kvzip") and catalog.prepares("attention_matching")
    assert not catalog.prepares("streaming_llm")
