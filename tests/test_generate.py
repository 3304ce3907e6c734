"""Generation under a bounded cache (kvlab.bounded): budgets, events, and the unbounded reference."""

from __future__ import annotations

import pytest
import torch

from kvlab.bounded import loop
from kvlab.bounded.loop import run_policy
from kvlab.bounded.policies import bounded_policies, make_policy, policy_names
from kvlab.bounded.policies.h2o import H2OPolicy
from kvlab.compression.scoring import pool_group
from kvlab.runtime.decode import greedy

PROTECTED = 4
PROMPT = torch.tensor([(i * 5) % 60 + 2 for i in range(40)])


def _run(lm, name, budget, n_new=60, chunk=1, forced=None, stop=False):
    policy = make_policy(name, lm, budget, PROTECTED)
    return policy, run_policy(policy, PROMPT, n_new, forced=forced, chunk=chunk, stop=stop)


@pytest.mark.parametrize("name", bounded_policies())
def test_the_cache_never_exceeds_its_budget(tiny, name, monkeypatch):
    budget, held = 48, []
    real_extend = loop.extend

    def watched(lm, session, ids, *args, **kwargs):
        # Keys are appended before attention runs: after the pass is the most the pass held.
        out = real_extend(lm, session, ids, *args, **kwargs)
        held.append(max(layer.keys.shape[-2] for layer in session.cache.layers))
        return out

    monkeypatch.setattr(loop, "extend", watched)
    _, run = _run(tiny, name, budget, n_new=60, chunk=8)
    assert len(run.ids) == 60 and len(run.sizes) == 60
    assert len(held) == PROMPT.numel() // 8 + 59
    assert max(held) <= budget and run.max_size <= budget
    assert run.events, "100 tokens in a budget of 48 must shrink the cache"


@pytest.mark.parametrize("name", policy_names())
def test_with_room_for_everything_every_method_is_plain_greedy(tiny, name):
    reference = greedy(tiny, None, PROMPT, 30)
    _, run = _run(tiny, name, budget=PROMPT.numel() + 30, n_new=30, chunk=16, stop=True)
    assert run.ids == reference.ids
    assert run.logprobs == pytest.approx(reference.logprobs, abs=1e-4)
    assert run.events == []


def test_streaming_llm_evicts_one_per_step_and_keeps_sinks_and_recent(tiny):
    budget, n_new = 24, 30
    policy, run = _run(tiny, "streaming_llm", budget, n_new)
    fed = PROMPT.numel() + n_new - 1  # the last written token is never read back
    assert len(run.events) == fed - budget
    assert all(e.before == budget and e.after == budget - 1 for e in run.events)
    sinks = 4
    expected = list(range(sinks)) + list(range(fed - (budget - sinks), fed))
    assert policy.k_pos[0][0].tolist() == expected


def test_h2o_evicts_one_per_step(tiny):
    budget, n_new = 24, 30
    _, run = _run(tiny, "h2o", budget, n_new)
    assert len(run.events) == PROMPT.numel() + n_new - 1 - budget


def test_h2o_scores_are_the_attention_each_key_received(tiny_eager, tiny):
    """With no eviction, each key's score is its column sum of the eager attention, averaged over its group."""
    policy = H2OPolicy(tiny, budget=None)
    run_policy(policy, PROMPT, 1, chunk=7, stop=False)
    out = tiny_eager.model(PROMPT.unsqueeze(0), output_attentions=True)
    for layer, attn in enumerate(out.attentions):
        expected = pool_group(attn[0].sum(dim=1), tiny.n_kv_heads, "mean")
        torch.testing.assert_close(policy.scores[layer], expected, atol=1e-4, rtol=1e-4)


