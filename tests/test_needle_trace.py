"""Where the needle went (issue #33): the trace's numbers against transformers' eager forward on a tiny model.

The model is a tiny random Gemma 3 whose ``query_pre_attn_scalar`` (4) is not
its head dimension (16): attention at 1/sqrt(d) instead of the layer's own
scaling would give other shares. The compressed cache is StreamingLLM's (the
same tokens in every layer and head), so that the eager reference of the
compressed cache is the full forward pass with the evicted tokens masked from
the question's and answer's queries.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvlab.context import prepare_context
from kvlab.figures import EVICTED
from kvlab.figures.needle import head_shares, needle_figure, needle_table, token_shares
from kvlab.lab.explore import token_texts
from kvlab.lab.fates import pieces_spelling, trace_needle
from kvlab.methods import Request, get_method
from kvlab.metrics import question_attention
from kvlab.prompts import question_tokens
from kvlab.runtime.decode import greedy
from kvlab.runtime.hooks import QueryCapture
from kvlab.testing.random_models import random_model

DOC = (
    " ".join(f"w{(i * 5) % 40 + 2}" for i in range(34))
    + " w50 w51 w52 w53 "
    + " ".join(f"w{(i * 3) % 40 + 2}" for i in range(26))
)
SPAN, VALUE = "w50 w51 w52 w53", "w52 w53"
NEW = 4  # answer tokens: a random model rarely stops, so the answer is NEW tokens and NEW - 1 are fed back


def test_pieces_spelling_marks_every_piece_the_text_overlaps():
    pieces = ["The", " code", " is", ": 4", "82", "1-", "violet", "."]
    assert pieces_spelling(pieces, "4821-violet") == [3, 4, 5, 6]
    assert pieces_spelling(pieces, "code") == [1]
    assert pieces_spelling(pieces, "absent") == []
    # From a start offset: the second occurrence only.
    assert pieces_spelling(["ab", "c", "ab"], "ab", start=1) == [2]


@pytest.fixture(scope="module")
def lm():
    torch.set_num_threads(1)
    return random_model("gemma3", {"query_pre_attn_scalar": 4})


@pytest.fixture(scope="module")
def eager(lm):
    twin = type(lm.model)(copy.deepcopy(lm.model.config)).eval()
    twin.load_state_dict(lm.model.state_dict())
    twin.set_attn_implementation("eager")
    return twin


def eager_greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    """n greedy tokens after ids [N] from a plain forward pass per step (no cache)."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=torch.cat([ids, torch.tensor(out, dtype=torch.long)])[None]).logits[0, -1]
            out.append(int(logits.argmax()))
    return out


def eager_reference(model, context: torch.Tensor, tail: torch.Tensor, hidden: torch.Tensor | None = None):
    """Eager forward of ``context`` [T] then ``tail``, causal, with the ``hidden`` context positions
    masked from the tail's queries only (the keys an eviction drops: the kept ones were computed with the
    whole context before them) -> (log-softmax [N, V], per layer attention [H, N, N]) in float64."""
    ids = torch.cat([context, tail])
    n, t = ids.numel(), context.numel()
    blocked = torch.ones(n, n, dtype=torch.bool).triu(1)
    if hidden is not None:
        blocked[t:, hidden] = True
    mask = torch.zeros(n, n).masked_fill(blocked, float("-inf"))[None, None]  # a custom 4D mask, used as given
    with torch.inference_mode():
        out = model(input_ids=ids[None], attention_mask=mask, output_attentions=True)
    return torch.log_softmax(out.logits[0].double(), -1), [a[0].double() for a in out.attentions]


def shares_over(attn: torch.Tensor, rows: slice, cols: torch.Tensor, n_kv: int) -> torch.Tensor:
    """Per KV head [H_kv, len(cols)]: each query row's weights on ``cols`` renormalised over ``cols``
    (the softmax over those keys alone), averaged over the rows and the group's query heads."""
    w = attn[:, rows][:, :, cols]
    w = w / w.sum(-1, keepdim=True)
    return w.mean(1).reshape(n_kv, -1, cols.numel()).mean(1)


