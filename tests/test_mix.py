"""``mix`` (kvlab/methods/mix.py): each preset corner keeps exactly its method's tokens, the ranks and
the mix worked by hand and by brute force from the other methods' own scores, the refusals, and the
command line on a tiny model folder."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_add_a_method import tiny_folder  # noqa: F401  (a fixture: a 2-layer random Llama saved as a model folder)

from conftest import TINY_DOC
from kvlab import catalog
from kvlab.cli import main
from kvlab.context import prepare_context
from kvlab.methods import MethodError, Request, get_method
from kvlab.methods.mix import mix_ranks, rank_normalise

DOC = TINY_DOC
QUESTION = "w3 w5 w8"

#: Each preset and the method it must equal, at that method's default knobs.
CORNERS = {"mix_recency": "streaming_llm", "mix_h2o": "h2o", "mix_question": "snapkv_question", "mix_knorm": "knorm"}


@pytest.fixture(scope="module")
def plain(tiny):
    return prepare_context(tiny, DOC)


def kept(stored, ctx) -> list[list[list[int]]]:
    """Every layer's and KV head's kept token positions."""
    return [[stored.fates(layer, head) for head in range(ctx.lm.n_kv_heads)] for layer in range(ctx.lm.n_layers)]


@pytest.mark.parametrize("context", ["plain", "templated"])
@pytest.mark.parametrize("ratio", [2.0, 5.0, 8.0])
@pytest.mark.parametrize("preset", sorted(CORNERS))
def test_each_preset_keeps_exactly_its_methods_tokens(request, context, ratio, preset):
    ctx = request.getfixturevalue(context)
    mixed = get_method("mix", preset=preset).compress(Request(ctx, ratio, QUESTION))
    reference = get_method(CORNERS[preset]).compress(Request(ctx, ratio, QUESTION))
    assert kept(mixed, ctx) == kept(reference, ctx)


def test_the_four_corners_keep_different_tokens(plain):
    """The corner test can fail: on this model the four methods keep four different sets."""
    sets = [str(kept(get_method(m).compress(Request(plain, 4.0, QUESTION)), plain)) for m in CORNERS.values()]
    assert len(set(sets)) == len(CORNERS)


def test_ranks_and_mix_by_hand():
    # Scores 3, 1, 2, 2: sorted 1 < 2 = 2 < 3, ranks 0, 1.5 (the tie's mid-rank), 3 of T - 1 = 3.
    ranks = rank_normalise(torch.tensor([[3.0, 1.0, 2.0, 2.0], [0.5, 0.25, -1.0, 8.0]], device="cpu"))
    expected = torch.tensor([[1.0, 0.0, 0.5, 0.5], [2 / 3, 1 / 3, 0.0, 1.0]], device="cpu")
    torch.testing.assert_close(ranks, expected, rtol=0, atol=1e-7)
    # Recency ranks 0, 1/3, 2/3, 1 with weight 1; the first row above with weight 0.5; divided by 1.5:
    # (0 + 0.5) / 1.5, (1/3 + 0) / 1.5, (2/3 + 0.25) / 1.5, (1 + 0.25) / 1.5.
    recency = torch.tensor([[0.0, 1 / 3, 2 / 3, 1.0]], device="cpu")
    mixed = mix_ranks({"recency": recency, "h2o": ranks[:1], "knorm": ranks[1:]}, {"recency": 1.0, "h2o": 0.5})
    torch.testing.assert_close(mixed, torch.tensor([[1 / 3, 2 / 9, 11 / 18, 5 / 6]], device="cpu"), rtol=0, atol=1e-7)
    # A lone token has no order: rank 0.
    assert rank_normalise(torch.tensor([[7.0]], device="cpu")).tolist() == [[0.0]]


def brute_ranks(score: torch.Tensor) -> torch.Tensor:
    """[H, T] -> [H, T]: (count below + count up to - 1) / (2 (T - 1)) by comparing every pair."""
    below = (score.unsqueeze(-1) > score.unsqueeze(-2)).sum(-1)
    upto = (score.unsqueeze(-1) >= score.unsqueeze(-2)).sum(-1)
    return (below + upto - 1).double() / (2 * (score.shape[-1] - 1))


def test_scores_are_the_weighted_ranks_of_the_other_methods_scores(templated):
    """The mix of all four from the methods' own scores, ranked by brute force; then the 2 document
    sinks (n_sink 4 less the 2-token template) and H2O's recent window: a quarter of the budget of
    96 / 4 = 24 tokens, the last 6, at +inf."""
    ctx, weights = templated, {"recency": 0.25, "h2o": 1.0, "question": 0.5, "knorm": 0.75}
    req = Request(ctx, 4.0, QUESTION)
    method = get_method("mix", n_sink=4, recent_share=0.25, **{f"w_{k}": w for k, w in weights.items()})
    own = {
        "h2o": get_method("h2o", recent_share=0.0).scores(req),
        "question": get_method("snapkv_question").scores(req),
        "knorm": get_method("knorm").scores(req),
    }
    position = torch.arange(ctx.doc_len, device="cpu").expand(ctx.lm.n_kv_heads, -1)
    for layer, got in enumerate(method.scores(req)):
        ranks = {"recency": brute_ranks(position), **{k: brute_ranks(s[layer]) for k, s in own.items()}}
        want = sum(w * ranks[k] for k, w in weights.items()) / sum(weights.values())
        protected = torch.zeros_like(want, dtype=torch.bool)
        protected[:, :2] = protected[:, -6:] = True
        assert torch.equal(torch.isinf(got), protected)
        torch.testing.assert_close(got[~protected].double(), want[~protected], rtol=0, atol=1e-6)


def test_a_question_weight_makes_it_query_aware(plain):
    assert catalog.query_awareness("mix") == "options"
    assert not get_method("mix").uses_question() and get_method("mix", w_question=0.5).uses_question()
    with pytest.raises(MethodError, match="w_question above 0 needs a question"):
        get_method("mix", w_question=0.5).compress(Request(plain, 4.0, None))
    get_method("mix").compress(Request(plain, 4.0, None))  # no question weight: no question needed


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"w_recency": 0.0, "w_h2o": 0.0}, "at least one weight must be above 0"),
        ({"preset": "mix_knorm", "w_knorm": 0.0}, "at least one weight must be above 0"),
        ({"w_h2o": -0.5}, "w_h2o must be a number from 0 to 1, got -0.5"),
        ({"w_question": math.nan}, "w_question must be a number from 0 to 1, got nan"),
        ({"w_knorm": 2.0}, "w_knorm must be a number from 0 to 1"),
        ({"kernel": 4}, "kernel must be an odd whole number"),
    ],
)
def test_bad_settings_are_refused_in_one_line(options, message):
    with pytest.raises(MethodError, match=message) as refused:
        get_method("mix", **options)
    assert "\n" not in str(refused.value) and str(refused.value).startswith("mix: ")


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_kvlab_run_mixes_by_its_flags_and_refuses_bad_weights(tiny_folder, tmp_path, capsys, own_models):  # noqa: F811
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(f"w{(i * 7) % 60 + 2}" for i in range(60)))
    base = ["run", "--doc", str(doc), "--method", "mix", "--ratio", "4", "--question", "w3 w5", "--model"]
    base += [str(tiny_folder), "--max-new-tokens", "2"]
    code, out, err = run_cli([*base, "--w-recency", "1", "--w-question", "0.5", "--json"], capsys)
    assert code == 0, err
    result = json.loads(out)
    assert (result["method"], result["ratio"], result["kept_tokens_mean"]) == ("mix", 4.0, 15.0)
    assert result["details"]["mix"] == "(1·recency + 1·h2o + 0.5·question) / 2.5"  # w_h2o's default stays
    for flags, message in (
        (["--w-recency", "-1"], "w_recency must be a number from 0 to 1"),
        (["--w-recency", "0", "--w-h2o", "0"], "at least one weight must be above 0"),
        (["--w-knorm", "nan"], "w_knorm must be a number from 0 to 1"),
    ):
        code, _, err = run_cli([*base, *flags], capsys)
        assert (code, err.count("\n")) == (2, 1) and message in err, err


def test_kvlab_compare_sweeps_it(tiny_folder, tmp_path, capsys, own_models):  # noqa: F811
    doc, out = tmp_path / "doc.txt", tmp_path / "sweep"
    doc.write_text(" ".join(f"w{(i * 7) % 60 + 2}" for i in range(60)))
    argv = ["compare", "--doc", str(doc), "--methods", "mix,h2o", "--ratios", "2,4", "--question", "w3 w5"]
    code, _, err = run_cli([*argv, "--model", str(tiny_folder), "--max-new-tokens", "2", "--out", str(out)], capsys)
    assert code == 0, err
    rows = json.loads((out / "compare.json").read_text())["results"]
    assert sorted((r["method"], r["ratio"]) for r in rows if r["method"] == "mix") == [("mix", 2.0), ("mix", 4.0)]


def test_a_slider_knob_must_name_both_bounds():
    # The app draws a slider from low to high: a slider knob without them is a declaration error.
    from kvlab.compression.options import knob

    with pytest.raises(ValueError, match="both bounds"):
        knob(0.5, "a weight", low=0.0, slider=True)
    assert knob(0.5, "a weight", low=0.0, high=1.0, slider=True).metadata["slider"]