def test_online_am_compacts_every_half_budget_after_the_first_fill(tiny):
    budget, n_new = 32, 60
    _, run = _run(tiny, "online_am", budget, n_new)
    fed, half = PROMPT.numel() + n_new - 1, budget // 2
    # Worked by hand: the first compaction when the cache is full (budget tokens read),
    # then one each time the budget - half tokens read since refill it.
    expected = 1 + (fed - budget - 1) // (budget - half)
    assert len(run.events) == expected
    assert all(e.before == budget and e.after == half for e in run.events)
    gaps = [b.position - a.position for a, b in zip(run.events, run.events[1:])]
    assert all(g == budget - half for g in gaps)


def test_beaconkv_evicts_a_chunk_at_a_time_and_records_its_beacons(tiny):
    budget, n_new = 48, 60
    _, run = _run(tiny, "beaconkv", budget, n_new)
    gaps = [b.position - a.position for a, b in zip(run.events, run.events[1:])]
    assert gaps and all(g == 16 for g in gaps)
    assert all(e.after == budget - 16 for e in run.events)
    assert len(run.beacons) == len(run.events)
    last = run.beacons[-1]
    assert sum(last.rows) == tiny.n_layers * tiny.n_heads * 16  # 16 beacons per (layer, query head)
    assert max(last.tokens) < last.position


def test_teacher_forcing_scores_the_given_text(tiny):
    _, free = _run(tiny, "streaming_llm", 24, 20)
    _, forced = _run(tiny, "streaming_llm", 24, 20, forced=free.ids)
    assert forced.ids == free.ids
    assert forced.logprobs == pytest.approx(free.logprobs, abs=1e-5)


def test_a_budget_too_small_is_refused_in_one_line(tiny):
    from kvlab.methods import MethodError

    for name in bounded_policies():
        with pytest.raises(MethodError, match="budget"):
            _run(tiny, name, budget=6, chunk=4)


