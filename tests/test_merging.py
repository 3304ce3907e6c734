"""The merging family (issue 34): CaM and kvpress's MergingPress against their formulas; key re-rotation.

Hand-worked examples with numbers for each rule's maths; then each method's stored cache of a tiny
random Llama against an eager float64 computation of its paper's (kvpress's) formula written here,
from transformers' eager attention and its own cache; keep-all logits; bytes by hand.
"""

from __future__ import annotations

import math
import typing

import pytest
import torch
from transformers import DynamicCache

from kvlab.methods import MethodError, Request, get_method
from kvlab.methods.cam import cam_merge, cam_merge_probability, cam_windows
from kvlab.methods.families.merging_core import SCORERS, kept_mask
from kvlab.methods.merging import EPS, fold_into_targets, merge_weights, nearest_kept
from kvlab.runtime.decode import extend, open_session


@pytest.fixture(scope="module")
def ctx(templated):  # noqa: F811
    assert templated.prefix_len == 2 and templated.doc_len == 96
    return templated


@pytest.fixture(scope="module")
def eager(ctx, tiny_eager):
    """Per layer (keys, values [H_kv, N, d], attention [H, N, N]) float64, from transformers' eager
    attention and its own cache."""
    cache = DynamicCache()
    with torch.no_grad():
        out = tiny_eager.model(
            input_ids=ctx.tokens.ids.unsqueeze(0), cache=cache, use_cache=True, output_attentions=True
        )
    layers = [
        (layer.keys[0].double(), layer.values[0].double(), att[0].double())
        for layer, att in zip(cache.layers, out.attentions)
    ]
    assert all(torch.allclose(k.float(), ck, atol=1e-5) for (k, _, _), ck in zip(layers, ctx.full.keys))
    return layers


def stored_tokens(stored, layer: int, head: int) -> dict[int, tuple[str, list[float]]]:
    """Context position -> (fate, stored value) for one layer and KV head of a stored cache."""
    out = {}
    for seg in stored.layers[layer]:
        view = seg.view()
        for slot, position in enumerate(view.token_index[head].tolist()):
            if position >= 0:
                out[position] = (seg.fate, view.values[head, slot].tolist())
    return out


def close(a: list[float], b: list[float], tol: float) -> bool:
    return all(abs(x - y) <= tol for x, y in zip(a, b)) and len(a) == len(b)


# --------------------------------------------------------------------------- CaM, by hand

# One head, six tokens: 1, 3, 4 kept; 0, 2, 5 evicted; merge_budget 2.
HAND_KEPT = torch.tensor([[1, 3, 4]])
HAND_ATTENTION = torch.tensor([[0.4, 0.2, 0.1, 0.4, 0.0, 0.3]])
HAND_VALUES = torch.tensor([[[2.0, 4.0], [1.0, 0.0], [6.0, -2.0], [0.0, 1.0], [3.0, 3.0], [9.0, 9.0]]])


def test_cam_windows_and_probabilities_by_hand():
    """Token 0's window is kept 1 and 3, token 2's kept 3 and 4, token 5 (after the last kept) has none.
    p_0 = min(1, 0.4 / mean(0.2, 0.4)) = 1; p_2 = 0.1 / mean(0.4, 0.0) = 0.5; p_5 = 0."""
    kept = kept_mask(HAND_KEPT, torch.tensor([3]), 6)
    assert kept.tolist() == [[False, True, False, True, True, False]]
    first, count = cam_windows(kept, torch.tensor([3]), 2)
    assert count.tolist() == [[2, 0, 2, 0, 0, 0]]
    assert first[0, 0] == 0 and first[0, 2] == 1  # kept ranks 0, 1 (tokens 1, 3) and 1, 2 (tokens 3, 4)
    p = cam_merge_probability(HAND_ATTENTION, HAND_KEPT, first, count)
    assert p[0].tolist() == pytest.approx([1.0, 0.0, 0.5, 0.0, 0.0, 0.0])
    # A window whose attention is 0 gives 1 (kvpress maps inf to 1), or 0 when A_i is 0 too (NaN).
    zero = torch.tensor([[0.3, 0.0, 0.0, 0.0, 0.0, 0.0]])
    assert cam_merge_probability(zero, HAND_KEPT, first, count)[0].tolist() == pytest.approx([1.0, 0, 0, 0, 0, 0])


