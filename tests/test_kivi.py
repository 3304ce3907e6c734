"""QuantSegment (KIVI packed storage inside a stored cache) and the KIVI method, on the tiny model."""

from __future__ import annotations

import pytest
import torch

from kvlab.context import prepare_context
from kvlab.methods import MethodError, Request, get_method
from kvlab.methods.families.memory_plan import plan_memory
from kvlab.metrics import head_errors
from kvlab.pipeline import evaluation
from kvlab.runtime.cache import CompressedKV, DenseSegment
from kvlab.runtime.decode import extend, greedy, open_session
from kvlab.runtime.quant_segment import QuantSegment, quant_nbytes

DOC = " ".join(f"w{(i * 11) % 60 + 2}" for i in range(80))
QUESTION = "w3 w5 w8"


@pytest.fixture(scope="module")
def ctx(tiny):
    return prepare_context(tiny, DOC)


def quantized_cache(ctx, bits: int, group_size: int = 32) -> CompressedKV:
    """Every token of every head in one QuantSegment."""
    layers = []
    for k, v in zip(ctx.full.keys, ctx.full.values):
        n_heads, length = k.shape[:2]
        index = torch.arange(length).expand(n_heads, length)
        layers.append([QuantSegment.quantize(k, v, torch.full((n_heads,), length), index, bits, group_size)])
    return CompressedKV(layers, ctx.length)


def next_logits(ctx, stored):
    return extend(ctx.lm, open_session(ctx.lm, stored), torch.tensor([5, 9, 11]))[-1]


def test_8_bit_decodes_like_dense_and_2_bit_error_is_bounded(ctx):
    ev = evaluation(ctx, QUESTION, max_new_tokens=4)
    full = ctx.full.stored
    q8, q4, q2 = (quantized_cache(ctx, b) for b in (8, 4, 2))
    ref = next_logits(ctx, full)
    assert (next_logits(ctx, q8) - ref).abs().max() < 0.02 * ref.abs().max()
    prompt = torch.tensor([3, 5, 8])
    assert greedy(ctx.lm, q8, prompt, 6).ids == greedy(ctx.lm, full, prompt, 6).ids
    e8, e4, e2 = (head_errors(full, q, ev.queries).mean_output for q in (q8, q4, q2))
    assert e8 < 0.01
    assert e8 < e4 < e2 < 0.5


def test_nbytes_is_codes_plus_scales_and_zeros(ctx):
    """Ragged heads: each head's tokens are quantised alone; bytes = what is stored."""
    k, v = ctx.full.keys[0], ctx.full.values[0]
    d = k.shape[-1]
    lengths = torch.tensor([37, 5])
    index = torch.stack([torch.arange(40), torch.arange(40, 80)])
    gather = index.unsqueeze(-1).expand(-1, -1, d)
    seg = QuantSegment.quantize(k.gather(1, gather), v.gather(1, gather), lengths, index, bits=2, group_size=16)
    # By hand (2 bits, groups of 16, d = 16; a float16 scale and zero are 4 B per group).
    # Head 0, 37 tokens: codes 37 * 16 * 2 / 8 = 148 B for the keys and 148 for the values; keys
    # are grouped per channel along the tokens, 16 * ceil(37 / 16) = 48 groups = 192 B; values
    # per token along the channels, 37 * 1 = 37 groups = 148 B.
    # Head 1, 5 tokens: codes 20 + 20 B; keys 16 * 1 groups = 64 B; values 5 groups = 20 B.
    assert quant_nbytes(37, d, 2, 16) == 148 + 148 + 192 + 148 == 636
    assert quant_nbytes(5, d, 2, 16) == 20 + 20 + 64 + 20 == 124
    assert seg.breakdown() == {"2-bit codes": 148 + 148 + 20 + 20, "scales+zeros": 192 + 148 + 64 + 20}
    assert seg.nbytes == 636 + 124
    assert [b.heads for b in seg.blocks] == [[1], [0]]  # one block per distinct token count
    # The counted bytes are the buffers really held: uint8 codes, float16 scales and zeros.
    stored = [p for b in seg.blocks for p in (b.keys, b.values)]
    assert sum(p.codes.numel() for p in stored) == 336 and sum(p.scale.numel() + p.zero.numel() for p in stored) == 212
    assert all(p.codes.dtype == torch.uint8 and p.scale.dtype == p.zero.dtype == torch.float16 for p in stored)
    # The view is dequantised and padded like a dense segment's.
    view = seg.view()
    assert view.keys.shape == (2, 37, d)
    assert torch.isinf(view.bias[1, 5:]).all() and (view.bias[1, :5] == 0).all()
    assert view.token_index[1, :5].tolist() == list(range(40, 45)) and (view.token_index[1, 5:] == -1).all()
    assert torch.allclose(view.keys[0], k[0, :37], atol=(k[0, :37].abs().max() / 2).item())
    assert seg.fate == "2-bit" and seg.lengths().tolist() == [37, 5]