def test_docs_policies_table_is_the_registrys():
    """docs/architecture.md holds policies_table() between its markers, every registered policy a row."""
    from pathlib import Path

    from kvlab.bounded.policy_registry import TABLE_BEGIN, TABLE_END, policies_table

    doc = (Path(__file__).resolve().parent.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = f"{TABLE_BEGIN}\n{policies_table()}\n{TABLE_END}"
    assert block in doc, f"docs/architecture.md's policies table is stale; put this in its place:\n{block}"
    assert all(f"| `{name}` |" in block for name in policy_names())


# --- the lab, the task, the figures, the CLI ------------------------------------


def test_divergence_is_the_first_differing_token():
    from kvlab.lab.generate import divergence

    assert divergence([1, 2, 3], [1, 2, 3]) is None
    assert divergence([1, 2, 4], [1, 2, 3]) == 2
    assert divergence([1, 2], [1, 2, 3]) == 2
    assert divergence([], [5]) == 0


def test_copy_task_prompt_round_trips_and_scores_by_hand():
    from kvlab.tasks.copying import codes_in_prompt, copy_prompt, make_codes, score_copy

    codes = make_codes(5, seed=3)
    assert len(set(codes)) == 5 and all(len(c) == 4 and c[0].isupper() and c[1:].isdigit() for c in codes)
    assert codes_in_prompt(copy_prompt(codes)) == codes
    assert codes_in_prompt("Tell me a story.") is None
    # Two of five codes right, a wrong one, then the fourth: 3 in the list's order;
    # F1 = 2 * (3/4 * 3/5) / (3/4 + 3/5) with 3 codes in common.
    answer = "\n".join([codes[0], codes[1], "Z999", codes[3]])
    score = score_copy(answer, codes)
    assert score.in_order == 3 and score.n_codes == 5
    assert score.f1 == pytest.approx(2 * 0.75 * 0.6 / (0.75 + 0.6))
    # The embedded model's own format: each code in a sentence, then in a block (counted once).
    verbose = "".join(f'The code for the "{c}" is:\n\n```\n{c}\n```\n\n' for c in [codes[1], codes[0], codes[2]])
    score = score_copy(verbose, codes)
    assert score.in_order == 2  # codes[0], codes[2] (or codes[1], codes[2]) in order
    assert score.f1 == pytest.approx(2 * 1.0 * 0.6 / (1.0 + 0.6))


def test_copy_task_items_fit_their_length():
    from kvlab.tasks.copying import copy_codes

    count = lambda text: len(text.split())  # noqa: E731 - one "token" per word
    items = copy_codes(count, 2, seed=0, length=40)
    assert len(items) == 2 and items[0].item_id != items[1].item_id
    assert all(count(item.document) <= 40 for item in items)
    assert items[0].answers[0].split() == items[0].document.split()[6:]


def test_cache_size_figure_marks_every_event():
    from kvlab.figures.generation import cache_size_figure

    fig = cache_size_figure({"window": [3, 4, 4]}, {"window": [30, 40, 40]}, {"window": [(2, 5, 4)]}, budget=4)
    lines = [t for t in fig.data if t.mode == "lines"]
    marks = [t for t in fig.data if t.mode == "markers"]
    assert list(lines[0].y) == [3, 4, 4] and list(marks[0].x) == [2] and list(marks[0].y) == [5]
    assert fig.layout.height > 0


@pytest.mark.parametrize(
    "argv",
    [
        ["generate"],
        ["generate", "--prompt", "hi", "--doc", "x.txt"],
        ["generate", "--prompt", "   "],
        ["generate", "--doc", "x.txt"],
        ["generate", "--prompt", "hi", "--budget", "ten"],
    ],
)
def test_cli_generate_refuses_bad_input_in_one_line(argv, capsys):
    from kvlab.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvlab: error:") and "\n" not in err


def test_lab_refuses_bad_input_before_loading_a_model():
    from kvlab.lab.generate import generate
    from kvlab.lab.inputs import InputError

    with pytest.raises(InputError, match="new tokens"):
        generate(prompt="hi", max_new_tokens=5000)
    with pytest.raises(InputError, match="unknown generation method"):
        generate(prompt="hi", methods=["nope"])
    with pytest.raises(InputError, match="budget"):
        generate(prompt="hi", budget=0)


def test_common_subsequence_against_brute_force():
    import itertools
    import random

    from kvlab.tasks.copying import common_subsequence

    rng = random.Random(5)
    for _ in range(200):
        a = [rng.choice("abc") for _ in range(rng.randint(0, 6))]
        b = [rng.choice("abc") for _ in range(rng.randint(0, 6))]

        # the longest subsequence of a (by brute force over index subsets) that is also one of b
        def is_subsequence(s, t):
            it = iter(t)
            return all(x in it for x in s)

        best = max(
            k
            for k in range(len(a) + 1)
            if any(is_subsequence([a[i] for i in idx], b) for idx in itertools.combinations(range(len(a)), k))
        )
        assert common_subsequence(a, b) == best


def test_a_prompt_past_the_window_is_refused_before_any_work(tiny, monkeypatch):
    """The tiny model reads 512 positions: a 600-word prompt, or a document plus question plus the
    tokens to write past 512, is refused naming the window; a prompt over the character limit too."""
    import sys

    from kvlab import limits, models
    from kvlab.lab.generate import generate
    from kvlab.lab.inputs import InputError

    monkeypatch.setattr(models, "get_model", lambda spec=None: tiny)
    monkeypatch.setattr(sys.modules["kvlab.lab.generate"], "run_policy", lambda *a, **k: pytest.fail("work started"))
    words = lambda n: " ".join(f"w{i % 60}" for i in range(n))  # noqa: E731 - one token per word
    # 600 words and the base-model template's suffix ("Answer:" on a new line, one unknown word here): 601 tokens.
    with pytest.raises(InputError, match="The prompt is 601 tokens and 8 new tokens .* reads at most 512 tokens"):
        generate(prompt=words(600), max_new_tokens=8)
    with pytest.raises(InputError, match="and 250 new tokens were asked"):
        generate(document=words(300), question="w1 w2", max_new_tokens=250)
    with pytest.raises(InputError, match=f"the limit here is {limits.LIMITS.document_chars:,}"):
        generate(prompt="w1 " * (limits.LIMITS.document_chars // 3 + 1))
