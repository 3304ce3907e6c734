"""BeaconKV (eviction and mixed precision) and its beacon core, on the tiny random Llama."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from kvlab.bounded.beacon import beacon_generate
from kvlab.context import Context
from kvlab.methods import MethodError, Request, get_method
from kvlab.methods.families.beacon_core import BeaconBank, BeaconOptions, farthest_point_sampling, max_attention_scores
from kvlab.methods.families.memory_plan import plan_memory
from kvlab.metrics import head_errors
from kvlab.pipeline import evaluation
from kvlab.prompts import ContextTokens
from kvlab.runtime.decode import greedy, prefill
from kvlab.runtime.hooks import QueryCapture
from kvlab.runtime.rope import rope_cos_sin, rotate, unrotate

PREFIX, DOC_LEN = 6, 96
QUESTION = "w3 w5 w8"


def make_context(lm, prefix: int = PREFIX, doc_len: int = DOC_LEN) -> Context:
    """A prepared context whose first ``prefix`` tokens play the chat template."""
    ids = torch.tensor([(i * 7) % 60 + 2 for i in range(prefix + doc_len)])
    capture = QueryCapture(lm.n_layers)
    full = prefill(lm, ids, capture)
    return Context(lm, "", ContextTokens(ids, prefix), full, 0.0, queries={"context": capture.per_layer()})


@pytest.fixture(scope="module")
def ctx(tiny):
    return make_context(tiny)


# --- beacon selection ---------------------------------------------------------


def _angles(*degrees: float) -> torch.Tensor:
    rad = torch.tensor(degrees) * math.pi / 180
    return torch.stack([rad.cos(), rad.sin()], dim=-1)


def test_fps_picks_the_farthest_points_by_cosine_distance():
    x = _angles(0, 10, 180, 90, 95).unsqueeze(0)
    # From point 0: 180 deg is farthest; then 90 deg (distance 1 to both) beats
    # 95 deg (0.91 to 180); then 10 deg (0.015) beats 95 deg (0.004 to 90).
    assert farthest_point_sampling(x, 4).tolist() == [[0, 2, 3, 1]]
    # Cosine distance ignores norms; rows are independent; k is capped at m.
    scaled = x.clone()
    scaled[0, 4] *= 100
    both = torch.cat([scaled, x[:, [2, 1, 0, 3, 4]]])
    assert farthest_point_sampling(both, 3).tolist() == [[0, 2, 3], [0, 2, 3]]
    assert farthest_point_sampling(x, 9).shape == (1, 5)


def test_continual_fps_is_bounded_and_keeps_an_early_rare_direction():
    gen = torch.Generator().manual_seed(0)
    d = 8
    dirs = torch.eye(d)
    early = dirs[0] + 0.05 * torch.randn(5, d, generator=gen)  # seen only at the start
    late = dirs[1 + torch.randint(0, 2, (400,), generator=gen)] + 0.05 * torch.randn(400, d, generator=gen)
    queries = torch.cat([early, late]).unsqueeze(0)  # one head
    bank = BeaconBank(n_beacons=4, capacity=32)
    for start in range(0, queries.shape[1], 7):
        bank.add(queries[:, start : start + 7], torch.arange(start, min(start + 7, queries.shape[1])))
        assert bank.buffer is None or bank.buffer.shape[1] < 32
        assert bank.beacons is None or bank.beacons.shape[1] <= 4
    beacons, positions = bank.current(1, d)
    assert beacons.shape == (1, 4, d)
    assert (positions < 5).any()  # the early direction survived 400 later queries
    assert torch.equal(beacons[0], queries[0, positions[0]])


def test_unrotate_inverts_the_models_rope(tiny):
    positions = torch.tensor([0, 1, 7, 100, 511])
    cos, sin = rope_cos_sin(tiny, positions)
    q = torch.randn(4, positions.numel(), tiny.head_dim, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(rotate(unrotate(q, cos, sin), cos, sin), q, atol=1e-5)
    assert torch.allclose(unrotate(rotate(q, cos, sin), cos, sin), q, atol=1e-5)
    ref, _ = apply_rotary_pos_emb(q.unsqueeze(0), q.unsqueeze(0), cos.unsqueeze(0), sin.unsqueeze(0))
    assert torch.allclose(rotate(q, cos, sin), ref[0], atol=1e-6)
    assert torch.allclose(unrotate(q[:, :1], cos[:1], sin[:1]), q[:, :1])  # position 0: identity


def test_unrotated_recorded_queries_are_the_pre_rope_projections(tiny):
    ids = torch.tensor([(i * 5) % 60 + 2 for i in range(20)])
    attn = tiny.model.model.layers[0].self_attn
    seen = []
    handle = attn.q_proj.register_forward_hook(lambda m, i, out: seen.append(out.detach()))
    try:  # q_proj seen in transformers' own forward; kvlab's prefill may run the lean pass (kvlab.runtime.lean)
        with torch.inference_mode():
            tiny.model(input_ids=ids.unsqueeze(0))
    finally:
        handle.remove()
    capture = QueryCapture(1)
    prefill(tiny, ids, capture)
    pre = seen[0][0].view(20, tiny.n_heads, tiny.head_dim).transpose(0, 1)
    cos, sin = rope_cos_sin(tiny, torch.arange(20))
    assert torch.allclose(unrotate(capture.layer(0), cos, sin), pre, atol=1e-5)


def test_max_attention_scores_are_the_max_over_queries_and_the_gqa_group():
    gen = torch.Generator().manual_seed(2)
    n_heads, n_kv, d, length = 4, 2, 16, 12
    queries = torch.randn(n_heads, 5, d, generator=gen)
    q_pos = torch.tensor([8, 9, 10, 12, 12])  # three recent queries, then two beacons at "now" = 12
    keys = torch.randn(n_kv, length, d, generator=gen)
    k_pos = torch.arange(length)
    got = max_attention_scores(queries, q_pos, keys, k_pos)
    want = torch.zeros(n_kv, length)
    for h in range(n_heads):
        kv = h // (n_heads // n_kv)
        for i in range(5):
            visible = k_pos <= q_pos[i]
            logits = keys[kv, visible] @ queries[h, i] / math.sqrt(d)
            w = torch.softmax(logits, dim=0)
            want[kv, visible] = torch.maximum(want[kv, visible], w)
    assert torch.allclose(got, want, atol=1e-6)
    assert (got[:, 11] > 0).all()  # seen by the beacons only
    # Keys in another order per head (as after evictions): the same scores, permuted.
    perm = torch.stack([torch.randperm(length, generator=gen) for _ in range(n_kv)])
    shuffled = max_attention_scores(queries, q_pos, keys.gather(1, perm.unsqueeze(-1).expand(-1, -1, d)), perm)
    assert torch.allclose(shuffled, want.gather(1, perm), atol=1e-6)


# --- BeaconKV (eviction) ------------------------------------------------------


def test_beaconkv_keeps_template_window_and_top_scores(ctx):
    method = get_method("beaconkv", window=8)
    req = Request(ctx, 4.0)
    scores = method.scores(req)
    stored = method.compress(req)
    budget = round(DOC_LEN / 4)
    for layer in range(ctx.lm.n_layers):
        for head in range(ctx.lm.n_kv_heads):
            fates = stored.fates(layer, head)
            assert {i for i, f in fates.items() if f == "template"} == set(range(PREFIX))
            assert {i for i, f in fates.items() if f == "kept"} == set(range(ctx.length - 8, ctx.length))
            top = torch.topk(scores[layer][head, : DOC_LEN - 8], budget - 8).indices + PREFIX
            assert {i for i, f in fates.items() if f == "beacon"} == set(top.tolist())
    beacons = stored.meta["beacon_positions"]
    assert len(beacons) == ctx.lm.n_layers and len(beacons[0]) == ctx.lm.n_heads
    assert all(len(row) == 16 and max(row) < ctx.length - 16 for layer in beacons for row in layer)


def eager_beacon_scores(ctx, opts) -> list[torch.Tensor]:
    """BeaconKV's key scores computed the slow way: per layer [H_kv, T_doc] float64, query by query.

    For each query of the scoring set (recent + beacons, from the method's beacon
    state), a softmax over the keys at or before its position, then the max over
    the queries and over the query heads of each KV head's group.
    """
    from kvlab.methods.families.beacon_core import document_state
    from kvlab.runtime.rope import rope_cos_sin

    state = document_state(ctx, opts, None)
    cos_now, sin_now = rope_cos_sin(ctx.lm, torch.tensor([ctx.length]))
    queries, q_pos, _ = state.scoring_set(cos_now, sin_now, ctx.length)
    n_heads, n_kv, d = ctx.lm.n_heads, ctx.lm.n_kv_heads, queries.shape[-1]
    out = []
    for layer in range(ctx.lm.n_layers):
        keys = ctx.full.keys[layer].double().cpu()
        best = torch.zeros(n_kv, ctx.length, dtype=torch.float64)
        for h in range(n_heads):
            g = h // (n_heads // n_kv)
            for i in range(queries.shape[1]):
                seen = int(min(q_pos[i] + 1, ctx.length))
                logits = keys[g, :seen] @ queries[layer * n_heads + h, i].double() / d**0.5
                best[g, :seen] = torch.maximum(best[g, :seen], torch.softmax(logits, dim=0))
        out.append(best[:, ctx.prefix_len :])
    return out


@pytest.mark.parametrize("name", ["beaconkv", "beaconkv_mixed"])
def test_importance_is_the_beacon_score(ctx, name):
    # The recorded importance against an eager, query-by-query computation of the published score.
    method = get_method(name)
    stored = method.compress(Request(ctx, 4.0, record_importance=True))
    for imp, score in zip(stored.importance, eager_beacon_scores(ctx, method.options), strict=True):
        assert imp.shape == (ctx.lm.n_kv_heads, ctx.length)
        assert torch.isnan(imp[:, :PREFIX]).all()
        torch.testing.assert_close(imp[:, PREFIX:].double(), score, atol=1e-5, rtol=1e-4)


def test_beacon_sources(ctx):
    assert not get_method("beaconkv").uses_question()
    assert get_method("beaconkv", beacon_source="question").uses_question()
    with pytest.raises(MethodError, match="question"):
        get_method("beaconkv", beacon_source="question").compress(Request(ctx, 4.0))
    asked = get_method("beaconkv", beacon_source="question").compress(Request(ctx, 4.0, QUESTION))
    told = get_method("beaconkv", beacon_source="instruction").compress(Request(ctx, 4.0))
    for stored in (asked, told):
        positions = [p for layer in stored.meta["beacon_positions"] for row in layer for p in row]
        assert min(positions) >= ctx.length  # read after the document
        assert (stored.kept_per_head() == PREFIX + round(DOC_LEN / 4)).all()
    with pytest.raises(MethodError, match="beacon_source"):
        get_method("beaconkv", beacon_source="nope")


@pytest.mark.parametrize(
    ("name", "options", "field"),
    [
        ("beaconkv", {"n_beacons": -1}, "n_beacons"),
        ("beaconkv", {"n_beacons": 0, "n_recent": 0}, "n_beacons \\+ n_recent"),
        ("beaconkv", {"buffer": 0}, "buffer"),
        ("beaconkv", {"window": 2.5}, "window"),
        ("beaconkv", {"beacon_instruction": " "}, "beacon_instruction"),
        ("beaconkv_mixed", {"rest": "1bit"}, "rest"),
        ("beaconkv_mixed", {"group_size": 0}, "group_size"),
        ("beaconkv_mixed", {"n_recent": -3}, "n_recent"),
    ],
)
def test_bad_options_are_refused_with_their_name(name, options, field):
    with pytest.raises(MethodError, match=f"^{name}: {field} must"):
        get_method(name, **options)


# --- BeaconKV mixed precision ------------------------------------------------


@pytest.mark.parametrize("rest", ["2bit", "4bit", "evict"])
@pytest.mark.parametrize("ratio", [3.0, 6.0, 12.0])
def test_mixed_precision_meets_the_memory_ratio(ctx, rest, ratio):
    stored = get_method("beaconkv_mixed", rest=rest).compress(Request(ctx, ratio))
    target = ctx.full.nbytes / ratio
    assert 0.97 * target <= stored.nbytes <= target
    fates = set(stored.fates(1, 1).values())
    assert "template" in fates
    if rest != "evict":
        assert f"{rest[0]}-bit" in fates
        assert stored.breakdown()[f"{rest[0]}-bit codes"] > 0
    else:
        assert not any(f.endswith("-bit") for f in fates)


def test_memory_plan_keeps_everything_when_all_low_bit_fits():
    plan = plan_memory(1000, 20, 4, 2, 64, 4, (1020 * 512) * 8, 4.0, 2, 32)
    assert ((plan.n_fp + plan.n_quant) == 1000).all()
    assert plan.target_bytes * 0.999 <= plan.planned_bytes <= plan.target_bytes
    tight = plan_memory(1000, 20, 4, 2, 64, 4, (1020 * 512) * 8, 20.0, 2, 32)
    assert (tight.n_fp == 0).all() and (tight.n_quant < 1000).all()
    assert tight.planned_bytes <= tight.target_bytes


def test_a_4_bit_rest_beats_evicting_it_at_the_same_memory(ctx):
    ev = evaluation(ctx, QUESTION, max_new_tokens=4)
    errors = {}
    for rest in ("4bit", "evict"):
        stored = get_method("beaconkv_mixed", rest=rest).compress(Request(ctx, 4.0))
        assert stored.nbytes <= ctx.full.nbytes / 4
        errors[rest] = head_errors(ctx.full.stored, stored, ev.queries).mean_output
    assert errors["4bit"] < errors["evict"]


# --- budgeted generation ----------------------------------------------------


def test_beacon_generate_stays_within_budget(ctx):
    prompt = torch.tensor([3, 5, 8, 13, 21])
    out = beacon_generate(ctx.lm, ctx, prompt, max_new_tokens=24, token_budget=48, stop=False)
    assert len(out.ids) == 24 and len(out.logprobs) == 24
    assert out.max_cache_len <= 48
    assert out.evictions >= 2
    # With room for everything it never evicts and is plain greedy decoding.
    roomy = beacon_generate(ctx.lm, ctx, prompt, max_new_tokens=8, token_budget=ctx.length + 64)
    assert roomy.evictions == 0
    assert roomy.ids == greedy(ctx.lm, ctx.full.stored, prompt, 8).ids
    with pytest.raises(MethodError, match="budget"):
        beacon_generate(ctx.lm, ctx, prompt, 4, token_budget=20, options=BeaconOptions(window=16))
