"""The compressed-cache runtime on a tiny random Llama: the invariants everything rests on."""

from __future__ import annotations

import math

import pytest
import torch

from kvlab.context import prepare_context
from kvlab.methods import Request
from kvlab.methods.families.scorers import KVzipOptions, kvzip_scores
from kvlab.prompts import repeat_tokens
from kvlab.queries import repeat_pass, repeat_queries
from kvlab.runtime import attention
from kvlab.runtime.attention import attend, attention_logits, causal_attention, matmul, softmax_
from kvlab.runtime.cache import CompressedKV, DenseSegment, FullKV, template_segment
from kvlab.runtime.decode import GrowingLayer, continuation_logprobs, extend, greedy, open_session, prefill
from kvlab.runtime.hooks import QueryCapture

T = 40


def context_ids(n: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, 64, (n,), generator=torch.Generator().manual_seed(seed))


def cache_from(
    full: FullKV, keep: list[list[torch.Tensor]], bias: list[list[torch.Tensor]] | None = None
) -> CompressedKV:
    """A stored cache keeping token indices keep[layer][head] (with optional per-key bias)."""
    layers = []
    for layer, heads in enumerate(keep):
        lengths = torch.tensor([len(h) for h in heads])
        width = int(lengths.max())
        index = torch.stack([torch.cat([h, h.new_zeros(width - len(h))]) for h in heads])
        gather = index.unsqueeze(-1).expand(-1, -1, full.keys[layer].shape[-1])
        b = None
        if bias is not None:
            b = torch.stack([torch.cat([x, x.new_zeros(width - len(x))]) for x in bias[layer]])
        layers.append(
            [
                DenseSegment.from_padded(
                    full.keys[layer].gather(1, gather), full.values[layer].gather(1, gather), lengths, index, b
                )
            ]
        )
    return CompressedKV(layers, full.length)


def logits_after(lm, stored: CompressedKV, ids: torch.Tensor) -> torch.Tensor:
    return extend(lm, open_session(lm, stored), ids)


def test_sdpa_path_matches_block_attention():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, 4, 1, 16, generator=gen),
        torch.randn(1, 2, 9, 16, generator=gen),
        torch.randn(1, 2, 9, 16, generator=gen),
    )
    bias = torch.randn(2, 9, generator=gen)
    fast = causal_attention(q, k, v, bias, 0.25)
    slow = attend(q[0].reshape(2, 2, 16), k[0], v[0], bias, 0.25).output.reshape(1, 4, 1, 16)
    assert torch.allclose(fast, slow, atol=1e-5)


def test_in_place_softmax_and_logits_written_into_a_buffer_match_the_plain_computation():
    gen = torch.Generator().manual_seed(4)
    q, k, bias = (
        torch.randn(3, 5, 8, generator=gen),
        torch.randn(3, 7, 8, generator=gen),
        torch.randn(3, 7, generator=gen),
    )
    bias[0, 2] = float("-inf")  # an absent key: weight 0, as torch.softmax gives it
    # Hand-written logits: every query against every key, scaled by 1/sqrt(d), plus the key's bias.
    expected = torch.einsum("hnd,htd->hnt", q, k) / 8**0.5 + bias.unsqueeze(1)
    buffer = torch.full((3, 5, 7), float("nan"))
    written = attention_logits(q, k, bias, out=buffer)
    assert written.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(written, expected, rtol=1e-5, atol=1e-6)
    reference = torch.softmax(expected, dim=-1)
    weights = softmax_(written)
    assert weights.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(weights, reference, rtol=1e-5, atol=1e-7)
    assert torch.all(weights[0, :, 2] == 0)


@pytest.mark.parametrize(
    "bias, block, flash", [(False, None, True), (True, None, True), (True, 2, True), (True, 2, False), (True, 3, True)]
)
def test_new_block_after_a_cache_sees_the_cache_and_its_own_past(bias, block, flash, monkeypatch):
    """Several queries appended after 7 cached keys (the extend path: no bias, or a
    stored cache's bias; read as a long text is: on a CPU the biased earlier keys apart from the text's
    own, in blocks of 2 or 3 queries; without the CPU kernel, as on a GPU, the queries in blocks of 2),
    against attention computed query by query."""
    if block is not None:
        monkeypatch.setattr(attention, "BIAS_BLOCK", block)
    if not flash:
        monkeypatch.setattr(attention, "_CPU_FLASH", None)
    gen = torch.Generator().manual_seed(1)
    n, past = 5, 7
    q = torch.randn(1, 4, n, 16, generator=gen)
    k, v = (torch.randn(1, 2, past + n, 16, generator=gen) for _ in range(2))
    key_bias = torch.randn(2, past, generator=gen) if bias else None
    fast = causal_attention(q, k, v, key_bias, 0.25)
    for i in range(n):
        seen = past + i + 1
        b = None if key_bias is None else torch.cat([key_bias, torch.zeros(2, i + 1)], dim=1)
        slow = attend(q[0, :, i : i + 1].reshape(2, 2, 16), k[0, :, :seen], v[0, :, :seen], b, 0.25).output
        assert torch.allclose(fast[0, :, i], slow.reshape(4, 16), atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("past", "n"), [(0, 12), (7, 5), (20, 5), (20, 1), (3, 1)])
