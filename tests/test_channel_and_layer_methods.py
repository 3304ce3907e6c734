"""ThinK (key channels pruned, kvlab.methods.think) and SimLayerKV (lazy layers, kvlab.methods.simlayerkv),
checked against the papers' formulas computed eagerly in float64 here, and hand-worked examples."""

from __future__ import annotations

import pytest
import torch

from conftest import TINY_DOC
from kvlab.methods import Request, get_method
from kvlab.methods.simlayerkv import laziness, lazy_budgets
from kvlab.runtime.cache import DenseSegment
from kvlab.runtime.channel_segment import ChannelSegment
from kvlab.runtime.decode import extend, open_session

DOC = TINY_DOC


def logits_of(ctx, stored):
    return extend(ctx.lm, open_session(ctx.lm, stored), torch.tensor([5, 9, 11]))


def key_rows(stored, layer, head):
    """Context position -> (stored key as attention sees it, float64) of one head."""
    view = stored.layer_view(layer)
    real = view.token_index[head] >= 0
    return dict(zip(view.token_index[head, real].tolist(), view.keys[head, real].double()))


# ThinK ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [2.0, 4.0])
def test_think_prunes_the_channels_the_papers_score_ranks_lowest(templated, ratio):
    """Per layer and KV head: the stored keys are SnapKV's tokens (the same positions), and the kept
    channels are the top d - floor(0.4 d) of the paper's score ||Q_w[:, j] K[:, j]^T||_F, the outer
    product formed explicitly in float64, Q_w the window's queries of the group's query heads stacked,
    K every stored key (template included); the pruned channels are zero in the view, the kept ones the
    full cache's keys."""
    ctx = templated
    lam, window = 0.4, 32
    think = get_method("think", key_channel_compression_ratio=lam, window_size=window, recent_size=0)
    stored = think.compress(Request(ctx, ratio))
    snap = get_method("snapkv").compress(Request(ctx, ratio))
    d = ctx.lm.head_dim
    n_pruned = int(d * lam)  # 6 of 16
    group = ctx.lm.n_heads // ctx.lm.n_kv_heads
    for layer in range(ctx.lm.n_layers):
        q_all = ctx.queries["context"][layer][:, -window:].double()  # [H, w, d]
        full_keys = ctx.full.keys[layer].double()
        for head in range(ctx.lm.n_kv_heads):
            assert set(stored.fates(layer, head)) == set(snap.fates(layer, head))
            positions = sorted(snap.fates(layer, head))
            keys = full_keys[head, positions]  # [N, d]
            queries = q_all[head * group : (head + 1) * group].reshape(-1, d)  # the group's queries stacked
            score = torch.tensor(
                [torch.linalg.matrix_norm(torch.outer(queries[:, j], keys[:, j])).item() for j in range(d)],
                dtype=torch.float64,
            )
            expected = set(torch.topk(score, d - n_pruned).indices.tolist())
            rows = key_rows(stored, layer, head)
            kept = {j for j in range(d) if any(rows[p][j] != 0 for p in positions)}
            assert kept == expected
            for p in positions:
                want = full_keys[head, p].clone()
                want[[j for j in range(d) if j not in expected]] = 0
                assert torch.equal(rows[p], want)


def test_think_keeps_the_recent_tokens_keys_whole_and_counts_real_bytes(templated):
    """The context's last recent_size tokens keep every channel; the others are stored with d - 6 of
    16 channels; the bytes are the hand count of what is stored (float32 here): per pruned token 10
    key channels + 16 value channels, per whole token 32 elements, 2-byte channel indices per head
    and segment."""
    ctx, recent = templated, 8
    stored = get_method("think", recent_size=recent).compress(Request(ctx, 4.0))
    d, c = ctx.lm.head_dim, ctx.lm.head_dim - int(ctx.lm.head_dim * 0.4)
    expected_bytes = 0
    for layer in range(ctx.lm.n_layers):
        for head in range(ctx.lm.n_kv_heads):
            rows = key_rows(stored, layer, head)
            for p, key in rows.items():
                whole, full_key = p >= ctx.length - recent, ctx.full.keys[layer][head, p].double()
                stored_channels = key != 0  # random keys have no zero channel
                assert int(stored_channels.sum()) == (d if whole else c)
                assert torch.equal(key[stored_channels], full_key[stored_channels])
                expected_bytes += 4 * (2 * d if whole else c + d)
        n_channel_segments = sum(isinstance(s, ChannelSegment) for s in stored.layers[layer])
        expected_bytes += n_channel_segments * ctx.lm.n_kv_heads * c * 2
    assert stored.nbytes == expected_bytes
    assert stored.kept_per_head().float().mean().item() == ctx.prefix_len + round(ctx.doc_len / 4)
    assert stored.meta["memory_ratio"] == ctx.full.nbytes / expected_bytes


