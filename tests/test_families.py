"""The method families of issue 23 on a tiny random Llama: each scorer and wrapper against its
formula computed eagerly, token by token, from transformers' own eager cache (not from the
method's ``scores()``), AdaKV's ragged bytes worked by hand, keep-all invariants."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from kvlab.catalog import knobs, method_markdown
from kvlab.methods import MethodError, Request, get_method

PREFIX = 2
SELECTION_KNOBS = {
    "budgets",
    "alpha_safeguard",
    "granularity",
    "chunk_size",
    "critical",
    "first_stage_ratio",
    "critical_epsilon",
}


@pytest.fixture(scope="module")
def ctx(templated):  # noqa: F811
    assert templated.prefix_len == PREFIX and templated.doc_len == 96
    return templated


@pytest.fixture(scope="module")
def eager(ctx, tiny_eager):
    """(keys, values) per layer, [H_kv, N, d] float64, from transformers' eager attention and its own cache."""
    cache = DynamicCache()
    with torch.no_grad():
        tiny_eager.model(input_ids=ctx.tokens.ids.unsqueeze(0), cache=cache, use_cache=True)
    out = [(layer.keys[0].double(), layer.values[0].double()) for layer in cache.layers]
    # The methods read kvlab's own prefill: it must be the same cache.
    assert all(torch.allclose(k.float(), ck, atol=1e-5) for (k, _), ck in zip(out, ctx.full.keys))
    return out


def kept(stored, ctx) -> list[list[set[int]]]:
    """Per layer and KV head, the document tokens a stored cache holds."""
    return [
        [
            {i - ctx.prefix_len for i in stored.fates(layer, head) if i >= ctx.prefix_len}
            for head in range(ctx.lm.n_kv_heads)
        ]
        for layer in range(ctx.lm.n_layers)
    ]


def best(score: list[float], k: int) -> set[int]:
    """The k positions of the highest scores (by a plain sort)."""
    return set(sorted(range(len(score)), key=lambda j: -score[j])[:k])


def assert_top(got: set, score: dict, k: int, tol: float = 1e-5) -> None:
    """``got`` is a top-k of ``score`` (key -> value): k keys, none scoring below one left out.

    The tolerance allows for float32 against float64 where two tokens (the same word 60
    positions apart) score alike."""
    assert len(got) == k
    left_out = [v for key, v in score.items() if key not in got]
    if left_out and k:
        assert min(score[key] for key in got) >= max(left_out) - tol, (sorted(got), k)


def compress(ctx, name: str, ratio: float, **options):
    return get_method(name, **options).compress(Request(ctx, ratio))


# --------------------------------------------------------------------------- eager formulas


def knorm_eager(eager, layer: int, head: int) -> list[float]:
    keys = eager[layer][0][head]
    return [-math.sqrt(sum(float(x) ** 2 for x in keys[j])) for j in range(PREFIX, keys.shape[0])]


def keydiff_eager(eager, layer: int, head: int) -> list[float]:
    keys = eager[layer][0][head].tolist()
    norm = lambda v: math.sqrt(sum(x * x for x in v))  # noqa: E731
    anchor = [sum(k[c] / norm(k) for k in keys) / len(keys) for c in range(len(keys[0]))]
    return [-sum(a * b for a, b in zip(k, anchor)) / (norm(k) * norm(anchor)) for k in keys[PREFIX:]]


