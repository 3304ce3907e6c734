"""The baseline methods (H2O, TOVA, PyramidKV, KVzip, Expected Attention, random, no
context, summarisation) on the tiny random Llama: kept sets, scores against a naive
computation with transformers' eager attention, budgets."""

from __future__ import annotations

import pytest
import torch

from kvlab.compression.scoring import received_attention
from kvlab.context import prepare_context
from kvlab.methods import Request, get_method
from kvlab.methods.families.scorers import KVzipOptions, h2o_scores, kvzip_scores, tova_scores
from kvlab.methods.families.summary import write_summary
from kvlab.methods.pyramidkv import pyramid_budgets
from kvlab.prompts import REPEAT_INSTRUCTION, question_tokens
from kvlab.runtime.decode import extend, open_session, prefill

DOC = " ".join(f"w{(i * 11) % 60 + 2}" for i in range(96))
EVICTION = ["h2o", "tova", "pyramidkv", "kvzip", "expected_attention", "random"]


@pytest.fixture(scope="module")
def ctx(tiny):
    return prepare_context(tiny, DOC)


def eager_attentions(lm, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer [H, n, n] attention weights of transformers' own eager attention."""
    with torch.inference_mode():
        out = lm.model(input_ids=ids.unsqueeze(0), output_attentions=True)
    return [a[0].float() for a in out.attentions]


def kept_doc(stored, ctx, layer: int, head: int) -> set[int]:
    return {i - ctx.prefix_len for i in stored.fates(layer, head) if i >= ctx.prefix_len}


@pytest.mark.parametrize("name", EVICTION)
def test_kept_sets_are_the_top_scores(ctx, name):
    method = get_method(name)
    req = Request(ctx, 4.0)
    scores, budgets = method.scores(req), method.head_budgets(req)
    stored = method.compress(req)
    for layer in range(ctx.lm.n_layers):
        for head in range(ctx.lm.n_kv_heads):
            k = int(budgets[layer, head])
            top = set(torch.topk(scores[layer][head], k).indices.tolist()) if k else set()
            assert kept_doc(stored, ctx, layer, head) == top
            # The template prefix is always kept.
            assert set(range(ctx.prefix_len)) <= set(stored.fates(layer, head))


def test_h2o_scores_match_eager_attention(ctx, tiny_eager):
    n, g = ctx.length, ctx.lm.n_heads // ctx.lm.n_kv_heads
    attn = eager_attentions(tiny_eager, ctx.tokens.ids)
    ours = h2o_scores(Request(ctx, 4.0))
    for layer, a in enumerate(attn):
        naive = a.sum(dim=1) / torch.arange(n, 0, -1)  # key j is seen by n - j queries
        naive = naive.reshape(ctx.lm.n_kv_heads, g, n).mean(dim=1)[:, ctx.prefix_len :]
        assert torch.allclose(ours[layer], naive, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("reduce", ["sum", "max"])
@pytest.mark.parametrize("causal", [True, False])
def test_received_attention_in_small_blocks_matches_one_dense_softmax(reduce, causal):
    # Blocks of 1, 2 and 3 query rows (GQA 3: each KV head read by 3 query heads)
    # against one dense [H, n, T] softmax written out with the keys copied per head.
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(6, 7, 8, generator=gen), torch.randn(2, 11, 8, generator=gen)
    logits = q @ k.repeat_interleave(3, dim=0).transpose(1, 2) / 8**0.5  # [6, 7, 11]
    if causal:  # query i is token 4 + i of the 11
        logits = logits.masked_fill(torch.arange(11) > 4 + torch.arange(7).unsqueeze(1), float("-inf"))
    dense = torch.softmax(logits, dim=-1)
    expected = dense.sum(dim=1) if reduce == "sum" else dense.amax(dim=1)
    for rows in (1, 2, 3):
        got = received_attention(q, k, reduce=reduce, causal=causal, block_elements=rows * 6 * 11)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_h2o_keeps_its_recent_window(ctx):
    req = Request(ctx, 4.0)
    stored = get_method("h2o", recent_share=0.5).compress(req)
    recent = set(range(ctx.doc_len - round(0.5 * req.doc_budget), ctx.doc_len))
    assert all(recent <= kept_doc(stored, ctx, 0, h) for h in range(ctx.lm.n_kv_heads))


def test_tova_scores_match_eager_attention(ctx, tiny_eager):
    attn = eager_attentions(tiny_eager, ctx.tokens.ids)
    ours = tova_scores(Request(ctx, 4.0))
    for layer, a in enumerate(attn):
        naive = a[:, -1, ctx.prefix_len :].mean(dim=0)  # last query, mean over all heads
        for head in range(ctx.lm.n_kv_heads):
            assert torch.allclose(ours[layer][head, :-1], naive[:-1], rtol=1e-4, atol=1e-6)
            assert ours[layer][head, -1] == float("inf")


def test_kvzip_scores_match_eager_attention_during_reconstruction(ctx, tiny_eager):
    assert ctx.prefix_len == 0  # the tiny model has no template: the softmax runs over every key
    repeat = torch.cat([question_tokens(ctx.lm.tokenizer, REPEAT_INSTRUCTION), ctx.tokens.ids[ctx.prefix_len :]])
    attn = eager_attentions(tiny_eager, torch.cat([ctx.tokens.ids, repeat]))
    ours = kvzip_scores(Request(ctx, 4.0), KVzipOptions())
    g = ctx.lm.n_heads // ctx.lm.n_kv_heads
    for layer, a in enumerate(attn):
        rows = a[:, ctx.length :, : ctx.length].amax(dim=1)  # max over reconstruction queries
        naive = rows.reshape(ctx.lm.n_kv_heads, g, -1).amax(dim=1)
        assert torch.isinf(ours[layer][:, :4]).all()  # sinks (no template: the document's first tokens)
        assert torch.allclose(ours[layer][:, 4:], naive[:, 4:], rtol=1e-4, atol=1e-6)


def test_kvzip_global_pruning_is_ragged_with_the_uniform_total(ctx):
    method = get_method("kvzip")
    req = Request(ctx, 4.0)
    budgets = method.head_budgets(req)
    assert int(budgets.sum()) == req.doc_budget * budgets.numel()
    assert budgets.unique().numel() > 1
    stored = method.compress(req)
    assert torch.equal(stored.kept_per_head(), budgets + ctx.prefix_len)
    # The kept (layer, head, token) triples are the global top of all scores.
    scores = torch.stack(method.scores(req))
    top = torch.topk(scores.flatten(), int(budgets.sum())).indices
    kept = {
        (layer * ctx.lm.n_kv_heads + head) * ctx.doc_len + i
        for layer in range(ctx.lm.n_layers)
        for head in range(ctx.lm.n_kv_heads)
        for i in kept_doc(stored, ctx, layer, head)
    }
    assert kept == set(top.tolist())
    layerwise = get_method("kvzip", prune="layer").head_budgets(req)
    assert (layerwise.sum(dim=1) == req.doc_budget * ctx.lm.n_kv_heads).all()


def test_pyramid_budgets_decrease_with_depth_and_keep_the_total(ctx):
    for n_layers, budget, length in [(30, 515, 2059), (30, 1030, 2059), (24, 3, 100), (2, 24, 96)]:
        b = pyramid_budgets(n_layers, budget, length, beta=20)
        assert int(b.sum()) == n_layers * budget
        assert (b[1:] <= b[:-1]).all() and b[0] > b[-1]
        assert b.min() >= 1 and b.max() <= length
    assert (pyramid_budgets(30, 50, 200, beta=1) == 50).all()
    req = Request(ctx, 4.0)
    per_head = get_method("pyramidkv").head_budgets(req)
    assert int(per_head.sum()) == req.doc_budget * per_head.numel()
    assert (per_head[0] > per_head[-1]).all()


def test_random_is_seeded(ctx):
    req = Request(ctx, 4.0)
    a, b = get_method("random", seed=1).scores(req), get_method("random", seed=1).scores(req)
    c = get_method("random", seed=2).scores(req)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])