def test_cam_merge_by_hand():
    """Both merge: v_1 = [1,0] + [2,4]/2 = [2,2]; v_3 = [0,1] + [2,4]/2 + [6,-2]/2 = [4,2];
    v_4 = [3,3] + [6,-2]/2 = [6,2]. Only token 2 merges: v_1 stays, v_3 = [3,0], v_4 = [6,2]."""
    kept = kept_mask(HAND_KEPT, torch.tensor([3]), 6)
    first, count = cam_windows(kept, torch.tensor([3]), 2)
    both = torch.tensor([[True, False, True, False, False, False]])
    values, absorbed = cam_merge(HAND_VALUES, HAND_KEPT, first, count, both)
    assert values[0].tolist() == [[2.0, 2.0], [4.0, 2.0], [6.0, 2.0]]
    assert absorbed.tolist() == [[True, True, True]]
    only_two = torch.tensor([[False, False, True, False, False, True]])  # token 5 has no window: nothing
    values, absorbed = cam_merge(HAND_VALUES, HAND_KEPT, first, count, only_two)
    assert values[0].tolist() == [[1.0, 0.0], [3.0, 0.0], [6.0, 2.0]]
    assert absorbed.tolist() == [[False, True, True]]


# --------------------------------------------------------------------------- MergingPress, by hand

# One head, four tokens: 0 and 2 kept (keys [1,0], [0,1]); 1 evicted (key [3,4]: cos 0.6 and 0.8,
# so into token 2), 3 evicted (key [2,0]: cos 1 with token 0).
MERGE_KEYS = torch.tensor([[[1.0, 0.0], [3.0, 4.0], [0.0, 1.0], [2.0, 0.0]]])
MERGE_VALUES = torch.tensor([[[1.0, 0.0], [0.0, 6.0], [0.0, 2.0], [3.0, 0.0]]])
MERGE_KEPT = torch.tensor([[0, 2]])


