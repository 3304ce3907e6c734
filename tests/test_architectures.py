"""The architectures researchers use, as tiny random models: every family through kvlab's invariants.

Each family of :data:`kvlab.testing.random_models.FAMILIES` (Llama with Llama 3.1's RoPE
scaling, Qwen2, Qwen3, Mistral, Gemma 3) runs its own transformers modelling
code; kvlab replaces only the attention function. So do the layouts with
sliding-window layers (:data:`WINDOWED`: Gemma 3 as released, with a window
shorter than the test document, a local and a global RoPE and
query_pre_attn_scalar != head_dim; Mistral v0.1's window at every layer;
Qwen2's window above max_window_layers), and GPT-OSS (a learned attention
sink per head, YaRN RoPE, mixture-of-experts MLPs, local and global layers),
built here (:func:`tiny_gpt_oss`). The reference is always
transformers' own eager attention on a twin with the same weights (its own
masks, sliding windows included), never kvlab's own output. What kvlab does
not handle (logit softcapping, bidirectional attention) is refused in one
line at load time.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import sys

import pytest
import torch
from test_methods import assert_meets_budget
from test_runtime import cache_from, logits_after
from transformers import (
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    PreTrainedModel,
)

from kvlab.bounded.loop import run_policy
from kvlab.bounded.policies import bounded_policies, make_policy
from kvlab.compression.scoring import received_attention
from kvlab.context import prepare_context
from kvlab.methods import REGISTRY, Request, get_method
from kvlab.metrics import reference_attention
from kvlab.models import load_model
from kvlab.pipeline import run
from kvlab.runtime.attention import attention_weights, expand_kv_heads
from kvlab.runtime.cache import CompressedKV, FullKV, keep_windows
from kvlab.runtime.decode import extend, open_session, prefill
from kvlab.runtime.hooks import QueryCapture, use_kvlab_attention
from kvlab.runtime.model import LoadedModel, ModelLoadError, check_supported
from kvlab.runtime.rope import rope_cos_sin, rotate, unrotate
from kvlab.testing.device_suite import run_step, steps, suite_model
from kvlab.testing.fake_cuda import FAKE_DEVICE, fake_cuda, to_fake_cuda
from kvlab.testing.random_models import FAMILIES, SPECIAL_IDS, TINY, perturb_constant_init, random_model, word_tokenizer

T = 40
W = 16  # the windowed layouts' sliding window: shorter than T and than the document

#: Gemma 3's two RoPEs as released: local layers theta 10,000, global ones 1,000,000.
GEMMA3_ROPES = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
}

#: The layouts with sliding-window layers: (family, config on top of the family's tiny one).
WINDOWED = {
    # Gemma 3 as released: two local layers then a global one, per-type RoPEs, and (as Gemma 3 27B,
    # query_pre_attn_scalar 168 with head_dim 128) a scaling other than 1/sqrt(head_dim).
    "gemma3-released": ("gemma3", {"sliding_window": W, "rope_parameters": GEMMA3_ROPES, "query_pre_attn_scalar": 8}),
    "mistral-v0.1": ("mistral", {"sliding_window": W}),  # a window at every layer
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": W, "max_window_layers": 1}),
}
#: GPT-OSS's YaRN (factor 32, as released) over a 16-token original context: 512 positions in all.
GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 16,
    "rope_theta": 150000.0,
}
#: Every architecture of the matrix: name -> (family, config overrides).
ARCHITECTURES = {name: (name, {}) for name in FAMILIES} | WINDOWED | {"gpt-oss": ("gpt_oss", {})}


def tiny_gpt_oss() -> LoadedModel:
    """A tiny random GPT-OSS (not a kvlab.testing.random_models family): the shared :data:`TINY` geometry, 4 experts
    (2 per token), a local layer (window W) and a global one, and sinks large enough to matter (the
    released model's are of order 1 to 5, transformers initialises them near 0)."""
    torch.manual_seed(0)
    config = GptOssConfig(
        **{
            **TINY,
            **SPECIAL_IDS,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": W,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": copy.deepcopy(GPT_OSS_ROPE),
        }
    )
    model = GptOssForCausalLM(config).eval()
    perturb_constant_init(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(config.num_attention_heads) * 2)
    check_supported(model, "tiny-gpt-oss")
    use_kvlab_attention(model)
    return LoadedModel("tiny-gpt-oss", model, word_tokenizer(64), torch.device("cpu"), torch.float32)


# Longer than SnapKV's default 64-query observation window (a shorter document fails there).
DOC = " ".join(f"w{(i * 7) % 60 + 2}" for i in range(72))
QUESTION = "w3 w5 w8"


def ids_of(n: int, seed: int) -> torch.Tensor:
    """[n] seeded random token ids of the word vocabulary (w0..w61)."""
    return torch.randint(2, 64, (n,), generator=torch.Generator().manual_seed(seed))


def eager_twin(lm: LoadedModel) -> PreTrainedModel:
    """The same weights under transformers' own eager attention (its own config: the attention
    implementation lives on the config, and sharing it would switch ``lm`` to eager too)."""
    twin = type(lm.model)(copy.deepcopy(lm.model.config)).eval()
    twin.load_state_dict(lm.model.state_dict())
    twin.set_attn_implementation("eager")
    return twin


def attention_modules(lm: LoadedModel) -> list[torch.nn.Module]:
    return [layer.self_attn for layer in lm.model.model.layers]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices gain nothing from threads, and on a shared 2-core machine the thread pools of
    parallel processes spin against each other (a 2-layer forward pass went from 1 to 75 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def arch(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def family(arch) -> str:
    return ARCHITECTURES[arch][0]


@pytest.fixture(scope="module")
def lm(arch) -> LoadedModel:
    return tiny_gpt_oss() if arch == "gpt-oss" else random_model(*ARCHITECTURES[arch])


@pytest.fixture(scope="module")
def ref(lm) -> PreTrainedModel:
    return eager_twin(lm)


@pytest.fixture(scope="module")
def ctx(lm):
    return prepare_context(lm, DOC)


# --- the family is what it says ------------------------------------------------------------------


def test_each_tiny_model_has_its_familys_features(arch, family, lm):
    attn = attention_modules(lm)
    model_class = GptOssForCausalLM if family == "gpt_oss" else FAMILIES[family].model_class
    assert type(lm.model).__name__ == model_class.__name__
    assert all(a.q_proj.bias is None for a in attn) == (family not in ("qwen2", "gpt_oss"))
    if family == "qwen2":  # random biases, not transformers' zeros
        assert all(a.q_proj.bias.abs().min() > 0 and a.k_proj.bias is not None for a in attn)
    assert all(hasattr(a, "q_norm") and hasattr(a, "k_norm") for a in attn) == (family in ("qwen3", "gemma3"))
    if family == "llama":
        rotary = lm.model.model.rotary_emb
        d = lm.head_dim
        plain = 500000.0 ** -(torch.arange(0, d, 2, dtype=torch.float32, device=lm.device) / d)
        scaled = ~torch.isclose(rotary.inv_freq, plain)
        assert rotary.rope_type == "llama3" and scaled.any() and not scaled.all()  # some bands scaled
    if arch == "gemma3":
        assert [a.sliding_window for a in attn] == [512, 512, None]  # interleaved local and global
        assert all(a.scaling == lm.head_dim**-0.5 for a in attn)
    if family == "gpt_oss":
        assert all(a.sinks.abs().min() > 0.05 for a in attn) and lm.model.model.rotary_emb.attention_scaling != 1
    windows = {"gemma3-released": [W, W, None], "mistral-v0.1": [W, W], "qwen2-window": [None, W], "gpt-oss": [W, None]}
    assert [g.window for g in lm.geometry] == windows.get(arch, [None] * lm.n_layers)
    if arch == "gemma3-released":
        assert all(a.scaling == 8**-0.5 != lm.head_dim**-0.5 for a in attn)
        assert [g.scaling for g in lm.geometry] == [a.scaling for a in attn]
        local, world = rope_cos_sin(lm, torch.arange(T), 0), rope_cos_sin(lm, torch.arange(T), 2)
        assert not torch.allclose(local[0], world[0], atol=1e-3)  # two RoPEs


# --- runtime invariants, against eager -----------------------------------------------------------


def test_keep_all_equals_eager_attention_over_8_greedy_steps(lm, ref):
    ids = ids_of(T, seed=1)
    with torch.inference_mode():
        read = extend(lm, open_session(lm), ids)  # the prefill's own logits, all T positions
        cache = DynamicCache(config=ref.config)
        out = ref(input_ids=ids.unsqueeze(0), cache=cache, use_cache=True)
    assert (read - out.logits[0]).abs().max() < 1e-4
    session = open_session(lm, prefill(lm, ids).stored)
    token = out.logits[0, -1].argmax().view(1)
    for _ in range(8):
        ours = extend(lm, session, token)[-1]
        with torch.inference_mode():
            theirs = ref(input_ids=token.view(1, 1), cache=cache, use_cache=True).logits[0, -1]
        assert (ours - theirs).abs().max() < 1e-4
        token = theirs.argmax().view(1)


def kept_per_layer(lm: LoadedModel, full: FullKV, index: torch.Tensor) -> CompressedKV:
    """A stored cache keeping tokens ``index`` of every head in the layers a method compresses; a window
    layer keeps its window, as the model does."""
    return keep_windows(cache_from(full, [[index] * lm.n_kv_heads for _ in range(lm.n_layers)]), full)


def test_a_key_with_bias_minus_inf_is_that_key_absent(lm):
    """In the layers a method compresses, key 17; in a window layer, a key of its window, read by one
    token (a longer read's band would count the masked key's slot, which a removed key has not)."""
    full = prefill(lm, ids_of(T, seed=1))
    every = torch.arange(T)
    drops = [17 if full.window(layer) is None else T - 3 for layer in range(lm.n_layers)]
    question = ids_of(6, seed=3)
    probe = question[:1] if any(full.window(i) is not None for i in range(lm.n_layers)) else question
    removed_layers, masked_layers = [], []
    for layer, drop in enumerate(drops):
        index = every if full.window(layer) is None else every[T - (W - 1) :]
        bias = torch.zeros(index.numel())
        bias[index == drop] = float("-inf")
        removed_layers.append([index[index != drop]] * lm.n_kv_heads)
        masked_layers.append(([index] * lm.n_kv_heads, [bias] * lm.n_kv_heads))
    removed = logits_after(lm, cache_from(full, removed_layers), probe)
    masked = logits_after(lm, cache_from(full, [k for k, _ in masked_layers], [b for _, b in masked_layers]), probe)
    assert torch.allclose(removed, masked, atol=1e-5)  # two SDPA paths (plain, float mask): rounding only
    # The check can see one key: keeping it changes the logits by far more than the tolerance.
    assert (logits_after(lm, full.stored, probe) - removed).abs().max() > 1e-3


def eager_masks(lm: LoadedModel, n: int, hidden: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
    """transformers' additive masks [1, 1, n, n] for n tokens at positions 0..n-1: causal, minus the
    pairs ``hidden`` [n, n] marks in the full layers, minus the window in the window layers. A dict
    by layer type for a model with both (Gemma 3 and Qwen2 take one), else the one mask."""
    causal = torch.full((n, n), float("-inf")).triu(1)
    full = causal.masked_fill(hidden, float("-inf"))
    rows, cols = torch.arange(n).unsqueeze(1), torch.arange(n).unsqueeze(0)
    sliding = causal.masked_fill(cols <= rows - W, float("-inf"))
    windows = {g.window for g in lm.geometry}
    if windows == {None}:
        return full[None, None]
    if None not in windows:
        return sliding[None, None]
    return {"full_attention": full[None, None], "sliding_attention": sliding[None, None]}


def test_a_compressed_cache_reads_on_at_logical_positions_like_eager_with_those_keys_masked(lm, ref):
    """Evict a third of the context's keys in every layer a method compresses (a window layer keeps its
    window): the question read after the compressed cache (positions from its logical length T) must
    match eager attention over the whole sequence at positions 0.. with those keys masked for the
    question's tokens only, and each window layer's own window."""
    ids, question = ids_of(T, seed=1), ids_of(6, seed=3)
    dropped = torch.arange(5, T - 4, 3)
    kept = torch.tensor([i for i in range(T) if i not in set(dropped.tolist())])
    stored = kept_per_layer(lm, prefill(lm, ids), kept)
    session = open_session(lm, stored)
    assert session.position == T  # logical, not the physical len(kept)
    ours = extend(lm, session, question)
    n = T + question.numel()
    hidden = torch.zeros(n, n, dtype=torch.bool)
    hidden[T:, dropped] = True
    with torch.inference_mode():
        out = ref(input_ids=torch.cat([ids, question]).unsqueeze(0), attention_mask=eager_masks(lm, n, hidden))
    assert (ours - out.logits[0, T:]).abs().max() < 1e-4


# --- every method, two ratios --------------------------------------------------------------------


def compressed_part(ctx, stored: CompressedKV) -> tuple[object, CompressedKV]:
    """``ctx`` and ``stored`` cut to the layers a method compresses: where a ratio is counted."""
    layers = ctx.lm.compressed_layers
    full = FullKV([ctx.full.keys[i] for i in layers], [ctx.full.values[i] for i in layers])
    return dataclasses.replace(ctx, full=full), CompressedKV([stored.layers[i] for i in layers], stored.logical_len)


def assert_keeps_the_windows(ctx, stored: CompressedKV) -> None:
    """Every window layer of ``stored`` holds exactly the model's window of the context."""
    for layer in range(ctx.lm.n_layers):
        window = ctx.full.window(layer)
        if window is not None:
            view = stored.layer_view(layer)
            newest = torch.arange(ctx.length - (window - 1), ctx.length)
            assert torch.equal(view.token_index.cpu(), newest.expand(ctx.lm.n_kv_heads, -1))
            assert torch.equal(view.keys, ctx.full.keys[layer][:, newest])


@pytest.mark.parametrize("name", sorted(REGISTRY))
@pytest.mark.parametrize("ratio", [2.0, 4.0])
def test_every_method_meets_its_budget_with_finite_logits(ctx, name, ratio):
    """Counted over the layers a method compresses (every layer, unless the model has window layers,
    which keep their windows)."""
    stored = get_method(name).compress(Request(ctx, ratio, QUESTION))
    if stored.logical_len == ctx.length:
        assert_keeps_the_windows(ctx, stored)
    part, compressed = compressed_part(ctx, stored)
    budget = ctx.prefix_len + round(ctx.doc_len / ratio)
    if not compressed.layers:
        pass  # every layer is a window layer: there is nothing a method compresses
    elif stored.meta.get("summary_tokens", budget + 1) <= budget:
        # The random model ended its summary (an end-of-sequence token) below the budget: all of it stays.
        assert compressed.kept_per_head().max() <= budget
    elif not getattr(REGISTRY[name], "fixed_budget", False):
        assert_meets_budget(part, name, ratio, compressed)
    question = torch.tensor(ctx.lm.tokenizer(QUESTION)["input_ids"])
    logits = extend(ctx.lm, open_session(ctx.lm, stored), question)
    assert logits.shape == (question.numel(), 64) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "queries",
    [
        {"query_source": "repeat"},
        {"query_source": "question"},
        # The paper's query mix: the repeat pass and each self-study conversation, each its own segment.
        {"query_source": "repeat", "self_study_weight": 1.0, "self_study_tokens": 12},
    ],
    ids=["repeat", "question", "repeat+self_study"],
)
def test_the_on_policy_sweep_fits_what_the_per_layer_reread_fits(ctx, queries):
    """Attention Matching on-policy in one forward sweep against the paper's way (the text read again
    through the layers fitted so far, once per layer): the same queries per head, the same compact
    keys, biases and values up to float32 rounding, window layers kept as they are."""
    options = {"on_policy": True, "budgets": "uniform", **queries}
    sweep = get_method("attention_matching", **options).compress(Request(ctx, 3.0, QUESTION))
    reread = get_method("attention_matching", on_policy_sweep=False, **options).compress(Request(ctx, 3.0, QUESTION))
    assert sweep.meta["queries_per_head"] == reread.meta["queries_per_head"]
    for layer in range(ctx.lm.n_layers):
        got, want = sweep.layer_view(layer), reread.layer_view(layer)
        assert torch.equal(got.token_index, want.token_index), layer
        assert torch.equal(torch.isinf(got.bias), torch.isinf(want.bias)), layer
        finite = torch.isfinite(want.bias)
        # Both fits solve the same problem; float32's rounding, amplified by the solves' conditioning,
        # is all that may differ.
        torch.testing.assert_close(got.bias[finite], want.bias[finite], atol=1e-3, rtol=1e-3)
        torch.testing.assert_close(got.keys, want.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got.values, want.values, atol=1e-3, rtol=1e-3)


def test_the_sweep_reads_each_conversation_on_its_own_after_the_document(ctx, monkeypatch):
    """As the paper's code re-reads each self-study conversation over the context's cache alone: the
    first layer's fitting queries (nothing compacted before it) are the repeat pass's and each
    conversation's as read by itself right after the full cache, not as read after the others."""
    from kvlab.methods.families import document_fit
    from kvlab.prompts import repeat_tokens
    from kvlab.queries import read_after, self_study

    seen = {}
    real = document_fit.fit_on_policy

    def spy(req, opts, layer, q, *args):
        seen.setdefault(layer, (q, args[-1]))
        return real(req, opts, layer, q, *args)

    monkeypatch.setattr(document_fit, "fit_on_policy", spy)
    options = {"on_policy": True, "budgets": "uniform", "self_study_weight": 1.0, "self_study_tokens": 12}
    get_method("attention_matching", **options).compress(Request(ctx, 3.0, QUESTION))
    q, extra = seen[0]
    alone = [read_after(ctx, turn)[0] for turn in self_study(ctx, 12).turns]
    torch.testing.assert_close(q, read_after(ctx, repeat_tokens(ctx.lm.tokenizer, ctx.tokens.ids[ctx.prefix_len :]))[0])
    torch.testing.assert_close(extra, torch.cat(alone, dim=1))


def test_a_run_on_a_hybrid_model_counts_its_ratio_over_the_compressed_layers():
    """Gemma 3 as released: the ratio is met in its global layer; the run reports that layer's memory
    ratio and the whole cache's bytes, the local layers' windows (the same in both caches) included."""
    ctx = prepare_context(random_model(*WINDOWED["gemma3-released"]), DOC)
    result = run(ctx, get_method("snapkv"), 4.0, QUESTION, max_new_tokens=4).result
    details, full = result.details, ctx.full.stored
    window_bytes = full.layers_nbytes([0, 1])
    assert details["layer_windows"] == [W, W, None] and details["compressed_layers"] == [2]
    assert details["window_layers_bytes"] == window_bytes
    assert result.bytes_full == ctx.full.nbytes == window_bytes + full.layers_nbytes([2])
    assert result.bytes_compressed == window_bytes + details["compressed_layers_bytes_compressed"]
    assert details["compressed_layers_kept_tokens_mean"] == ctx.prefix_len + round(ctx.doc_len / 4)
    kept = ctx.prefix_len + round(ctx.doc_len / 4)
    assert details["compressed_layers_memory_ratio"] == pytest.approx(ctx.length / kept)
    assert 1 < result.memory_ratio < details["compressed_layers_memory_ratio"]
    errors = torch.tensor(result.per_head["attn_output_rel_err"])
    assert details["compressed_layers_attn_output_rel_err"] == pytest.approx(float(errors[2].mean()))
    assert errors[:2].abs().max() == 0  # the windows are the full cache's


@pytest.mark.parametrize("name", ["snapkv", "attention_matching"])
def test_a_window_layer_records_no_importance(name):
    """The token view's per-token scores: a window layer's keys were chosen by no score (NaN), a
    compressed layer's document tokens each have one."""
    ctx = prepare_context(random_model(*WINDOWED["gemma3-released"]), DOC)
    stored = get_method(name).compress(Request(ctx, 4.0, QUESTION, record_importance=True))
    assert all(torch.isnan(stored.importance[i]).all() for i in (0, 1))
    assert not torch.isnan(stored.importance[2][:, ctx.prefix_len :]).any()


@pytest.fixture(scope="module")
def fake_cuda_gemma3() -> LoadedModel:
    """Gemma 3 as released, at the device suite's size (kvlab.testing.device_suite), tagged "cuda"."""
    config = {**FAMILIES["gemma3"].tiny, **copy.deepcopy(WINDOWED["gemma3-released"][1])}
    lm = suite_model(config, name="fake-cuda-gemma3", family="gemma3")
    to_fake_cuda(lm.model)
    return LoadedModel(lm.name, lm.model, lm.tokenizer, FAKE_DEVICE, lm.dtype)


@pytest.mark.parametrize("step", [s for s in steps() if s.name in REGISTRY], ids=lambda s: s.name)
def test_every_method_on_a_hybrid_model_stays_on_its_device(fake_cuda_gemma3, step, monkeypatch):
    """The device-mixing check (tests/test_device_mixing.py) on the window layers' paths: windows,
    per-layer RoPE tables and scalings, the budgets pooled over the compressed layers."""
    monkeypatch.setenv("KVLAB_KERNELS", "torch")
    with fake_cuda() as mode:
        run_step(step, fake_cuda_gemma3)
    assert mode.on_cuda > 0


# --- BeaconKV's pre-RoPE round trip --------------------------------------------------------------


def test_unrotated_recorded_queries_are_the_pre_rope_projections_in_every_layer(lm):
    """The queries kvlab records are post-RoPE; unrotated with kvlab.runtime.rope's tables of their layer
    (Gemma 3: the local or the global RoPE) they must be the model's own pre-RoPE queries: q_proj's output,
    or q_norm's where the family has one, seen in a pass of transformers' own forward (kvlab's prefill
    may run the lean pass, kvlab.runtime.lean)."""
    n = 20
    ids = ids_of(n, seed=5)
    seen: dict[int, torch.Tensor] = {}
    handles = []
    for layer, attn in enumerate(attention_modules(lm)):
        source = attn.q_norm if hasattr(attn, "q_norm") else attn.q_proj
        hook = lambda m, i, out, layer=layer: seen.__setitem__(layer, out.detach())  # noqa: E731
        handles.append(source.register_forward_hook(hook))
    try:
        with torch.inference_mode():
            lm.model(input_ids=ids.unsqueeze(0))
    finally:
        for handle in handles:
            handle.remove()
    capture = QueryCapture(lm.n_layers)
    prefill(lm, ids, capture)
    apply_rope = sys.modules[type(attention_modules(lm)[0]).__module__].apply_rotary_pos_emb
    for layer in range(lm.n_layers):
        cos, sin = rope_cos_sin(lm, torch.arange(n), layer)
        out = seen[layer][0]  # [n, H*d] (q_proj), [n, H, d] (Qwen3's q_norm) or [H, n, d] (Gemma 3's)
        pre = out.view(n, lm.n_heads, lm.head_dim).transpose(0, 1) if out.shape[0] == n else out
        recorded = capture.layer(layer)
        assert torch.allclose(unrotate(recorded, cos, sin), pre, atol=1e-5)
        assert torch.allclose(rotate(pre, cos, sin), recorded, atol=1e-5)
        # kvlab's rotate is the family's own apply_rotary_pos_emb with the same tables (GPT-OSS's hold
        # each frequency once: kvlab's repeat them for the two halves).
        half = lm.head_dim // 2 if lm.model.config.model_type == "gpt_oss" else lm.head_dim
        tables = cos[:, :half].unsqueeze(0), sin[:, :half].unsqueeze(0)
        theirs, _ = apply_rope(pre.unsqueeze(0), pre.unsqueeze(0), *tables)
        assert torch.allclose(rotate(pre, cos, sin), theirs[0], atol=1e-6)


# --- each layer's own scaling --------------------------------------------------------------------


def test_the_metrics_attend_at_each_layers_own_scaling():
    """Gemma 3 as released (query_pre_attn_scalar 8 with head_dim 16): the attention output kvlab's
    metrics compute over the keep-all cache for the context's last query (which sees every key of a
    full layer) is the eager model's own, o_proj's input, in each full layer; at 1/sqrt(head_dim) it
    is not. Also the scorers' received attention: what eager's own weights give that query."""
    lm = random_model(*WINDOWED["gemma3-released"])
    ids, capture = ids_of(T, seed=1), QueryCapture(lm.n_layers)
    full = prefill(lm, ids, capture)
    ref, seen, handles = eager_twin(lm), {}, []
    for layer, block in enumerate(ref.model.layers):
        hook = lambda m, args, layer=layer: seen.__setitem__(layer, args[0].detach())  # noqa: E731
        handles.append(block.self_attn.o_proj.register_forward_pre_hook(hook))
    try:
        with torch.inference_mode():
            ref(input_ids=ids.unsqueeze(0))
    finally:
        for handle in handles:
            handle.remove()
    last = [capture.layer(i)[:, -1:] for i in range(lm.n_layers)]
    ours = reference_attention(full.stored, last)
    plain = reference_attention(dataclasses.replace(full.stored, scales=None), last)
    assert lm.compressed_layers == [2]
    for layer in lm.compressed_layers:
        want = seen[layer][0, -1].view(lm.n_heads, lm.head_dim)
        assert torch.allclose(ours[layer].output.reshape(lm.n_heads, lm.head_dim), want, atol=1e-4)
        assert not torch.allclose(plain[layer].output.reshape(lm.n_heads, lm.head_dim), want, atol=1e-3)
        scale = lm.geometry[layer].scaling
        received = received_attention(last[layer], full.keys[layer], reduce="sum", causal=False, scale=scale)
        weights = attention_weights(last[layer], expand_kv_heads(full.keys[layer], lm.n_heads), scale=scale)[:, 0]
        values = expand_kv_heads(full.values[layer], lm.n_heads)
        assert torch.allclose(torch.einsum("ht,htd->hd", weights, values), want, atol=1e-4)
        assert torch.allclose(received, weights, atol=1e-6)


# --- bounded generation --------------------------------------------------------------------------


@pytest.mark.parametrize("policy_name", bounded_policies())
def test_bounded_generation_stays_within_its_budget(lm, policy_name):
    budget, prompt = 40, ids_of(T, seed=2)  # BeaconKV needs 37: 4 protected + a 16-token window + 16 evicted at once
    policy = make_policy(policy_name, lm, budget, protected=4)
    run = run_policy(policy, prompt, 24, chunk=8, stop=False)
    assert len(run.ids) == 24 and all(math.isfinite(x) for x in run.logprobs)
    assert run.max_size <= budget and max(run.sizes) <= budget
    if lm.compressed_layers:
        assert run.events, "64 tokens in a budget of 40 must shrink the cache"
    else:  # every layer is a window layer: the model bounds the cache itself, a policy shrinks nothing
        assert not run.events and run.max_size <= W - 1 + 8


# --- what kvlab refuses, in one line, before any work ----------------------------------------------


@pytest.mark.parametrize(
    "family, overrides, message",
    [
        (  # Gemma 2's cap (Gemma 3 has none): a tanh on every logit, which kvlab's attention does not apply
            "gemma3",
            {"attn_logit_softcapping": 50.0},
            "tiny-gemma3: attention logit softcapping (50) is not supported by kvlab "
            "(kvlab's attention applies no tanh cap)",
        ),
        (
            "gemma3",
            {"use_bidirectional_attention": True},
            "tiny-gemma3: bidirectional attention is not supported by kvlab (kvlab's attention is causal)",
        ),
    ],
    ids=["gemma3-softcap", "gemma3-bidirectional"],
)
def test_unsupported_attention_is_refused_in_one_line(family, overrides, message):
    with pytest.raises(ModelLoadError) as refused:
        random_model(family, overrides)
    assert str(refused.value) == message


def _gemma3_unchecked(**overrides) -> LoadedModel:
    """A tiny Gemma 3 built by transformers alone: no kvlab.runtime.model.check_supported on the way."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(**{**TINY, **copy.deepcopy(FAMILIES["gemma3"].tiny), **SPECIAL_IDS, **overrides})
    model = Gemma3ForCausalLM(config).eval()
    use_kvlab_attention(model)
    return LoadedModel("unchecked-gemma3", model, word_tokenizer(64), torch.device("cpu"), torch.float32)


def test_load_model_reads_a_saved_real_gemma3_layout_with_each_layers_geometry(tmp_path, monkeypatch):
    """Saved and loaded by load_model: windows, scaling and RoPEs per layer as the model has them, and
    the loaded model reads like eager attention (its own sliding-window mask included)."""
    overrides = WINDOWED["gemma3-released"][1]
    model = _gemma3_unchecked(**copy.deepcopy(overrides)).model
    model.save_pretrained(tmp_path)
    word_tokenizer(64).save_pretrained(tmp_path)
    monkeypatch.setenv("KVLAB_DEVICE", "cpu")
    lm = load_model(str(tmp_path))
    assert [(g.window, g.scaling, g.rope_type) for g in lm.geometry] == [
        (W, 8**-0.5, "sliding_attention"),
        (W, 8**-0.5, "sliding_attention"),
        (None, 8**-0.5, "full_attention"),
    ]
    ids = ids_of(T, seed=1)
    with torch.inference_mode():
        theirs = eager_twin(lm)(input_ids=ids.unsqueeze(0)).logits[0]
    assert (extend(lm, open_session(lm), ids) - theirs).abs().max() < 1e-4


def test_load_model_refuses_a_saved_softcapped_gemma3(tmp_path, monkeypatch):
    _gemma3_unchecked(attn_logit_softcapping=50.0).model.save_pretrained(tmp_path)
    word_tokenizer(64).save_pretrained(tmp_path)
    monkeypatch.setenv("KVLAB_DEVICE", "cpu")
    with pytest.raises(
        ModelLoadError, match=r"^[^\n]*: attention logit softcapping \(50\) is not supported by kvlab [^\n]*$"
    ):
        load_model(str(tmp_path))


def test_rope_tables_of_a_model_whose_layer_types_rotate_differently_name_the_layer():
    """Gemma 3's local and global layers rotate by different RoPEs: each layer gets its own tables
    (those the model's forward pass uses), and asking for "the" table of the model is refused
    rather than give the global layers the sliding layers' tables."""
    lm = _gemma3_unchecked(rope_parameters=copy.deepcopy(GEMMA3_ROPES))
    rotary, positions = lm.model.model.rotary_emb, torch.arange(4)
    probe = torch.zeros(1, 1, lm.head_dim)
    for layer, kind in enumerate(["sliding_attention", "sliding_attention", "full_attention"]):
        cos, sin = rotary(probe, positions.unsqueeze(0), kind)
        ours = rope_cos_sin(lm, positions, layer)
        assert torch.equal(ours[0], cos[0]) and torch.equal(ours[1], sin[0])
    with pytest.raises(ModelLoadError, match="^unchecked-gemma3: its layers rotate by different RoPEs"):
        rope_cos_sin(lm, positions)


def test_the_forward_pass_honours_gemmas_query_pre_attn_scalar():
    """The refusal of other scalings is about the methods and metrics: kvlab's attention function
    itself uses the ``scaling`` the model passes (checked against eager, and against 1/sqrt(d))."""
    lm = _gemma3_unchecked(query_pre_attn_scalar=64)
    ids = ids_of(T, seed=1)
    with torch.inference_mode():
        ours = extend(lm, open_session(lm), ids)
        theirs = eager_twin(lm)(input_ids=ids.unsqueeze(0)).logits[0]
        plain = eager_twin(_gemma3_unchecked())  # query_pre_attn_scalar = head_dim, same weights
        plain.load_state_dict(lm.model.state_dict())
        unscaled = plain(input_ids=ids.unsqueeze(0)).logits[0]
    assert (ours - theirs).abs().max() < 1e-4
    assert (ours - unscaled).abs().max() > 1e-3