def test_no_context_keeps_only_the_prefix_whatever_the_ratio(ctx):
    for ratio in (1.0, 8.0):
        stored = get_method("no_context").compress(Request(ctx, ratio))
        assert stored.logical_len == ctx.prefix_len
        assert (stored.kept_per_head() == ctx.prefix_len).all()
        assert stored.nbytes < ctx.full.nbytes


@pytest.mark.parametrize("fill", [True, False])
def test_summarisation_cache_is_the_summary_context(ctx, fill):
    req = Request(ctx, 8.0)
    stored = get_method("summarisation", fill_budget=fill).compress(req)
    n_summary = stored.meta["summary_tokens"]
    assert isinstance(stored.meta["summary"], str)
    assert 1 <= n_summary <= req.doc_budget and (n_summary == req.doc_budget or not fill)
    assert stored.logical_len == ctx.prefix_len + n_summary
    assert (stored.kept_per_head() == stored.logical_len).all()
    assert not stored.fates(0, 0) or max(stored.fates(0, 0)) < ctx.prefix_len  # no document token kept
    # Reading after it is reading after a fresh prefill of prefix + summary (greedy: the same ids again).
    lm, opts = ctx.lm, get_method("summarisation", fill_budget=fill).options
    prompt = question_tokens(lm.tokenizer, stored.meta["summary_prompt"])
    ids = write_summary(lm, ctx.full.stored, prompt, req.doc_budget, fill)
    fresh = prefill(lm, torch.cat([ctx.tokens.ids[: ctx.prefix_len], torch.tensor(ids, dtype=torch.long)])).stored
    probe = torch.tensor([5, 9, 11])
    assert len(ids) == n_summary and opts.fill_budget == fill
    assert torch.allclose(
        extend(lm, open_session(lm, stored), probe), extend(lm, open_session(lm, fresh), probe), atol=1e-5
    )


def test_summary_am_with_an_empty_summary_keeps_only_the_prefix(templated, monkeypatch):
    """A summary that decodes to nothing (a random 8B-shaped model on the GPU wrote ids past its byte
    tokenizer's vocabulary) leaves the template alone: reading after it is reading after the prefix."""
    from kvlab.methods import summary_am

    ctx = templated

    special = ctx.lm.tokenizer.all_special_ids[0]  # dropped by decode(skip_special_tokens=True)
    monkeypatch.setattr(summary_am, "write_summary", lambda *args, **kwargs: [special, special])
    stored = get_method("summary_am").compress(Request(ctx, 8.0))
    assert stored.meta["summary"] == "" and stored.logical_len == ctx.prefix_len
    fresh = prefill(ctx.lm, ctx.tokens.ids[: ctx.prefix_len]).stored
    probe = torch.tensor([5, 9, 11])
    assert torch.allclose(
        extend(ctx.lm, open_session(ctx.lm, stored), probe),
        extend(ctx.lm, open_session(ctx.lm, fresh), probe),
        atol=1e-5,
    )