def test_a_sliding_window_layer_sees_each_querys_last_window_keys(past, n, bias):
    """Window 6 (transformers' count: a query sees itself and the 5 keys before it), queries appended
    after ``past`` cached keys (a first chunk, a later chunk, a decode step; with a stored cache's
    bias or none), against attention query by query over exactly those keys."""
    window, gen = 6, torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, n, 16, generator=gen)
    k, v = (torch.randn(1, 2, past + n, 16, generator=gen) for _ in range(2))
    key_bias = torch.randn(2, past, generator=gen) if bias and past else None
    fast = causal_attention(q, k, v, key_bias, 0.25, window)
    for i in range(n):
        seen = past + i + 1
        first = max(0, seen - window)
        b = None if key_bias is None else torch.cat([key_bias, torch.zeros(2, n)], dim=1)[:, first:seen]
        slow = attend(q[0, :, i : i + 1].reshape(2, 2, 16), k[0, :, first:seen], v[0, :, first:seen], b, 0.25).output
        assert torch.allclose(fast[0, :, i], slow.reshape(4, 16), atol=1e-5)
    if past + n > window:  # the window bites: without it, the same keys give another answer
        assert not torch.allclose(fast, causal_attention(q, k, v, key_bias, 0.25), atol=1e-3)


@pytest.mark.parametrize(("past", "n", "window"), [(0, 9, None), (7, 5, None), (20, 1, None), (20, 5, 6), (20, 1, 6)])
def test_a_learned_sink_is_one_more_key_of_each_head_with_no_value(past, n, window):
    """GPT-OSS's sinks: each query head's sink logit joins the softmax (it takes mass, adds nothing),
    after a biased cache, with or without a window, against a softmax written out query by query."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, n, 16, generator=gen)
    k, v = (torch.randn(1, 2, past + n, 16, generator=gen) for _ in range(2))
    key_bias = torch.randn(2, past, generator=gen) if past else None
    sinks = torch.randn(4, generator=gen) * 2
    fast = causal_attention(q, k, v, key_bias, 0.25, window, sinks)
    bias = torch.zeros(2, past + n) if key_bias is None else torch.cat([key_bias, torch.zeros(2, n)], dim=1)
    for i in range(n):
        seen = past + i + 1
        first = 0 if window is None else max(0, seen - window)
        for h in range(4):
            logits = q[0, h, i] @ k[0, h // 2, first:seen].T * 0.25 + bias[h // 2, first:seen]
            weights = torch.softmax(torch.cat([logits, sinks[h : h + 1]]), dim=0)[:-1]
            assert torch.allclose(fast[0, h, i], weights @ v[0, h // 2, first:seen], atol=1e-5)
    assert not torch.allclose(fast, causal_attention(q, k, v, key_bias, 0.25, window), atol=1e-3)


def test_a_window_layer_holds_its_window_and_the_tokens_of_its_latest_read():
    """GrowingLayer with keep = window - 1: before each append the older keys go; the latest read's own
    tokens stay, so a rewind of them (kvlab.runtime.decode.rewind) leaves the window whole."""
    layer, keys = GrowingLayer(keep=5), torch.arange(40.0).view(1, 1, 40, 1)
    layer.update(keys[:, :, :12], keys[:, :, :12])
    assert layer.keys.flatten().tolist() == list(range(12))
    for t in range(12, 30):
        layer.update(keys[:, :, t : t + 1], keys[:, :, t : t + 1])
        assert layer.keys.flatten().tolist() == list(range(t - 5, t + 1))
    layer.update(keys[:, :, 30:38], keys[:, :, 30:38])
    assert layer.keys.flatten().tolist() == list(range(25, 38))
    layer.crop(layer.keys.shape[-2] - 3)  # rewind 3 of the 8 just read: the window before token 35 stays
    assert layer.keys.flatten().tolist() == list(range(25, 35))
    assert layer._k.shape[-2] <= 2 * 13  # the buffer stays about the window's size


def test_a_bf16_read_after_a_fitted_cache_keeps_the_biases_in_float32():
    # Two cached keys the queries cannot tell apart, biases 200.0 and 200.6: in bf16
    # both round to 200 (spacing 1 there) and each would get half the attention.
    q = torch.zeros(1, 2, 3, 8, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, 5, 8, dtype=torch.bfloat16)
    v = torch.zeros(1, 1, 5, 8, dtype=torch.bfloat16)
    v[0, 0, 1] = 1.0
    key_bias = torch.tensor([[200.0, 200.6]])
    out = causal_attention(q, k, v, key_bias, 0.25)
    # The new tokens' own keys (bias 0) get e^-200 of the mass: the two fitted keys take it all.
    expected = 1 / (1 + math.exp(-0.6))
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out[0, :, :, 0].float(), torch.full((2, 3), expected), atol=4e-3)


def test_keep_all_cache_reproduces_full_logits_over_8_steps(tiny, tiny_eager):
    ids = context_ids()
    full = prefill(tiny, ids)
    session = open_session(tiny, full.stored)
    seq = ids.clone()
    for _ in range(8):
        with torch.inference_mode():
            ref = tiny_eager.model(input_ids=seq.unsqueeze(0)).logits[0, -1]
        nxt = torch.tensor([int(ref.argmax())])
        seq = torch.cat([seq, nxt])
        ours = extend(tiny, session, nxt)[-1]
        with torch.inference_mode():
            ref_next = tiny_eager.model(input_ids=seq.unsqueeze(0)).logits[0, -1]
        assert (ours - ref_next).abs().max() < 1e-4


def test_prefill_in_chunks_equals_one_pass(tiny):
    ids = context_ids()
    one = prefill(tiny, ids, chunk_size=1000)
    chunked = prefill(tiny, ids, chunk_size=7)
    for a, b in zip(one.keys + one.values, chunked.keys + chunked.values):
        assert torch.allclose(a, b, atol=1e-5)


def test_bias_minus_inf_is_exactly_a_removed_key(tiny):
    full = prefill(tiny, context_ids())
    drop = 17
    all_idx = torch.arange(T)
    kept = all_idx[all_idx != drop]
    removed = cache_from(full, [[kept, kept] for _ in range(2)])
    bias = torch.zeros(T)
    bias[drop] = float("-inf")
    masked = cache_from(full, [[all_idx, all_idx] for _ in range(2)], [[bias, bias] for _ in range(2)])
    q = context_ids(6, seed=3)
    # Identical logits also prove that positions stayed logical: with physical
    # positions the removed-key cache would rotate the question differently.
    assert torch.allclose(logits_after(tiny, removed, q), logits_after(tiny, masked, q), atol=1e-6)


def test_bias_log2_equals_a_duplicated_key(tiny):
    full = prefill(tiny, context_ids())
    all_idx = torch.arange(T)
    dup = 5
    twice = torch.cat([all_idx, torch.tensor([dup])])
    duplicated = cache_from(full, [[twice, twice] for _ in range(2)])
    bias = torch.zeros(T)
    bias[dup] = math.log(2.0)
    weighted = cache_from(full, [[all_idx, all_idx] for _ in range(2)], [[bias, bias] for _ in range(2)])
    q = context_ids(6, seed=4)
    assert torch.allclose(logits_after(tiny, duplicated, q), logits_after(tiny, weighted, q), atol=1e-5)


def test_ragged_heads_decode_like_masked_full_length_heads(tiny):
    """Heads keeping different token sets (packed, padded only in the attention view)
    decode exactly like full-length heads whose evicted keys carry bias -inf."""
    full = prefill(tiny, context_ids())
    gen = torch.Generator().manual_seed(7)
    keep, bias = [], []
    for _ in range(2):
        heads, biases = [], []
        for n in (9, 23):
            idx = torch.sort(torch.randperm(T, generator=gen)[:n]).values
            heads.append(idx)
            b = torch.full((T,), float("-inf"))
            b[idx] = 0.0
            biases.append(b)
        keep.append(heads)
        bias.append(biases)
    ragged = cache_from(full, keep)
    assert ragged.kept_per_head().tolist() == [[9, 23], [9, 23]]
    all_idx = torch.arange(T)
    masked = cache_from(full, [[all_idx, all_idx] for _ in range(2)], bias)
    q = context_ids(5, seed=8)
    assert torch.allclose(logits_after(tiny, ragged, q), logits_after(tiny, masked, q), atol=1e-5)
    assert ragged.nbytes < masked.nbytes


def test_positions_continue_from_logical_length(tiny):
    full = prefill(tiny, context_ids())
    small = cache_from(full, [[torch.arange(5), torch.arange(5)] for _ in range(2)])
    session = open_session(tiny, small)
    assert session.position == T
    extend(tiny, session, context_ids(3, seed=2))
    assert session.position == T + 3


def test_answering_never_changes_the_stored_cache(tiny):
    full = prefill(tiny, context_ids())
    stored = cache_from(full, [[torch.arange(0, T, 2), torch.arange(1, T, 3)] for _ in range(2)])
    before = [(s.keys.clone(), s.values.clone()) for layer in stored.layers for s in layer]
    first = greedy(tiny, stored, context_ids(4, seed=5), max_new_tokens=6)
    continuation_logprobs(tiny, stored, context_ids(4, seed=5), torch.tensor(first.ids or [3]))
    second = greedy(tiny, stored, context_ids(4, seed=5), max_new_tokens=6)
    after = [(s.keys, s.values) for layer in stored.layers for s in layer]
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(before, after))
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(before, after))
    assert first.ids == second.ids


def test_greedy_matches_teacher_forced_scores(tiny):
    full = prefill(tiny, context_ids())
    prompt = context_ids(4, seed=6)
    gen = greedy(tiny, full.stored, prompt, max_new_tokens=5)
    scored = continuation_logprobs(tiny, full.stored, prompt, torch.tensor(gen.ids))
    assert torch.allclose(scored, torch.tensor(gen.logprobs), atol=1e-4)


def test_bytes_count_what_is_stored(tiny):
    full = prefill(tiny, context_ids())
    assert full.stored.nbytes == full.nbytes == 2 * 2 * 2 * T * 16 * 4
    half = cache_from(full, [[torch.arange(T // 2)] * 2 for _ in range(2)])
    assert half.nbytes == full.nbytes // 2
    b = [[torch.zeros(T // 2)] * 2 for _ in range(2)]
    with_bias = cache_from(full, [[torch.arange(T // 2)] * 2 for _ in range(2)], b)
    assert with_bias.breakdown()["biases"] == 2 * 2 * (T // 2) * 4


def test_a_block_with_no_key_has_zero_output_and_mass():
    q, k, v = torch.randn(2, 3, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    bias = torch.zeros(2, 4)
    bias[1] = float("-inf")  # head 1 keeps nothing of this block
    out = attend(q, k, v, bias)
    assert torch.isfinite(out.output).all() and (out.output[1] == 0).all()
    assert torch.isneginf(out.lse[1]).all() and torch.isfinite(out.lse[0]).all()


def test_template_segment_stores_the_first_tokens_of_every_head():
    gen = torch.Generator().manual_seed(3)
    keys, values = torch.randn(2, 10, 4, generator=gen), torch.randn(2, 10, 4, generator=gen)
    seg = template_segment(keys, values, 3)
    view = seg.view()
    assert seg.fate == "template" and seg.lengths().tolist() == [3, 3]
    assert torch.equal(view.keys, keys[:, :3]) and torch.equal(view.values, values[:, :3])
    assert view.token_index.tolist() == [[0, 1, 2], [0, 1, 2]] and (view.bias == 0).all()


def test_one_repeat_pass_serves_attention_matching_and_kvzip(tiny):
    ctx = prepare_context(tiny, " ".join(f"w{(i * 7) % 60 + 2}" for i in range(40)))
    forwards = []
    # Every pass over the model embeds its tokens, whichever forward runs it (kvlab.runtime.lean or transformers').
    handle = tiny.model.get_input_embeddings().register_forward_hook(lambda *args: forwards.append(1))
    try:
        queries = repeat_queries(ctx)
        passes = len(forwards)
        kvzip_scores(Request(ctx, 4.0), KVzipOptions())
    finally:
        handle.remove()
    assert passes >= 1 and len(forwards) == passes  # KVzip read nothing more
    # Reference: one plain prefill of context + repeat turn; the pass is its tail.
    repeat = repeat_tokens(tiny.tokenizer, ctx.tokens.ids[ctx.prefix_len :])
    capture = QueryCapture(tiny.n_layers)
    whole = prefill(tiny, torch.cat([ctx.tokens.ids, repeat]), capture)
    recorded = repeat_pass(ctx)
    assert recorded.queries is queries
    for layer in range(tiny.n_layers):
        assert torch.allclose(recorded.queries[layer], capture.layer(layer)[:, ctx.length :], atol=1e-5)
        assert torch.allclose(recorded.keys[layer], whole.keys[layer][:, ctx.length :], atol=1e-5)


def test_an_answer_checked_against_a_draft_is_the_greedy_answer(tiny):
    """greedy_from_draft against plain greedy decoding and the teacher-forced scores, for drafts the
    cache follows all the way, part of the way, not at all, and one longer than the answer may be."""
    from kvlab.runtime.decode import greedy_from_draft

    full = prefill(tiny, context_ids())
    keep = [[torch.arange(0, T, 2)] * tiny.n_kv_heads for _ in range(tiny.n_layers)]
    bias = [[torch.linspace(-1, 1, T // 2)] * tiny.n_kv_heads for _ in range(tiny.n_layers)]
    stored = cache_from(full, keep, bias)
    prompt = context_ids(5, seed=3)
    own = greedy(tiny, stored, prompt, 10).ids
    other = greedy(tiny, full.stored, prompt, 10).ids
    drafts = [own, other, own[:4] + [(own[4] + 1) % 60 + 2] + own[5:], context_ids(12, seed=9).tolist(), []]
    for draft in drafts:
        got = greedy_from_draft(tiny, stored, prompt, draft, 10)
        assert got.generation.ids == own
        shared = next((i for i, (a, b) in enumerate(zip(draft, own)) if a != b), min(len(draft), len(own)))
        assert got.accepted == min(shared, 10)
        if draft:
            m = min(len(draft), 10)
            target = torch.tensor(draft[:m])
            assert torch.allclose(got.draft_logprobs, continuation_logprobs(tiny, stored, prompt, target), atol=1e-5)
        assert torch.allclose(
            torch.tensor(got.generation.logprobs), torch.tensor(greedy(tiny, stored, prompt, 10).logprobs), atol=1e-5
        )


@pytest.mark.parametrize("bias_shape", [None, (2, 9), (2, 2, 7)])
def test_a_batched_decode_step_matches_block_attention(bias_shape):
    """One query per head, two sequences, over 9 keys (a bias on the first 7 or all of them): against
    :func:`attend` per sequence, the stored keys' bias padded with zeros for the keys after them."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (
        torch.randn(2, 4, 1, 16, generator=gen),
        torch.randn(2, 2, 9, 16, generator=gen),
        torch.randn(2, 2, 9, 16, generator=gen),
    )
    bias = None if bias_shape is None else torch.randn(*bias_shape, generator=gen)
    fast = causal_attention(q, k, v, bias, 0.25)
    for b in range(2):
        full = None
        if bias is not None:
            mine = bias if bias.dim() == 2 else bias[b]
            full = torch.cat([mine, mine.new_zeros(2, 9 - mine.shape[-1])], dim=-1)
        slow = attend(q[b].reshape(2, 2, 16), k[b], v[b], full, 0.25).output.reshape(4, 1, 16)
        assert torch.allclose(fast[b], slow, atol=1e-5)


