"""The "Your pick" tab: its counter and keep text worked by hand, and the tab driven through gradio_client."""

from __future__ import annotations

import pytest

from kvlab import models
from kvlab.lab.pick import spans_of, tally
from kvlab.sentences import Sentence
from kvlab.testing.device_suite import suite_model
from kvlab.ui.pick import sentence_label

#: Four sentences of 5, 3, 8 and 4 tokens: 20 tokens, so a budget of 5 at 4x and of 10 at 2x.
SENTENCES = [
    Sentence(0, 0, 5, "One two three four five."),
    Sentence(1, 5, 8, "Six seven eight."),
    Sentence(2, 8, 16, "Nine."),
    Sentence(3, 16, 20, "Ten."),
]


@pytest.mark.parametrize(
    "indices, keep",
    [([], "none"), ([2], "s2"), ([0, 1, 2, 3], "s0-s3"), ([7, 0, 2, 1], "s0-s2,s7"), ([3, 5, 3], "s3,s5")],
)
def test_sentence_indices_make_the_keep_text_by_hand(indices, keep):
    assert spans_of(indices) == keep


@pytest.mark.parametrize(
    "ticked, ratio, line, keep",
    [
        ([], 4.0, "picked 0 of 5 tokens (budget at 4x)", "none"),
        (["s1"], 4.0, "picked 3 of 5 tokens (budget at 4x)", "s1"),
        (["s0"], 4.0, "picked 5 of 5 tokens (budget at 4x)", "s0"),  # exactly the budget is within it
        (["s1", "s3"], 4.0, "picked 7 of 5 tokens (budget at 4x): 2 over, untick a sentence", "s1,s3"),
        (["s3", "s1", "s0"], 2.0, "picked 12 of 10 tokens (budget at 2x): 2 over, untick a sentence", "s0-s1,s3"),
        (["s1", "s9"], 1.5, "picked 3 of 13 tokens (budget at 1.5x)", "s1"),  # 20 / 1.5 = 13.3; s9 is stale
    ],
)
def test_the_counter_and_keep_text_by_hand(ticked, ratio, line, keep):
    assert tally(SENTENCES, ticked, ratio) == (line, keep)


def test_a_sentence_label_names_its_index_tokens_and_text_on_one_shortened_line():
    assert sentence_label(4, 12, "The  head\nbaker.") == "s4 (12 tok): The head baker."
    long = sentence_label(0, 50, "word " * 40)
    assert long.startswith("s0 (50 tok): word word") and long.endswith("\u2026") and len(long) == 13 + 90


# --------------------------------------------------------------------------- the tab, served

gradio_client = pytest.importorskip("gradio_client")
from gradio_client.exceptions import AppError  # noqa: E402

#: One token per byte on the byte model: sentences "Hi. " (4 tokens), "Mrs. Q ok!\n\n" (12), "Next 3.5 end?" (13).
TEXT = "Hi. Mrs. Q ok!\n\nNext 3.5 end?"
QUESTION = "Who?"


@pytest.fixture(scope="module")
def client():
    """The app served on a tiny random byte-reading model (every model spec reads as it)."""
    from benchmarks.browser import serve_app

    lm = suite_model(name="pick-tab-bytes")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(models, "get_model", lambda spec=None: lm)
        with serve_app(lm) as url:
            yield gradio_client.Client(url, verbose=False)


def test_the_tab_splits_counts_and_ranks_a_pick(client):
    ticks, counter = client.predict(text=TEXT, ratio=4, api_name="/pick_read")
    assert [value for _, value in ticks["choices"]] == ["s0", "s1", "s2"]
    assert ticks["choices"][1][0] == "s1 (12 tok): Mrs. Q ok!" and counter == "picked 0 of 7 tokens (budget at 4x)"
    out = client.predict(text=TEXT, ticked=["s0"], ratio=4, question=QUESTION, api_name="/pick")
    mark_pick, answer_pick, mark_full, answer_full, table, rank = out
    methods = [row[1] for row in table["data"]]
    assert "your pick" in methods and len(methods) == 8
    place = [row[0] for row in table["data"]][methods.index("your pick")]
    assert rank.startswith(f"**Your pick ranks {place}") and " of 8" in rank and "keeping 4 of the 7 tokens" in rank
    kept = {row[1]: float(row[4].rstrip("%")) for row in table["data"]}  # bytes kept, % of the full cache's
    assert all(0 < share < 100 for share in kept.values())
    # The pick keeps 4 document tokens where every eviction method keeps 7, and the template either way.
    assert all(kept["your pick"] < kept[m] for m in ("snapkv", "h2o", "random", "streaming_llm"))


def test_a_pick_over_the_budget_is_one_line_and_the_server_stays_up(client):
    with pytest.raises(AppError, match="over the budget of 7") as caught:
        client.predict(text=TEXT, ticked=["s1"], ratio=4, question=QUESTION, api_name="/pick")
    assert "\n" not in str(caught.value).strip()
    ticks, _ = client.predict(text=TEXT, ratio=4, api_name="/pick_read")  # still serving
    assert len(ticks["choices"]) == 3