def test_packing_heads_together_changes_nothing_but_calls(ctx):
    k, v = ctx.full.keys[1], ctx.full.values[1]
    n_heads, length = k.shape[:2]
    index = torch.arange(length).expand(n_heads, length)
    together = QuantSegment.quantize(k, v, torch.full((n_heads,), length), index, 2).view()
    for h in range(n_heads):
        alone = QuantSegment.quantize(k[h : h + 1], v[h : h + 1], torch.tensor([length]), index[:1], 2).view()
        assert torch.equal(together.keys[h], alone.keys[0]) and torch.equal(together.values[h], alone.values[0])


def test_fates_show_quantised_tokens(ctx):
    k, v = ctx.full.keys[0], ctx.full.values[0]
    n_heads = k.shape[0]
    first, rest = torch.arange(10).expand(n_heads, 10), torch.arange(10, 80).expand(n_heads, 70)
    dense = DenseSegment.from_padded(k[:, :10], v[:, :10], torch.full((n_heads,), 10), first)
    quant = QuantSegment.quantize(k[:, 10:], v[:, 10:], torch.full((n_heads,), 70), rest, 4)
    stored = CompressedKV([[dense, quant]], ctx.length)
    fates = stored.fates(0, 1)
    assert {fates[i] for i in range(10)} == {"kept"} and {fates[i] for i in range(10, 80)} == {"4-bit"}


def test_kivi_quantises_everything_but_the_residual(ctx):
    stored = get_method("kivi", bits=2, group_size=32).compress(Request(ctx, 2.0))
    fates = stored.fates(1, 0)
    residual = ctx.doc_len % 32
    assert len(fates) == ctx.length  # nothing evicted at a ratio the 2-bit cache meets
    assert {fates[i] for i in range(ctx.length - residual, ctx.length)} == {"kept"}
    assert {fates[i] for i in range(ctx.prefix_len, ctx.length - residual)} == {"2-bit"}
    # By hand, per layer and KV head (d = 16, float32): the full cache holds 80 tokens * 16 * 4 B * 2
    # = 10,240 B. KIVI keeps the 80 % 32 = 16 newest at full precision (2,048 B) and quantises 64:
    # codes 64 * 16 * 2 / 8 = 256 B each for keys and values, scales and zeros 4 B per group,
    # 16 channels * 2 token groups for the keys (128 B) and 64 tokens * 1 group for the values
    # (256 B): 2,944 B. Two layers of two heads: 40,960 B against 11,776 B.
    assert ctx.full.nbytes == 40960 and stored.nbytes == 11776
    assert stored.breakdown() == {"full-precision keys+values": 8192, "2-bit codes": 2048, "scales+zeros": 1536}
    assert stored.meta["memory_ratio"] == pytest.approx(40960 / 11776)  # fixed by the bits, above the requested 2


def test_kivi_evicts_the_oldest_when_the_ratio_asks_for_more(ctx):
    stored = get_method("kivi", bits=4).compress(Request(ctx, 12.0))
    assert stored.nbytes <= ctx.full.nbytes / 12
    kept = [[len(stored.fates(i, h)) for h in range(ctx.lm.n_kv_heads)] for i in range(ctx.lm.n_layers)]
    for i, row in enumerate(kept):
        for h, n in enumerate(row):  # each head keeps its newest tokens
            assert sorted(stored.fates(i, h)) == list(range(ctx.length - n, ctx.length))
    evicted = ctx.doc_len - torch.tensor(kept, dtype=torch.float64).mean()
    assert stored.meta["evicted_tokens_mean"] == pytest.approx(float(evicted), abs=1e-9) and evicted > 0


def test_kivi_plan_keeps_the_most_newest_tokens_that_fit():
    doc_len, d, bits, group, heads = 50, 16, 4, 8, 6
    residual = doc_len % group
    fp = 2 * d * 4  # float32 key + value

    def cost(n: int) -> int:  # the newest n tokens: the residual at full precision, the rest quantised
        dense = min(n, residual)
        return dense * fp + quant_nbytes(n - dense, d, bits, group)

    full = heads * doc_len * fp
    plan = plan_memory(doc_len, 0, 2, 3, d, 4, full, 9.0, bits, group, fp_newest=residual)
    share = (full // 9) // heads
    brute = max(n for n in range(1, doc_len + 1) if cost(n) <= share)  # what every head can afford alone
    kept = (plan.n_fp + plan.n_quant).flatten().tolist()
    assert min(kept) == brute and (plan.n_fp == residual).all()
    assert sum(cost(n) for n in kept) == plan.planned_bytes <= plan.target_bytes == full // 9
    # What rounding left over was spent: no head could store one more token with the rest.
    left = plan.target_bytes - plan.planned_bytes
    assert all(n == doc_len or cost(n + 1) - cost(n) > left for n in kept)


@pytest.mark.parametrize(
    ("options", "field"),
    [({"bits": 3}, "bits"), ({"bits": 16}, "bits"), ({"bits": True}, "bits"), ({"group_size": 0}, "group_size")],
)
def test_kivi_refuses_unsupported_options(options, field):
    with pytest.raises(MethodError, match=f"^kivi: {field} must"):
        get_method("kivi", **options)