@pytest.mark.parametrize(
    "a_shape, b_shape, transposed",
    [
        ((3, 40, 16), (3, 16, 24), False),  # the loop of 2-D products
        ((2, 3, 40, 16), (2, 3, 16, 24), True),  # two leading dims, b a transposed view
        ((2, 3, 40, 16), (1, 3, 16, 24), False),  # broadcast: torch.matmul's own
        ((70, 5, 8), (70, 8, 6), False),  # more matrices than the loop takes
        ((3, 0, 16), (3, 16, 24), False),  # no rows (a head that keeps no key): an empty product
        ((3, 6, 0), (3, 0, 4), False),  # an empty inner dim: zeros
    ],
)
def test_matmul_is_the_float64_product(a_shape, b_shape, transposed):
    """kvlab.runtime.attention.matmul against the same product in float64, into a fresh output and
    into a given one; the tolerance is float32's accumulated rounding over the inner dim."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(a_shape, generator=gen)
    b = torch.randn(b_shape, generator=gen)
    if transposed:
        b = b.mT.contiguous().mT
    want = torch.matmul(a.double(), b.double())
    magnitude = a.abs().double() @ b.abs().double()
    tol = 4 * a.shape[-1] * torch.finfo(torch.float32).eps * (magnitude.max().item() if magnitude.numel() else 0.0)
    out = torch.full(want.shape, float("nan"))
    for got in (matmul(a, b), matmul(a, b, out=out)):
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=0.0)
    assert matmul(a, b, out=out) is out