def test_trace_matches_the_eager_forward(lm, eager):
    ctx = prepare_context(lm, DOC)
    prompt = question_tokens(lm.tokenizer, "w3 w4")
    stored = get_method("streaming_llm").compress(Request(ctx, 2.0, "w3 w4"))
    trace = trace_needle(ctx, stored, prompt, SPAN, VALUE, NEW, "streaming_llm", 2.0)
    T, n_kv = ctx.full.length, ctx.full.keys[0].shape[0]
    span = pieces_spelling(token_texts(lm.tokenizer, ctx.tokens.ids.tolist()), SPAN)
    assert trace.positions == span and len(span) == 4 and trace.span_value == [False, False, True, True]

    answer = eager_greedy(eager, torch.cat([ctx.tokens.ids, prompt]), NEW)
    assert trace.answer_texts == token_texts(lm.tokenizer, answer)
    fed = torch.cat([prompt, torch.tensor(answer[:-1], dtype=torch.long)])  # the queries: prompt + fed answer
    rows = slice(T, T + fed.numel())
    n_p = prompt.numel()

    # The full cache: every context token at its own position.
    logp, attn = eager_reference(eager, ctx.tokens.ids, fed)
    forced = logp[T + n_p - 1 + torch.arange(NEW), torch.tensor(answer)]
    assert torch.allclose(torch.tensor(trace.logprob_full, dtype=torch.float64), forced, atol=1e-4)
    every = torch.arange(T)
    for layer in range(lm.n_layers):
        ref = shares_over(attn[layer], rows, every, n_kv)[:, span]
        assert torch.allclose(torch.tensor(trace.attention_full[layer], dtype=torch.float64), ref, atol=1e-5)

    # The compressed cache: StreamingLLM keeps one set of tokens in every layer and head.
    kept = sorted(int(i) for i in stored.layer_view(0).token_index[0] if i >= 0)
    for layer in range(lm.n_layers):
        for head in range(n_kv):
            assert sorted(stored.fates(layer, head)) == kept
    kept_t = torch.tensor(kept)
    assert any(p in kept for p in span) and not all(p in kept for p in span)  # the span straddles the cut
    evicted = torch.tensor([i for i in range(T) if i not in kept])
    logp_c, _ = eager_reference(eager, ctx.tokens.ids, fed, evicted)
    forced_c = logp_c[T + n_p - 1 + torch.arange(NEW), torch.tensor(answer)]
    assert torch.allclose(torch.tensor(trace.logprob_compressed, dtype=torch.float64), forced_c, atol=1e-4)
    for layer in range(lm.n_layers):
        # The full run's queries over the kept keys alone: the held-out queries on the compressed cache.
        ref = shares_over(attn[layer], rows, kept_t, n_kv)
        for p, pos in enumerate(span):
            got = torch.tensor([trace.attention_compressed[layer][h][p] for h in range(n_kv)], dtype=torch.float64)
            if pos in kept:
                assert torch.allclose(got, ref[:, kept.index(pos)], atol=1e-5)
                assert all(trace.fates[layer][h][p] != EVICTED for h in range(n_kv))
            else:
                assert torch.equal(got, torch.zeros(n_kv, dtype=torch.float64))
                assert all(trace.fates[layer][h][p] == EVICTED for h in range(n_kv))


def test_question_attention_at_the_layers_scaling_matches_eager(lm, eager):
    """What TokenFates' "question" levels are computed from: question_attention at the layers' own scaling
    (the fix: it was called without it) is the eager model's attention over the cache."""
    ctx = prepare_context(lm, DOC)
    prompt = question_tokens(lm.tokenizer, "w3 w4")
    capture = QueryCapture(lm.n_layers)
    answer = greedy(lm, ctx.full.stored, prompt, NEW, capture)
    T, n_kv = ctx.full.length, ctx.full.keys[0].shape[0]
    fed = torch.cat([prompt, torch.tensor(answer.ids[:-1], dtype=torch.long)])
    _, attn = eager_reference(eager, ctx.tokens.ids, fed)
    scaled = question_attention(capture.per_layer(), ctx.full.keys, [g.scaling for g in lm.geometry])
    plain = question_attention(capture.per_layer(), ctx.full.keys)
    for layer in range(lm.n_layers):
        ref = shares_over(attn[layer], slice(T, T + fed.numel()), torch.arange(T), n_kv)
        assert torch.allclose(scaled[layer].double(), ref, atol=1e-5)
        assert not torch.allclose(plain[layer].double(), ref, atol=1e-3)  # 1/sqrt(d) is another attention


def test_figure_and_table_draw_the_trace():
    trace = {
        "label": "m",
        "ratio": 2.0,
        "value": "7",
        "span_texts": [" is", ": 7"],
        "positions": [5, 6],
        "span_value": [False, True],
        "fates": [[["kept", EVICTED]], [["compacted", "kept"]]],
        "attention_full": [[[0.1, 0.3]], [[0.2, 0.0]]],
        "attention_compressed": [[[0.2, 0.0]], [[0.1, 0.1]]],
        "answer_texts": [":", " 7"],
        "answer_value": [False, True],
        "logprob_full": [-0.1, -0.2],
        "logprob_compressed": [-0.3, -2.0],
        "answer_full": "7",
        "answer_compressed": "8",
    }
    assert head_shares(trace["attention_full"]) == pytest.approx([0.4, 0.2])
    assert token_shares(trace["attention_compressed"]) == pytest.approx([0.15, 0.05])
    fig = needle_figure(trace)
    heat = fig.data[0]
    # One row per needle token, one column per (layer, head); the codes name the fates.
    assert len(heat.z) == 2 and len(heat.z[0]) == 2
    names = [t.name for t in fig.data if t.legendgroup == "fates"]
    assert [[names[c] for c in row] for row in heat.z] == [["kept", "compacted"], [EVICTED, "kept"]]
    table = needle_table(trace)
    assert "| `: 7` | yes | 1 | 1 | 0 | 0.1500 | 0.0500 |" in table
    assert "| ` 7` | yes | -0.200 | -2.000 |" in table