def cur_eager(eager, layer: int, head: int, window: int, sinks: int) -> list[float]:
    keys, values = (x[head].tolist() for x in eager[layer])
    n = len(keys)

    def shares(rows):
        sq = [sum(x * x for x in r) for r in rows]
        return [sq[j] / sum(sq[(j // window) * window : (j // window + 1) * window]) for j in range(n)]

    score = [a * b for a, b in zip(shares(keys), shares(values))]
    total = sum(score)
    return [math.inf if j < sinks else score[j] / total for j in range(n)][PREFIX:]


def lagkv_eager(eager, layer: int, head: int, sink: int, lag: int, cross: bool = False) -> list[float]:
    keys, values = (x[head].tolist() for x in eager[layer])
    n = len(keys)
    n_parts = (n - sink) // lag
    score = [1.0] * n

    def part_scores(rows, p):
        ref = rows[sink + (p + 1) * lag : sink + (p + 2) * lag]
        lo = [min(r[c] for r in ref) for c in range(len(ref[0]))]
        hi = [max(r[c] for r in ref) for c in range(len(ref[0]))]
        stds = []
        for r in rows[sink + p * lag : sink + (p + 1) * lag]:
            x = [(r[c] - lo[c]) / (hi[c] - lo[c]) for c in range(len(r))]
            mean = sum(x) / len(x)
            stds.append(math.sqrt(sum((v - mean) ** 2 for v in x) / (len(x) - 1)))
        z = sum(math.exp(s) for s in stds)
        return [math.exp(s) / z for s in stds]

    for p in range(n_parts - 1):
        mixed = [(a + b) / 2 for a, b in zip(part_scores(keys, p), part_scores(values, p))]
        if cross:
            score[sink + p * lag : sink + (p + 1) * lag] = mixed
            continue
        order = sorted(range(lag), key=lambda i: mixed[i])
        for rank, i in enumerate(order):
            score[sink + p * lag + i] = rank / lag
    return score[PREFIX:]


def projected_norm_eager(ctx, eager, layer: int, kv_head: int) -> list[float]:
    """mean over the group's query heads h of || v_j W_o[:, h*d:(h+1)*d]^T ||_1."""
    lm = ctx.lm
    w = lm.model.model.layers[layer].self_attn.o_proj.weight.detach().double()
    d, group = lm.head_dim, lm.n_heads // lm.n_kv_heads
    values = eager[layer][1][kv_head]
    out = []
    for j in range(PREFIX, values.shape[0]):
        per_head = [
            float((w[:, h * d : (h + 1) * d] @ values[j]).abs().sum())
            for h in range(kv_head * group, (kv_head + 1) * group)
        ]
        out.append(sum(per_head) / group)
    return out


# --------------------------------------------------------------------------- scorers


@pytest.mark.parametrize("name, formula", [("knorm", knorm_eager), ("keydiff", keydiff_eager)])
@pytest.mark.parametrize("ratio", [2.0, 5.0])
def test_key_only_scorers_keep_their_formulas_top(ctx, eager, name, formula, ratio):
    stored = compress(ctx, name, ratio)
    budget = round(96 / ratio)
    for layer, heads in enumerate(kept(stored, ctx)):
        for head, got in enumerate(heads):
            assert_top(got, dict(enumerate(formula(eager, layer, head))), budget)


@pytest.mark.parametrize("window, ratio", [(16, 3.0), (7, 6.0)])
def test_cur_keeps_the_top_local_leverage_product(ctx, eager, window, ratio):
    stored = compress(ctx, "cur", ratio, local_window_size=window)
    budget = round(96 / ratio)
    for layer, heads in enumerate(kept(stored, ctx)):
        for head, got in enumerate(heads):
            assert_top(got, dict(enumerate(cur_eager(eager, layer, head, window, sinks=4))), budget, tol=1e-7)
            assert {0, 1} <= got  # context tokens 2 and 3 are sinks (num_sinks 4, prefix 2)


@pytest.mark.parametrize("cross", [False, True])
def test_lagkv_keeps_lag_relative_scores_sinks_and_tail(ctx, eager, cross):
    sink, lag = 4, 16
    stored = compress(ctx, "lagkv", 2.0, n_sink=sink, lag_size=lag, cross_scoring=cross)
    n = ctx.length
    tail = set(range(sink + (n - sink) // lag * lag - lag - PREFIX, 96))  # the last full partition and the rest
    for layer, heads in enumerate(kept(stored, ctx)):
        for head, got in enumerate(heads):
            expected = lagkv_eager(eager, layer, head, sink, lag, cross)
            assert_top(got, dict(enumerate(expected)), 48, tol=1e-9)
            assert tail <= got and {0, 1} <= got


def test_lagkv_on_a_short_context_keeps_the_newest(ctx):
    """Shorter than n_sink + 2 lag_size: no partition has a reference; the sinks (context tokens 0-3,
    i.e. document tokens 0 and 1) and then the newest are kept."""
    got = kept(compress(ctx, "lagkv", 4.0, lag_size=64), ctx)
    assert all(h == {0, 1} | set(range(74, 96)) for layer in got for h in layer)


# --------------------------------------------------------------------------- wrappers


def test_adakv_is_one_top_k_over_the_layer_with_a_floor(ctx, eager):
    ratio, alpha = 4.0, 0.5
    budget = 24
    floor = int(alpha * budget)
    stored = compress(ctx, "knorm", ratio, budgets="document", alpha_safeguard=alpha)
    got = kept(stored, ctx)
    lengths = set()
    for layer in range(ctx.lm.n_layers):
        scores = [knorm_eager(eager, layer, h) for h in range(ctx.lm.n_kv_heads)]
        for h, s in enumerate(scores):  # each head's own top floor first...
            assert_top({j for j in got[layer][h] if j in best(s, floor)}, dict(enumerate(s)), floor)
            lengths.add(len(got[layer][h]))
        # ... then one top-k over the rest of all heads
        safe = {(h, j) for h, s in enumerate(scores) for j in best(s, floor)}
        rest = {(h, j): s[j] for h, s in enumerate(scores) for j in range(96) if (h, j) not in safe}
        chosen = {(h, j) for h in range(ctx.lm.n_kv_heads) for j in got[layer][h]} - safe
        assert_top(chosen, rest, ctx.lm.n_kv_heads * (budget - floor))
    assert len(lengths) > 1  # the heads did get different budgets


def test_adakv_stores_the_bytes_of_the_tokens_it_keeps(ctx):
    """2 layers x 2 KV heads, head dim 16, float32: a kept token costs 2 * 16 * 4 = 128 bytes per head
    (key and value). At 4x each layer keeps 2 x (2 prefix + 24) tokens however its heads share them:
    2 * 52 * 128 = 13,312 bytes, ragged or not (a masking implementation would store all 98 per head:
    2 * 2 * 98 * 128 = 50,176)."""
    uniform = compress(ctx, "snapkv", 4.0)
    ada = compress(ctx, "snapkv", 4.0, budgets="document")
    per_head = ada.kept_per_head()
    assert int(per_head.sum()) == int(uniform.kept_per_head().sum()) == 2 * 2 * 26
    assert len(set(per_head.flatten().tolist())) > 1
    assert ada.nbytes == uniform.nbytes == 13_312


def test_adakv_with_a_full_safeguard_is_uniform(ctx):
    assert kept(compress(ctx, "keydiff", 3.0, budgets="document", alpha_safeguard=1.0), ctx) == kept(
        compress(ctx, "keydiff", 3.0), ctx
    )


@pytest.mark.parametrize("ratio", [3.2, 4.0])
def test_chunkkv_keeps_the_best_chunks_of_the_head_summed_scores(ctx, eager, ratio):
    """Chunks of 10 over the 96 document tokens (the last of 6); at 3.2x (30 tokens) three whole chunks,
    at 4x (24) two and the four best tokens of the third."""
    size, budget = 10, round(96 / ratio)
    stored = compress(ctx, "knorm", ratio, granularity="chunk", chunk_size=size)
    for layer, heads in enumerate(kept(stored, ctx)):
        summed = [sum(knorm_eager(eager, layer, h)[j] for h in range(ctx.lm.n_kv_heads)) for j in range(96)]
        chunks = [list(range(c, min(c + size, 96))) for c in range(0, 96, size)]
        chunks.sort(key=lambda c: -sum(summed[j] for j in c) / len(c))
        expected: set[int] = set()
        for c in chunks:
            left = budget - len(expected)
            expected |= set(c) if len(c) <= left else best_of(summed, c, left)
            if len(expected) == budget:
                break
        assert all(h == expected for h in heads)


def best_of(score: list[float], among: list[int], k: int) -> set[int]:
    return set(sorted(among, key=lambda j: -score[j])[:k])


@pytest.mark.parametrize("first_stage_ratio", [0.5, 0.0])
def test_criticalkv_two_stages_reweight_by_the_projected_value_norm(ctx, eager, first_stage_ratio):
    ratio, eps, budget = 4.0, 1e-4, 24
    stored = compress(
        ctx, "cur", ratio, num_sinks=0, critical=True, first_stage_ratio=first_stage_ratio, critical_epsilon=eps
    )
    for layer, heads in enumerate(kept(stored, ctx)):
        for head, got in enumerate(heads):
            s = cur_eager(eager, layer, head, 16, sinks=0)
            first = best(s, int(first_stage_ratio * budget))
            pn = projected_norm_eager(ctx, eager, layer, head)
            reweighted = [(s[j] + eps) * pn[j] if j not in first else math.inf for j in range(96)]
            assert_top(got, dict(enumerate(reweighted)), budget, tol=1e-7)
            assert first <= got


def test_criticalkv_with_every_pick_in_the_first_stage_is_the_method(ctx):
    assert kept(compress(ctx, "keydiff", 4.0, critical=True, first_stage_ratio=1.0), ctx) == kept(
        compress(ctx, "keydiff", 4.0), ctx
    )


@pytest.mark.parametrize("name", ["knorm", "lagkv", "snapkv", "kvzip"])
@pytest.mark.parametrize("options", [{"budgets": "document"}, {"granularity": "chunk"}, {"critical": True}])
def test_a_wrapper_at_ratio_one_keeps_everything(ctx, name, options):
    stored = compress(ctx, name, 1.0, **options)
    assert int(stored.kept_per_head().min()) == ctx.length


def test_wrappers_are_knobs_of_every_scoring_method_and_in_its_learn_text():
    for name in ["snapkv", "expected_attention", "tova", "kvzip", "h2o", "knorm", "cur"]:
        assert SELECTION_KNOBS <= {k.name for k in knobs(name)}
        assert "AdaKV" in method_markdown(name) and "`adakv`" in method_markdown(name)
    for name in ["random", "streaming_llm", "attention_matching"]:  # (AM has budgets of its own)
        assert not {"alpha_safeguard", "granularity", "critical"} & {k.name for k in knobs(name)}


def test_chunks_refuse_per_head_wrappers_in_one_line():
    with pytest.raises(MethodError, match="budgets=document needs granularity=token"):
        get_method("snapkv", budgets="document", granularity="chunk")
    with pytest.raises(MethodError, match="critical=true needs granularity=token"):
        get_method("tova", critical=True, granularity="chunk")
    with pytest.raises(MethodError, match="alpha_safeguard must be a number from 0 to 1"):
        get_method("knorm", alpha_safeguard=1.5)
