"""Each head's role (kvlab.lab.head_roles): its beyond-window share against transformers' own eager attention
and a plain softmax, hand-worked heads, the memo, the figure and the token view's head picker."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from conftest import with_template
from kvlab import figures, lab, models
from kvlab.context import prepare_context
from kvlab.lab import InputError
from kvlab.lab import head_roles as roles_module
from kvlab.lab.head_roles import HeadRoles, HeadRolesKey, beyond_span, head_roles, span_share
from kvlab.lab.views import head_picker_label, head_role_line, present
from kvlab.prompts import question_tokens
from kvlab.testing.random_models import random_model

#: float32 softmaxes of a few dozen keys, summed and averaged: rounding stays far below this.
TOL = 1e-5
DOC = " ".join(f"w{(7 * i) % 50 + 3}" for i in range(70))
QUESTION = "w5 w6 w7"


def plain_share(queries, keys, start, stop, scale, sliding=None):
    """The beyond-window share by hand: each query head and position on its own, softmax over the keys it sees."""
    n_heads, n, _ = queries.shape
    n_kv, length = keys.shape[0], keys.shape[1]
    group = n_heads // n_kv
    out = torch.zeros(n_kv, dtype=torch.float64)
    for h in range(n_heads):
        for i in range(n):
            now = length - n + i
            first = 0 if sliding is None else max(0, now - sliding + 1)
            k = keys[h // group, first : now + 1].double()
            weights = torch.softmax(k @ queries[h, i].double() * scale, dim=0)
            positions = torch.arange(first, now + 1)
            out[h // group] += weights[(positions >= start) & (positions < stop)].sum() / (group * n)
    return out


def test_span_share_is_the_plain_softmax_mass_on_the_span():
    gen = torch.Generator().manual_seed(0)
    queries, keys = torch.randn(6, 5, 8, generator=gen), torch.randn(2, 40, 8, generator=gen)
    for sliding in (None, 12):
        got = span_share(queries, keys, 4, 30, scale=0.7, sliding=sliding)
        assert torch.allclose(got.double(), plain_share(queries, keys, 4, 30, 0.7, sliding), atol=TOL)


# Gemma 3: window layers that drop most of the document, and a scaling of its own (query_pre_attn_scalar).
@pytest.mark.parametrize(
    "family, overrides", [("llama", None), ("gemma3", {"sliding_window": 24, "query_pre_attn_scalar": 64})]
)
def test_shares_match_transformers_eager_attention_over_the_whole_sequence(family, overrides):
    lm = with_template(random_model(family, overrides, seed=1))
    ctx = prepare_context(lm, DOC)
    assert ctx.prefix_len == 2
    roles = head_roles(ctx, QUESTION, n_sink=4, window=16)
    # The reference: transformers' eager forward of context + question turn at once, its softmax rows.
    ids = torch.cat([ctx.tokens.ids, question_tokens(lm.tokenizer, QUESTION)])
    n = ids.numel() - ctx.length
    lm.model.set_attn_implementation("eager")
    try:
        with torch.inference_mode():
            attentions = lm.model(input_ids=ids.unsqueeze(0), output_attentions=True).attentions
    finally:
        lm.model.set_attn_implementation("kvlab")
    beyond = torch.zeros(ids.numel(), dtype=torch.bool)
    beyond[4 : ctx.length - 16] = True
    for layer, weights in enumerate(attentions):
        rows = weights[0, :, -n:].double()  # [H, n, T]: the question's rows
        per_query_head = rows[..., beyond].sum(dim=-1).mean(dim=-1)  # [H]
        expected = per_query_head.view(lm.n_kv_heads, -1).mean(dim=-1)
        assert roles.shares[layer] == pytest.approx(expected.tolist(), abs=TOL)
    if overrides:  # a window layer's question cannot see most of the document: it streams
        window_layers = [i for i, g in enumerate(lm.geometry) if g.window is not None]
        assert window_layers and all(roles.labels[i] == ["streaming"] * lm.n_kv_heads for i in window_layers)


def test_a_head_on_the_sinks_streams_and_a_head_on_the_middle_retrieves():
    # Keys: the 4 sinks along e1, the middle (positions 10..19) along e2, the rest 0; the last 2 keys are the
    # question's own. KV head 0's queries point along e1, KV head 1's along e2 (2 query heads each).
    length, n, big = 40, 2, 12.0
    keys = torch.zeros(2, length, 2)
    keys[:, :4, 0] = 1.0
    keys[:, 10:20, 1] = 1.0
    queries = torch.zeros(4, n, 2)
    queries[:2, :, 0] = big
    queries[2:, :, 1] = big
    start, stop = beyond_span(length - n, prefix_len=0, n_sink=4, window=8)
    assert (start, stop) == (4, 30)
    shares = span_share(queries, keys, start, stop, scale=1.0)
    # Worked by hand: each query sees 39 or 40 keys; 4 (head 0) or 10 (head 1) have logit 12, the rest 0. The
    # span 4..29 holds 26 keys: all at logit 0 for head 0; for head 1 the 10 middle ones and 16 at 0.
    sink_head = sum(26 / (4 * math.exp(big) + (seen - 4)) for seen in (39, 40)) / 2
    middle_head = sum((10 * math.exp(big) + 16) / (10 * math.exp(big) + (seen - 10)) for seen in (39, 40)) / 2
    assert shares.tolist() == pytest.approx([sink_head, middle_head], abs=TOL)
    roles = HeadRoles.of([shares.tolist()], n_sink=4, window=8, threshold=0.5, beyond=stop - start)
    assert roles.labels == [["streaming", "retrieval"]]
    assert roles.descriptions[0][1] == "layer 0, head 1: retrieval, 100% of the question's attention beyond the window"
    assert roles.descriptions[0][0] == "layer 0, head 0: streaming, 0% of the question's attention beyond the window"


def test_a_document_within_the_sinks_and_the_window_has_only_streaming_heads(tiny):
    ctx = prepare_context(tiny, "w3 w4 w5 w6 w7 w8")
    roles = head_roles(ctx, QUESTION, n_sink=4, window=64)
    assert roles.beyond_tokens == 0 and all(s == 0.0 for row in roles.shares for s in row)
    assert "every head streams" in roles.settings


def test_roles_are_computed_once_per_question_and_settings(tiny, monkeypatch):
    ctx = prepare_context(tiny, DOC)
    reads = []
    read = roles_module.question_turn
    monkeypatch.setattr(roles_module, "question_turn", lambda *a: reads.append(a) or read(*a))
    first = head_roles(ctx, QUESTION)
    assert head_roles(ctx, QUESTION) is first and len(reads) == 1
    assert ctx.holds(HeadRolesKey(first.n_sink, first.window, first.threshold, question=QUESTION))
    other = head_roles(ctx, QUESTION, window=8)
    assert len(reads) == 2 and other.window == 8


@pytest.mark.parametrize(
    "settings, word", [({"n_sink": -1}, "n_sink"), ({"window": 2.5}, "window"), ({"threshold": 1.5}, "threshold")]
)
def test_bad_settings_are_refused_in_one_line(tiny, settings, word):
    ctx = prepare_context(tiny, DOC)
    with pytest.raises(InputError, match=word) as caught:
        head_roles(ctx, QUESTION, **settings)
    assert "\n" not in str(caught.value)


def test_roles_figure_is_layers_by_heads_with_each_role():
    shares = [[0.1, 0.9], [0.6, 0.2], [0.0, 0.5]]
    labels = [[("retrieval" if s >= 0.5 else "streaming") for s in row] for row in shares]
    fig = figures.roles_heatmap(shares, labels, "4 sinks, a 64-token window")
    heat = fig.data[0]
    assert list(heat.x) == [0, 1, 2] and list(heat.y) == [0, 1]
    assert heat.z[1][0] == pytest.approx(90.0) and heat.z[0][1] == pytest.approx(60.0)  # z[head][layer], in %
    assert [list(row) for row in heat.text] == [["S", "R", "S"], ["R", "S", "R"]]
    assert heat.zmin == 0 and heat.zmax == 100
    assert "4 sinks, a 64-token window" in fig.layout.title.text and fig.layout.height


def test_head_picker_labels_name_each_heads_role():
    roles = HeadRoles.of([[0.12, 0.81], [0.5, 0.49]], n_sink=4, window=64, threshold=0.5, beyond=900)
    assert head_picker_label(roles, 0) == "KV head (layer 0: 0 streaming 12%, 1 retrieval 81%)"
    assert head_picker_label(roles, 1) == "KV head (layer 1: 0 retrieval 50%, 1 streaming 49%)"
    assert (
        head_role_line(roles, 0, 1) == "layer 0, head 1: retrieval, 81% of the question's attention beyond the window."
    )
    assert head_picker_label(None, 0) == "KV head" and head_picker_label(roles, 5) == "KV head"
    assert head_role_line(None, 0, 0) == "" and head_role_line(roles, 0, 2) == ""


def test_an_explore_run_carries_the_roles_to_its_view_and_picker(tiny, monkeypatch):
    monkeypatch.setattr(models, "get_model", lambda spec=None: tiny)
    ex = lab.explore(lab.run_spec(DOC, None, "streaming_llm", 4, QUESTION, max_new_tokens=2))
    view = pickle.loads(pickle.dumps(present(ex)))  # what the result store keeps
    again = head_roles(ex.run.ctx, QUESTION)  # the run's roles are the context's, not made twice
    assert again is ex.roles and view.roles.shares == again.shares
    for layer in range(tiny.n_layers):
        label = head_picker_label(view.roles, layer)
        for head, role in enumerate(again.labels[layer]):
            assert f"{head} {role} {again.shares[layer][head]:.0%}" in label
