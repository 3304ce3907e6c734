"""Your pick (kvlab issue #43): the ``manual`` method's spans, its refusals and kept tokens, the
sentence split, the CLI, and a pick ranked among the methods (kvlab.lab.pick)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys

import pytest
import torch

from conftest import TINY_DOC
from kvlab import lab, models, results
from kvlab.cli import main
from kvlab.context import prepare_context
from kvlab.examples import load_examples
from kvlab.lab.pick import DEFAULT_RIVALS, keep_text, ordinal, pick, ranking, read_for_pick, token_budget
from kvlab.methods import MethodError, Request, get_method
from kvlab.methods.manual import Span, parse_keep, sentences_of
from kvlab.paths import assets_dir
from kvlab.pipeline import run
from kvlab.runtime.decode import extend, open_session
from kvlab.sentences import sentence_bounds, split_sentences, token_pieces
from kvlab.testing.device_suite import suite_model

DOC = TINY_DOC
QUESTION = "w3 w5 w8"
PICK_MODULE = "kvlab.lab.pick"  # the module: kvlab.lab's attribute of that name is the function
#: One token per byte on the byte model: token k is character k, so every span below is counted on the text.
TEXT = "Hi. Mrs. Q ok!\n\nNext 3.5 end?"
S0, S1, S2 = TEXT[: TEXT.index("Mrs.")], TEXT[TEXT.index("Mrs.") : TEXT.index("Next")], TEXT[TEXT.index("Next") :]


@pytest.fixture(scope="module")
def ctx(tiny):
    return prepare_context(tiny, DOC)


@pytest.fixture(scope="module")
def byte_lm():
    """A tiny random Llama reading bytes (one token per byte) behind a ChatML template."""
    return suite_model(name="manual-bytes")


@pytest.fixture(scope="module")
def sentences_ctx(byte_lm):
    ctx = prepare_context(byte_lm, TEXT)
    assert ctx.doc_len == len(TEXT) == 29  # ASCII: a byte is a character
    return ctx


def kept(stored, layer: int, head: int) -> set[int]:
    return set(stored.fates(layer, head))


def logits(ctx, stored) -> torch.Tensor:
    return extend(ctx.lm, open_session(ctx.lm, stored), torch.tensor([5, 9, 11]))


# ----------------------------------------------------------------------------- the spans


@pytest.mark.parametrize(
    ("text", "spans"),
    [
        ("0-39,120-179", (Span("token", 0, 39), Span("token", 120, 179))),
        (" 7 ", (Span("token", 7, 7),)),
        ("s0,s3-s5", (Span("sentence", 0, 0), Span("sentence", 3, 5))),
        ("S3 - 5, 40 -49", (Span("sentence", 3, 5), Span("token", 40, 49))),  # s3-5 reads as s3-s5
        ("50-59,0-9", (Span("token", 50, 59), Span("token", 0, 9))),  # in the order written
        ("0-9,10-19", (Span("token", 0, 9), Span("token", 10, 19))),  # touching, not overlapping
        ("First", "first"),
        ("none", "none"),
    ],
)
def test_spans_are_read_by_hand(text, spans):
    assert parse_keep(text) == spans


@pytest.mark.parametrize(
    ("keep", "line"),
    [
        ("", "manual: keep is empty: write 'none' to keep none of the document"),
        ("x", "'x' is none of these"),
        ("3-s4", "'3-s4' is none of these"),
        ("0-9,,12", "'' is none of these"),
        ("1.5", "'1.5' is none of these"),
        ("s", "'s' is none of these"),
        ("9-3", "manual: keep: 9-3 runs backwards; write its first token, then its last"),
        ("s4-s2", "s4-s2 runs backwards; write its first sentence"),
        ("0-9,5-12", "manual: keep: 0-9 and 5-12 overlap (both hold tokens 5-9)"),
        ("20-30,0-20", "0-20 and 20-30 overlap (both hold token 20)"),
        ("s1-s3,s3", "s1-s3 and s3 overlap (both hold sentence s3)"),
    ],
)
def test_a_malformed_pick_is_refused_in_one_line_before_any_document(keep, line):
    with pytest.raises(MethodError) as caught:
        get_method("manual", keep=keep)
    assert line in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("keep", "ratio", "line"),
    [
        ("0-29", 1.0, "manual: keep: 0-29 runs past the document's last token (it has 29 tokens: 0-28)"),
        ("s3", 1.0, "manual: keep: s3 runs past the document's last sentence (it has 3 sentences: s0-s2)"),
        ("s1,10", 1.0, "manual: keep: s1 and 10 overlap (both hold token 10)"),  # s1 is tokens 4-15
        ("s0-s1,14-20", 1.0, "s0-s1 and 14-20 overlap (both hold tokens 14-15)"),
        # 29 / 2 = 14.5, rounded to even as every method rounds it: 14; s1 and 0-2 are 12 + 3 tokens.
        ("s1,0-2", 2.0, "manual: keep: the pick holds 15 document tokens, over the budget of 14 at 2x"),
    ],
)
def test_a_pick_the_document_cannot_hold_is_refused_in_one_line(sentences_ctx, keep, ratio, line):
    with pytest.raises(MethodError) as caught:
        get_method("manual", keep=keep).compress(Request(sentences_ctx, ratio))
    assert line in str(caught.value) and "\n" not in str(caught.value)


def test_the_budget_message_says_the_budget_and_the_pick(sentences_ctx):
    with pytest.raises(MethodError, match=r"the document's 29 tokens / 2\); drop 1$"):
        get_method("manual", keep="s1,0-2").compress(Request(sentences_ctx, 2.0))
    get_method("manual", keep="s1,0-1").compress(Request(sentences_ctx, 2.0))  # 14 tokens: the budget exactly


@pytest.mark.parametrize(
    ("keep", "expected"), [(None, "none"), ("  ", "none"), ([], "none"), (["s0", " 40-59"], "s0,40-59")]
)
def test_a_pick_given_as_a_list_or_nothing_is_one_keep_text(keep, expected):
    assert keep_text(keep) == expected


# ----------------------------------------------------------------------------- what is kept


def test_every_layer_and_head_keeps_exactly_the_template_and_the_token_spans(templated):
    # 4x of 96 tokens: a budget of 24; the pick is 7 + 10 + 1 = 18 tokens, after the 2 template tokens.
    stored = get_method("manual", keep="3-9, 40-49, 95").compress(Request(templated, 4.0, record_importance=True))
    picked = set(range(3, 10)) | set(range(40, 50)) | {95}
    for layer in range(templated.lm.n_layers):
        for head in range(templated.lm.n_kv_heads):
            assert kept(stored, layer, head) == {0, 1} | {2 + j for j in picked}
        # The token view's importance is the pick: 1 on it, 0 elsewhere in the document, none on the template.
        importance = stored.importance[layer]
        assert torch.isnan(importance[:, :2]).all()
        want = torch.tensor([1.0 if j in picked else 0.0 for j in range(96)])
        assert torch.equal(importance[:, 2:], want.expand(templated.lm.n_kv_heads, -1))
    assert stored.logical_len == templated.length and stored.meta["keep"] == "3-9, 40-49, 95"


def test_sentence_spans_keep_the_sentences_tokens_in_every_layer_and_head(sentences_ctx):
    # s0 is "Hi. " (tokens 0-3) and s2 "Next 3.5 end?" (16-28): 17 tokens, under 29 / 1.5 = 19.3 -> 19.
    stored = get_method("manual", keep="s0,s2").compress(Request(sentences_ctx, 1.5))
    prefix = sentences_ctx.prefix_len
    picked = set(range(len(S0))) | set(range(len(S0) + len(S1), len(TEXT)))
    for layer in range(sentences_ctx.lm.n_layers):
        for head in range(sentences_ctx.lm.n_kv_heads):
            assert kept(stored, layer, head) == set(range(prefix)) | {prefix + j for j in picked}


@pytest.mark.parametrize("ratio", [1.0, 4.0, 7.5])
def test_first_keeps_the_opening_up_to_the_budget_every_method_keeps(ctx, ratio):
    """``first`` (the default) keeps tokens 0..B-1, and B is what another method keeps per head
    (snapkv), and what token_budget says: 96, 24, 12.8 -> 13."""
    budget = {1.0: 96, 4.0: 24, 7.5: 13}[ratio]
    snapkv = get_method("snapkv").compress(Request(ctx, ratio, QUESTION))
    assert bool((snapkv.kept_per_head() == budget).all()) and token_budget(ctx.doc_len, ratio) == budget
    stored = get_method("manual").compress(Request(ctx, ratio))
    for layer in range(ctx.lm.n_layers):
        for head in range(ctx.lm.n_kv_heads):
            assert kept(stored, layer, head) == set(range(budget))


def test_keep_everything_gives_the_full_caches_logits(ctx, sentences_ctx):
    """The invariant: a pick of the whole document at ratio 1 is the full cache, in tokens and logits."""
    for context, keep in ((ctx, "0-95"), (ctx, "0-47,48-95"), (sentences_ctx, "s0-s2"), (sentences_ctx, "s0,4-15,s2")):
        stored = get_method("manual", keep=keep).compress(Request(context, 1.0))
        assert bool((stored.kept_per_head() == context.length).all())
        torch.testing.assert_close(logits(context, stored), logits(context, context.full.stored), atol=1e-4, rtol=0)


def test_none_keeps_only_the_template_and_the_question_follows_the_whole_document(templated):
    stored = get_method("manual", keep="none").compress(Request(templated, 4.0))
    assert bool((stored.kept_per_head() == 2).all()) and stored.logical_len == templated.length
    assert torch.isfinite(logits(templated, stored)).all()


# ----------------------------------------------------------------------------- the sentence split


@pytest.mark.parametrize(
    ("pieces", "bounds"),
    [
        # "." then a space ends; "Dr." does not; '."' ends and takes the blank line's two newline tokens;
        # "3.14" does not ("14" follows without a space); "!" ends; the last words end the document.
        (
            ["The", " ferry", " left", ".", " Dr", ".", " Quill", " said", ":", ' "', "Go", '."', "\n", "\n"]
            + ["Pi", " is", " 3", ".", "14", "!", " Done"],
            [(0, 4), (4, 14), (14, 20), (20, 21)],
        ),
        (["Title", "\n", "Body", " text"], [(0, 2), (2, 4)]),  # a line break ends a line's sentence
        (["Use", " e", ".", "g", ".", " this", "."], [(0, 7)]),  # "e.g." then the document's end
        ([' "', "Mrs", ".", " Quill", " came", '."'], [(0, 6)]),  # an abbreviation after an opening quote
        (["Yes", "?", " ", "No", "?"], [(0, 3), (3, 5)]),  # whitespace after an end joins that sentence
        (["Why", "?)", " So"], [(0, 2), (2, 3)]),  # a closing bracket after the mark
        ([], []),
    ],
)
def test_sentence_bounds_by_hand(pieces, bounds):
    assert sentence_bounds(pieces) == bounds


def test_the_sentences_of_a_byte_tokenised_text_by_hand(byte_lm, sentences_ctx):
    ids = sentences_ctx.tokens.ids[sentences_ctx.prefix_len :].tolist()
    got = split_sentences(byte_lm.tokenizer, ids)
    assert [(s.start, s.end, s.text, s.n_tokens, s.label) for s in got] == [
        (0, 4, S0, 4, "s0"),
        (4, 16, S1, 12, "s1"),
        (16, 29, S2, 13, "s2"),
    ]
    assert sentences_of(sentences_ctx) == got


def test_token_pieces_keep_the_space_before_a_word(tiny):
    """The word tokenizer decodes a token alone without its space: the pieces get it back from the pair."""
    ids = tiny.tokenizer("w1 w2 w3", add_special_tokens=False).input_ids
    assert tiny.tokenizer.decode(ids[1:2]) == "w2"
    assert token_pieces(tiny.tokenizer, ids) == ["w1", " w2", " w3"]


# ----------------------------------------------------------------------------- the command line


def cli(doc, *flags: str) -> list[str]:
    return ["run", "--doc", str(doc), "--method", "manual", "--question", "Who?", *flags]


def test_cli_runs_a_sentence_pick(byte_lm, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(models, "get_model", lambda spec=None: byte_lm)
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT)
    assert main(cli(doc, "--ratio", "1.5", "--keep", "s0-s1", "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    prefix = 6  # the ChatML template's "<|im_start|>user\n"
    assert out["method"] == "manual" and out["kept_tokens_mean"] == prefix + len(S0) + len(S1)
    assert out["details"]["keep"] == "s0-s1"


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--ratio", "2", "--keep", "s1-x"], "manual: keep must be token spans"),
        (["--ratio", "2", "--keep", "5-2"], "5-2 runs backwards"),
        (["--ratio", "1", "--keep", "s7"], "s7 runs past the document's last sentence (it has 3 sentences: s0-s2)"),
        (["--ratio", "1", "--keep", "0-40"], "0-40 runs past the document's last token (it has 29 tokens: 0-28)"),
        (["--ratio", "4", "--keep", "s2"], "the pick holds 13 document tokens, over the budget of 7 at 4x"),
    ],
)
def test_cli_bad_spans_exit_2_with_one_line(byte_lm, tmp_path, monkeypatch, capsys, flags, line):
    monkeypatch.setattr(models, "get_model", lambda spec=None: byte_lm)
    doc = tmp_path / "doc.txt"
    doc.write_text(TEXT)
    assert main(cli(doc, *flags, "--json")) == 2
    captured = capsys.readouterr()
    # The run's progress lines ("[ 40%] prefill ...") come first on stderr; the error is one line after them.
    lines = [x for x in captured.err.splitlines() if x.strip() and not re.match(r"\[\s*\d+%\] ", x)]
    assert len(lines) == 1 and lines[0].startswith("kvlab: error: manual: ") and line in lines[0]
    assert captured.out == ""


# ----------------------------------------------------------------------------- the ranking


@pytest.mark.parametrize(("n", "text"), [(1, "1st"), (2, "2nd"), (3, "3rd"), (4, "4th"), (11, "11th")])
def test_ordinals_by_hand(n, text):
    assert ordinal(n) == text and ordinal(n + 100) == f"{n + 100}{text[-2:]}"


def test_the_ranking_rule_by_hand(ctx):
    base = run(ctx, get_method("manual", keep="0-9"), 4.0, QUESTION, max_new_tokens=2).result
    runs = [
        dataclasses.replace(base, method=name, answer_compressed=answer, logppl_compressed=logppl)
        for name, answer, logppl in [
            ("a", "It is Paris.", 2.0),
            ("b", "Lyon", 0.5),
            ("c", "paris!", 1.0),
            ("d", "Paris", 2.0),
            ("e", "Paris", math.nan),
            ("manual", "Rome", 0.1),
        ]
    ]
    marked = ranking(runs, ("Paris",))
    assert [(r.method, r.rank, r.right) for r in marked] == [
        ("c", 1, True),
        ("a", 2, True),
        ("d", 2, True),
        ("e", 4, True),  # right, but no finite log-perplexity
        ("manual", 5, False),  # wrong: below every right answer, whatever its log-perplexity
        ("b", 6, False),
    ]
    unmarked = ranking(runs, None)  # no gold answer: log-perplexity alone
    assert [(r.method, r.rank, r.right) for r in unmarked] == [
        ("manual", 1, None),
        ("b", 2, None),
        ("c", 3, None),
        ("a", 4, None),
        ("d", 4, None),
        ("e", 6, None),
    ]


def test_a_pick_is_ranked_among_the_methods_and_every_run_is_stored(tiny, monkeypatch):
    monkeypatch.setattr(models, "get_model", lambda spec=None: tiny)
    steps: list[float] = []
    first = pick(DOC, None, "0-9,40-49", 4.0, QUESTION, progress=lambda f, desc: steps.append(f))
    assert {r.method for r in first.rows} == {"manual", *DEFAULT_RIVALS} and first.of == 8 and not first.errors
    assert first.pick_tokens == 20 and first.budget == 24 and first.expected is None and steps[-1] == pytest.approx(1.0)
    assert first.result.kept_tokens_mean == 20 and first.view.result is first.result
    # Each row is its own method's run at the pick's ratio on its question (what Explore would show).
    for row in first.rows:
        assert (row.result.method, row.result.ratio, row.result.question) == (row.method, 4.0, QUESTION)
    # No gold answer: the rows ascend in log-perplexity, and the pick's rank counts those below it.
    values = [r.logppl_compressed for r in first.rows]
    assert values == sorted(values) and all(r.right is None for r in first.rows)
    assert first.rank == 1 + sum(v < first.result.logppl_compressed for v in values)
    assert first.rank_text.startswith(f"{ordinal(first.rank)} of 8")

    # A gold answer that the pick misses and a rival finds: the pick goes below every right run.
    mine = set(first.result.answer_compressed.split())
    gold = next(w for r in first.rows if not r.is_pick for w in r.answer.split() if w not in mine)
    monkeypatch.setattr(
        sys.modules[PICK_MODULE], "explore", lambda *a, **k: pytest.fail("a stored run was computed again")
    )
    before = results.store().counts["stored"]
    again = pick(DOC, None, "0-9,40-49", 4.0, QUESTION, gold=gold)
    assert results.store().counts["stored"] - before == 8  # every run served from the result store
    right = [r for r in again.rows if r.right]
    assert right and again.rows[: len(right)] == right and not next(r for r in again.rows if r.is_pick).right
    assert again.rank > len(right) and again.rank == 1 + len(right) + sum(
        r.logppl_compressed < again.result.logppl_compressed for r in again.rows if r.right is False
    )


def test_a_pick_over_the_budget_is_refused_before_any_run(tiny, monkeypatch):
    monkeypatch.setattr(models, "get_model", lambda spec=None: tiny)
    monkeypatch.setattr(sys.modules[PICK_MODULE], "served_run", lambda *a, **k: pytest.fail("a run started"))
    with pytest.raises(MethodError, match="^manual: keep: the pick holds 30 document tokens, over the budget of 24"):
        pick(DOC, None, "0-29", 4.0, QUESTION)


@pytest.mark.slow
def test_the_ferrymans_paragraph_picked_from_the_story_answers_right(embedded):
    """The story at 10x (206 of its 2,058 tokens): the sentence that names the ferryman and the sentence on
    either side (his paragraph, about 100 tokens), found by their text, answer the question; the pick
    ranks among the right runs. (His sentence alone is too little for SmolLM2: it tells another story.)"""
    story = (assets_dir() / "examples" / "story.txt").read_text(encoding="utf-8")
    question = "Who was the ferryman?"
    assert "Fergus Doyle" in next(ex for ex in load_examples() if ex.id == "story").answers
    doc = read_for_pick(story, None)
    assert "".join(s.text for s in doc.sentences) == "".join(doc.token_texts)  # every token once, in order
    assert any(s.text.startswith(' "Mrs. Quill at the shop') for s in doc.sentences)  # "Mrs." ends nothing
    named = next(s for s in doc.sentences if "Fergus Doyle" in s.text)
    assert named.text.strip().startswith("The ferryman, a broad man named Fergus Doyle")
    around = doc.sentences[named.index - 1 : named.index + 2]
    assert sum(s.n_tokens for s in around) <= doc.budget(10) == 206
    picked = pick(
        story, None, f"s{named.index - 1}-s{named.index + 1}", 10, question, methods=("snapkv", "streaming_llm")
    )
    assert picked.expected is not None and "Fergus Doyle" in picked.expected
    assert picked.pick_tokens == sum(s.n_tokens for s in around) and picked.of == 3
    assert next(r for r in picked.rows if r.is_pick).right, picked.result.answer_compressed
    assert picked.rank <= sum(bool(r.right) for r in picked.rows)


def test_stored_rivals_run_before_the_pick_and_the_rest_after(tmp_path):
    """A class's picks each take the compute slot in one stretch: rivals already in the result store
    (nothing to compute) come first, then the pick, then the rivals still to compute."""
    from kvlab.lab.pick import run_order

    mine = lab.run_spec(DOC, None, "manual", 2, QUESTION, options={"keep": "s0"})
    specs = [mine, *(mine.with_method(name) for name in ("snapkv", "kvzip", "h2o", "random"))]
    results.store().put(specs[2].key(), "a stored run")
    results.store().put(specs[4].key(), "another")
    order = run_order(specs)
    assert [spec.method for spec in order] == ["kvzip", "random", "manual", "snapkv", "h2o"]