def hand_merge(threshold: float, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([2])
    similarity, target = nearest_kept(MERGE_KEYS, MERGE_KEPT, lengths)
    assert similarity[0, [1, 3]].tolist() == pytest.approx([0.8, 1.0]) and target[0, [1, 3]].tolist() == [1, 0]
    kept_values = MERGE_VALUES[:, [0, 2]]
    evicted = ~kept_mask(MERGE_KEPT, lengths, 4)
    norms = MERGE_VALUES.norm(dim=-1)
    weights = merge_weights(similarity, evicted, norms, kept_values.norm(dim=-1).gather(1, target), threshold, fraction)
    return fold_into_targets(kept_values, MERGE_VALUES, target, weights)


def test_merging_press_by_hand():
    """w_1 = 0.8 * 6 / (6 + 2 + eps) = 0.6: v_2 = ([0,2] + 0.6 [0,6]) / 1.6 = [0, 3.5];
    w_3 = 1 * 3 / (3 + 1 + eps) = 0.75: v_0 = ([1,0] + 0.75 [3,0]) / 1.75 = [13/7, 0]."""
    values, absorbed = hand_merge(0.0, 1.0)
    assert values[0].flatten().tolist() == pytest.approx([13 / 7, 0.0, 0.0, 3.5], abs=1e-6)
    assert absorbed.tolist() == [[True, True]]
    # similarity_threshold 0.9 gates token 1 (0.8) out; merge_fraction 0.5 too (the median of 0.8 and 1.0 is 0.9).
    for threshold, fraction in ((0.9, 1.0), (0.0, 0.5)):
        values, absorbed = hand_merge(threshold, fraction)
        assert values[0].flatten().tolist() == pytest.approx([13 / 7, 0.0, 0.0, 2.0], abs=1e-6)
        assert absorbed.tolist() == [[True, False]]


def test_merge_fraction_zero_is_refused():
    with pytest.raises(MethodError, match="merge_fraction"):
        get_method("merging", merge_fraction=0.0)


# --------------------------------------------------------------------------- the tiny model, eagerly


def h2o_attention(eager, ctx, layer: int, kv_head: int) -> list[float]:
    """A_j: attention received from the prefill's queries, per query that sees j, mean over the group."""
    att = eager[layer][2]
    n, group = att.shape[-1], ctx.lm.n_heads // ctx.lm.n_kv_heads
    heads = range(kv_head * group, (kv_head + 1) * group)
    return [sum(float(att[h, j:, j].sum()) / (n - j) for h in heads) / group for j in range(ctx.prefix_len, n)]


@pytest.mark.parametrize("options", [{}, {"merge_budget": 3, "seed": 5}, {"budgets": "document"}])
def test_cam_cache_is_its_formula(ctx, eager, options):
    """Every kept value of every layer and head is v_j + sum over the merged evicted i whose window
    (the next merge_budget kept tokens) holds j of v_i / |W_i|, with M_i = [u_i < p_i], u the
    documented draws (a CPU generator seeded seed * n_layers + layer), p_i from float64 attention."""
    method = get_method("cam", **options)
    opts = method.options
    stored = method.compress(Request(ctx, 4.0))
    prefix, n_doc, merges = ctx.prefix_len, ctx.doc_len, 0
    for layer in range(ctx.lm.n_layers):
        draws = torch.rand(
            (ctx.lm.n_kv_heads, n_doc), generator=torch.Generator().manual_seed(opts.seed * ctx.lm.n_layers + layer)
        )
        for head in range(ctx.lm.n_kv_heads):
            got = stored_tokens(stored, layer, head)
            kept = sorted(p - prefix for p, (fate, _) in got.items() if fate in ("kept", "merged"))
            attention = h2o_attention(eager, ctx, layer, head)
            values = eager[layer][1][head, prefix:].tolist()
            expected = {j: list(values[j]) for j in kept}
            absorbed = set()
            for i in range(n_doc):
                if i in expected:
                    continue
                window = [j for j in kept if j > i][: opts.merge_budget]
                if not window:
                    continue
                mean = sum(attention[j] for j in window) / len(window)
                p = min(1.0, attention[i] / mean) if mean > 0 else float(attention[i] > 0)
                if float(draws[head, i]) < p:
                    merges += 1
                    for j in window:
                        expected[j] = [a + b / len(window) for a, b in zip(expected[j], values[i])]
                        absorbed.add(j)
            for j in kept:
                fate, value = got[j + prefix]
                assert fate == ("merged" if j in absorbed else "kept")
                assert close(value, expected[j], 1e-5), (layer, head, j)
            # The template is stored as it is.
            assert all(got[p][0] == "template" for p in range(prefix))
    assert merges > 0


@pytest.mark.parametrize("options", [{}, {"similarity_threshold": 0.3}, {"merge_fraction": 0.6, "scorer": "snapkv"}])
def test_merging_press_cache_is_its_formula(ctx, eager, options):
    """Every kept value is kvpress's (v_c + sum_e w_e v_e) / (1 + sum_e w_e) over the evicted tokens
    whose most cosine-similar kept document key is c, w_e = max(s_e, 0) |v_e| / (|v_e| + |v_c| + eps),
    gated by the threshold and the merge_fraction quantile; computed in float64 from the eager cache."""
    method = get_method("merging", **options)
    opts = method.options
    stored = method.compress(Request(ctx, 4.0))
    prefix, n_doc, merges = ctx.prefix_len, ctx.doc_len, 0
    norm = lambda v: math.sqrt(sum(x * x for x in v))  # noqa: E731
    for layer in range(ctx.lm.n_layers):
        for head in range(ctx.lm.n_kv_heads):
            got = stored_tokens(stored, layer, head)
            kept = sorted(p - prefix for p, (fate, _) in got.items() if fate in ("kept", "merged"))
            keys = eager[layer][0][head, prefix:].tolist()
            values = eager[layer][1][head, prefix:].tolist()
            unit = [[x / max(norm(k), EPS) for x in k] for k in keys]
            evicted = [i for i in range(n_doc) if i not in set(kept)]
            best = {}
            for e in evicted:
                sims = [(sum(a * b for a, b in zip(unit[e], unit[c])), c) for c in kept]
                best[e] = max(sims)
            order = sorted(s for s, _ in best.values())
            # torch.quantile's linear interpolation at 1 - merge_fraction.
            at = (1 - opts.merge_fraction) * (len(order) - 1)
            cut = order[math.floor(at)] + (at - math.floor(at)) * (order[math.ceil(at)] - order[math.floor(at)])
            added = {c: [0.0] * len(values[0]) for c in kept}
            total = {c: 0.0 for c in kept}
            for e, (s, c) in best.items():
                if s < opts.similarity_threshold or (opts.merge_fraction < 1 and s < cut):
                    continue
                w = max(s, 0.0) * norm(values[e]) / (norm(values[e]) + norm(values[c]) + EPS)
                added[c] = [a + w * b for a, b in zip(added[c], values[e])]
                total[c] += w
            for c in kept:
                fate, value = got[c + prefix]
                expected = (
                    values[c] if total[c] == 0 else [(a + b) / (1 + total[c]) for a, b in zip(values[c], added[c])]
                )
                assert fate == ("merged" if total[c] > 0 else "kept")
                assert close(value, expected, 1e-5), (layer, head, c)
                merges += total[c] > 0
    assert merges > 0


# --------------------------------------------------------------------------- keep-all and bytes


@pytest.mark.parametrize("name", ["cam", "merging"])
def test_keep_all_is_the_full_cache(ctx, name):
    """Ratio 1 evicts nothing, so nothing merges: the logits of three fresh tokens are the full cache's."""
    stored = get_method(name).compress(Request(ctx, 1.0))
    assert all(seg.fate in ("template", "kept") for layer in stored.layers for seg in layer)
    tokens = torch.tensor([5, 9, 11])
    full = extend(ctx.lm, open_session(ctx.lm, ctx.full.stored), tokens)
    assert torch.allclose(extend(ctx.lm, open_session(ctx.lm, stored), tokens), full, atol=1e-5)


@pytest.mark.parametrize("name", ["cam", "merging"])
def test_bytes_are_the_kept_tokens(ctx, name):
    """4x of 96 document tokens keeps 24 per head plus the 2 template tokens: 2 layers x 2 KV heads
    x 26 tokens x (key + value) x 16 channels x 4 bytes = 13,312; AdaKV's ragged heads, their sum."""
    stored = get_method(name).compress(Request(ctx, 4.0))
    assert stored.nbytes == 2 * 2 * 26 * 2 * 16 * 4 == 13_312
    assert stored.breakdown() == {"full-precision keys+values": 13_312}
    ragged = get_method(name, budgets="document").compress(Request(ctx, 4.0))
    assert ragged.nbytes == int(ragged.kept_per_head().sum()) * 2 * 16 * 4


def test_merged_keys_are_the_kept_tokens_own(ctx):
    """Merging changes values only: each stored key is the full cache's key of its token."""
    for name in ("cam", "merging"):
        stored = get_method(name).compress(Request(ctx, 4.0))
        for layer in range(ctx.lm.n_layers):
            view = stored.layer_view(layer)
            for head in range(ctx.lm.n_kv_heads):
                real = view.token_index[head] >= 0
                assert torch.equal(view.keys[head][real], ctx.full.keys[layer][head, view.token_index[head][real]])


SCORER_CHOICES = [
    (name, scorer)
    for name in ("cam", "merging")
    for scorer in typing.get_args(typing.get_type_hints(get_method(name).Options)["scorer"])
]


@pytest.mark.parametrize(("name", "scorer"), SCORER_CHOICES)
def test_the_scorer_knob_keeps_what_the_named_method_keeps(ctx, name, scorer):
    """Each value of a merging method's ``scorer`` knob selects the tokens the registered method of that
    name keeps at its own defaults (kvlab.methods.families.merging_core.SCORERS, a table of the shared scorers,
    not a look-up of the method): only the values change."""
    assert scorer in SCORERS
    merged = get_method(name, scorer=scorer).compress(Request(ctx, 4.0))
    alone = get_method(scorer).compress(Request(ctx, 4.0))
    for layer in range(ctx.lm.n_layers):
        for head in range(ctx.lm.n_kv_heads):
            assert stored_tokens(merged, layer, head).keys() == stored_tokens(alone, layer, head).keys(), (layer, head)