def test_a_channel_segments_bytes_by_hand():
    """2 heads keeping 3 and 2 tokens of 3 slots, head dim 8, 3 channels each, float32: keys
    5 x 3 x 4 = 60 bytes, values 5 x 8 x 4 = 160, channel indices 2 x 3 x 2 = 12."""
    keys, values = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    index = torch.tensor([[0, 4, 7], [1, 2, -1]])
    seg = ChannelSegment.from_padded(keys, values, torch.tensor([3, 2]), index, torch.tensor([[5, 0, 2], [1, 3, 7]]))
    assert seg.breakdown() == {"key channels kept": 60, "full-precision values": 160, "channel indices": 12}
    assert seg.nbytes == 232
    assert seg.lengths().tolist() == [3, 2]


def test_q_dot_k_over_the_view_is_q_dot_k_over_the_kept_channels_only():
    """Against the sum over the kept channels written out in float64; padding is an absent key."""
    torch.manual_seed(0)
    keys, values = torch.randn(2, 4, 8, dtype=torch.float64), torch.randn(2, 4, 8, dtype=torch.float64)
    channels = torch.tensor([[6, 1, 3], [0, 7, 4]])
    lengths = torch.tensor([4, 2])
    index = torch.tensor([[10, 11, 12, 13], [20, 21, -1, -1]])
    view = ChannelSegment.from_padded(keys, values, lengths, index, channels).view()
    q = torch.randn(2, 5, 8, dtype=torch.float64)
    got = q @ view.keys.transpose(1, 2)
    for h in range(2):
        for t in range(int(lengths[h])):
            for i in range(5):
                want = sum(q[h, i, j] * keys[h, t, j] for j in channels[h].tolist())
                assert abs(float(got[h, i, t]) - float(want)) < 1e-12
    assert torch.equal(view.values[1, :2], values[1, :2]) and torch.equal(view.values[0], values[0])
    assert view.token_index.tolist() == index.tolist()
    assert view.bias[1, 2:].eq(float("-inf")).all() and view.bias[0].eq(0).all() and view.bias[1, :2].eq(0).all()


def test_keep_all_settings_give_the_full_logits(templated):
    """Ratio 1 is the full cache; no channel pruned is the evictor's cache, to the bit; every channel kept
    by a segment views as the keys themselves."""
    ctx = templated
    full = logits_of(ctx, ctx.full.stored)
    assert torch.equal(logits_of(ctx, get_method("think").compress(Request(ctx, 1.0))), full)
    no_pruning = get_method("think", key_channel_compression_ratio=0.0).compress(Request(ctx, 2.0))
    snap = get_method("snapkv").compress(Request(ctx, 2.0))
    assert torch.equal(logits_of(ctx, no_pruning), logits_of(ctx, snap))
    keys, values = ctx.full.keys[0], ctx.full.values[0]
    n_kv, length, d = keys.shape
    lengths = torch.full((n_kv,), length)
    index = torch.arange(length).expand(n_kv, length)
    every = torch.arange(d).expand(n_kv, d)
    view = ChannelSegment.from_padded(keys, values, lengths, index, every).view()
    dense = DenseSegment.from_padded(keys, values, lengths, index).view()
    assert torch.equal(view.keys, dense.keys) and torch.equal(view.values, dense.values)


def test_think_refuses_pruning_every_channel_and_an_unknown_evictor():
    with pytest.raises(ValueError, match="below 1"):
        get_method("think", key_channel_compression_ratio=1.0)
    with pytest.raises(ValueError, match="evict_with must be a scoring method"):
        get_method("think", evict_with="kivi")


# SimLayerKV -------------------------------------------------------------------------------------


def test_laziness_is_the_attention_share_on_what_a_lazy_layer_keeps():
    """A hand-made pattern: one query head, one query (the last of 10 tokens), head dim 1, scale 1 and
    keys k_j = log w_j, so the attention weights are w exactly; a lazy layer keeping tokens 0-1 and 8-9
    gets w_0 + w_1 + w_8 + w_9."""
    w = torch.tensor([0.30, 0.05, 0.02, 0.03, 0.04, 0.06, 0.05, 0.05, 0.10, 0.30], dtype=torch.float64)
    keys = w.log().view(1, 10, 1)
    query = torch.ones(1, 1, 1, dtype=torch.float64)
    kept = torch.tensor([True, True, False, False, False, False, False, False, True, True])
    assert laziness(query, keys, kept, scale=1.0) == pytest.approx(0.75, abs=1e-6)
    # Two query heads over the one KV head, the second attending uniformly: the share is their mean.
    queries = torch.tensor([[[1.0]], [[0.0]]], dtype=torch.float64)
    assert laziness(queries, keys, kept, scale=1.0) == pytest.approx((0.75 + 0.4) / 2, abs=1e-6)


@pytest.mark.parametrize(
    ("n_layers", "doc_len", "budget", "window", "expected"),
    [
        # 4 layers, T = 100, B = 50, window 20: ceil(4 x 50 / 80) = 3 lazy layers keep 200 - 100 = 100 tokens.
        (4, 100, 50, 20, (3, [34, 33, 33])),
        # T = 96, B = 12 (8x), the paper's window 1028 > B: every layer lazy, each keeps B.
        (2, 96, 12, 1028, (2, [12, 12])),
        # T = 96, B = 64, window 12: ceil(2 x 32 / 84) = 1 lazy layer keeps 128 - 96 = 32.
        (2, 96, 64, 12, (1, [32])),
        (3, 96, 96, 12, (0, [])),  # ratio 1: nobody is lazy
        (0, 96, 24, 12, (0, [])),  # every layer a sliding window's (Mistral v0.1): none to compress
    ],
)
def test_lazy_budgets_by_hand(n_layers, doc_len, budget, window, expected):
    assert lazy_budgets(n_layers, doc_len, budget, window) == expected


def test_simlayerkv_makes_the_laziest_layer_lazy_and_keeps_the_hand_worked_sets(templated):
    """1.5x on 96 document tokens, n_initial 4, n_recent 8: B = 64, one layer goes lazy (above) and keeps
    32 document tokens: the template (0-1), the document's first 2 (the rest of the 4 initial tokens:
    2-3) and its newest 30 (68-97). It is the layer whose last query puts more attention on those,
    computed here in float64; the other layer keeps every token."""
    ctx = templated
    method = get_method("simlayerkv", n_initial=4, n_recent=8, n_last=1)
    stored = method.compress(Request(ctx, 1.5))
    lazy_set = {0, 1, 2, 3} | set(range(68, 98))
    group = ctx.lm.n_heads // ctx.lm.n_kv_heads
    shares = []
    for layer in range(ctx.lm.n_layers):
        q = ctx.queries["context"][layer][:, -1].double()  # [H, d], the context's last query
        keys = ctx.full.keys[layer].double().repeat_interleave(group, dim=0)  # [H, T, d]
        scale = ctx.lm.geometry[layer].scaling
        weights = torch.softmax(torch.einsum("hd,htd->ht", q, keys) * scale, dim=-1).mean(dim=0)  # [T]
        shares.append(float(weights[sorted(lazy_set)].sum()))
    lazy = max(range(ctx.lm.n_layers), key=lambda i: shares[i])
    assert stored.meta["lazy_layers"] == [lazy]
    assert stored.meta["laziness"][lazy] == pytest.approx(shares[lazy], abs=1e-5)
    assert stored.meta["implied_threshold"] == pytest.approx(shares[lazy], abs=1e-5)
    assert stored.meta["window_shrunk"] is False
    for layer in range(ctx.lm.n_layers):
        for head in range(ctx.lm.n_kv_heads):
            want = lazy_set if layer == lazy else set(range(ctx.length))
            assert set(stored.fates(layer, head)) == want
    assert stored.kept_per_head().float().mean().item() == ctx.prefix_len + 64


def test_simlayerkv_reports_a_shrunk_window_when_the_papers_cannot_meet_the_ratio(templated):
    """The paper's 1024 recent tokens are above the 24 that 4x leaves: every layer is lazy with
    the budget's window (the template, 2 more initial tokens, the newest 22), and the details say so."""
    ctx = templated
    stored = get_method("simlayerkv").compress(Request(ctx, 4.0))
    assert stored.meta["window_shrunk"] is True
    assert stored.meta["lazy_layers"] == list(range(ctx.lm.n_layers))
    assert stored.meta["lazy_layer_tokens"] == [24] * ctx.lm.n_layers
    for layer in range(ctx.lm.n_layers):
        for head in range(ctx.lm.n_kv_heads):
            assert set(stored.fates(layer, head)) == {0, 1, 2, 3} | set(range(76, 98))
