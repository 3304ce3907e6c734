"""Decoding speed: kvlab's answer loop next to transformers' own generate loop, and the memory bound.

    python -m benchmarks.decode_speed [--new-tokens 64] [--repeats 3] [--example story]

On the embedded model, the bundled example's document is prefilled once
(about 2,000 tokens). Each side then answers the same request from that
cache, greedily, up to ``--new-tokens`` tokens, stopping at the same end
tokens, ``--repeats`` times in alternation:

- kvlab: :func:`kvlab.runtime.decode.greedy` from the full stored cache (the
  lean forward, kvlab.runtime.lean, where the model's family allows);
- kvlab through transformers' modules: the same loop with the lean forward
  switched off (transformers' layers, kvlab's attention function);
- transformers: ``model.generate`` with its SDPA attention and a
  ``DynamicCache`` holding a copy of the same prefilled document.

Each time counts the question turn and the written tokens (no prefill of
the document). Printed: tokens per second (median over the repeats), the
ratio to transformers' loop measured in the same run, whether the written
tokens are identical, and the bound of reading the weights once per token:
their bytes over the read bandwidth measured here (a float32 sum over a
buffer far larger than the caches), with the fraction of it each loop
reaches; also the bound counting the KV cache's bytes read per token, and
the fraction of each bound that the target (2x transformers' loop) needs;
and the floor of a step: the model's weight matmuls alone for one token.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import kvlab.runtime.decode as decode  # noqa: E402
from kvlab.context import prepare_context  # noqa: E402
from kvlab.examples import load_examples  # noqa: E402
from kvlab.models import get_model  # noqa: E402
from kvlab.prompts import question_tokens  # noqa: E402
from kvlab.runtime.decode import greedy, stop_token_ids  # noqa: E402

TARGET_RATIO = 2.0


def read_bandwidth(n_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second one process reads here: the best of ``repeats`` sums over a float32 buffer."""
    buffer = torch.ones(n_bytes // 4, dtype=torch.float32, device="cpu")
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return n_bytes / best


def matmul_floor_s(lean, repeats: int = 5) -> float:
    """Seconds of one token's weight matmuls alone, nothing else: every projection of every layer and
    the head, on the model's own (fused) weights, the best of ``repeats``. A step can be no faster."""
    weights = [w for layer in lean.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    weights.append(lean.lm_head.weight)
    inputs = {w.shape[1]: torch.ones(1, w.shape[1], dtype=w.dtype, device=w.device) for w in weights}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for w in weights:
                torch.nn.functional.linear(inputs[w.shape[1]], w)
            best = min(best, time.perf_counter() - start)
    return best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights, each storage once (tied embeddings count once)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        storage = p.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def copy_cache(full) -> DynamicCache:
    """transformers' own cache holding a copy of kvlab's prefilled document: [1, H_kv, T, d] per layer."""
    cache = DynamicCache()
    for i, (k, v) in enumerate(zip(full.keys, full.values)):
        cache.update(k.unsqueeze(0).clone(), v.unsqueeze(0).clone(), i)
    return cache


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens each loop may write (default 64)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each loop, alternating (default 3)")
    parser.add_argument("--example", default="story", help="the bundled example whose document is read")
    args = parser.parse_args(argv)
    examples = {e.id: e for e in load_examples()}
    if args.example not in examples:
        parser.error(f"no example {args.example!r}; choose from {', '.join(examples)}")
    if args.new_tokens < 1 or args.repeats < 1:
        parser.error("--new-tokens and --repeats must be at least 1")
    example = examples[args.example]
    one, five, _ = os.getloadavg()
    print(f"load average {one:.2f}, {five:.2f} on {os.cpu_count()} CPUs; torch threads {torch.get_num_threads()}")

    lm = get_model()
    ctx = prepare_context(lm, example.text())
    question = "Retell the story in detail, event by event."
    prompt = question_tokens(lm.tokenizer, question)
    stops = sorted(stop_token_ids(lm))
    print(f"{lm.name}, {lm.dtype}; document {ctx.length:,} tokens (prefill {ctx.prefill_s:.1f} s), "
          f"question turn {prompt.numel()} tokens, up to {args.new_tokens} new tokens")

    model = lm.model
    lean = decode.lean_model

    def kvlab_loop(use_lean: bool) -> tuple[float, list[int]]:
        decode.lean_model = lean if use_lean else (lambda m: None)
        try:
            start = time.perf_counter()
            gen = greedy(lm, ctx.full.stored, prompt, args.new_tokens)
            return time.perf_counter() - start, gen.ids
        finally:
            decode.lean_model = lean

    def transformers_loop() -> tuple[float, list[int]]:
        cache = copy_cache(ctx.full)
        ids = torch.cat([ctx.tokens.ids, prompt]).unsqueeze(0).to(lm.device)
        model.set_attn_implementation("sdpa")
        try:
            start = time.perf_counter()
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache,
                max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=stops, pad_token_id=stops[0],
            )
            elapsed = time.perf_counter() - start
        finally:
            model.set_attn_implementation("kvlab")
        written = out[0, ids.shape[1]:].tolist()
        return elapsed, [t for t in written if t not in stops]

    loops = {
        "kvlab (lean forward)": lambda: kvlab_loop(True),
        "kvlab through transformers' modules": lambda: kvlab_loop(False),
        "transformers generate (SDPA)": transformers_loop,
    }
    with torch.inference_mode():
        for fn in loops.values():  # warm-up: first calls allocate and fuse
            fn()
        times: dict[str, list[float]] = {name: [] for name in loops}
        written: dict[str, list[int]] = {}
        for _ in range(args.repeats):
            for name, fn in loops.items():
                elapsed, ids = fn()
                times[name].append(elapsed)
                written[name] = ids
    bandwidth = read_bandwidth()
    floor_s = matmul_floor_s(lean(model)) if lean(model) is not None else None
    n_weights = weight_bytes(model)
    kv_bytes = ctx.full.nbytes
    bound = bandwidth / n_weights
    bound_kv = bandwidth / (n_weights + kv_bytes)
    reference = "transformers generate (SDPA)"
    n_ref = len(written[reference])
    ref_rate = n_ref / statistics.median(times[reference])
    print(f"\nread bandwidth {bandwidth / 1e9:.1f} GB/s; weights {n_weights / 1e6:.0f} MB -> bound {bound:.1f} tokens/s "
          f"(with the {kv_bytes / 1e6:.0f} MB KV cache read too: {bound_kv:.1f} tokens/s)\n")
    print("| loop | tokens | s (median) | tokens/s | vs transformers | of the weight bound | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for name in loops:
        n = len(written[name])
        rate = n / statistics.median(times[name])
        same = "yes" if written[name] == written[reference] else f"no (first {n} vs {n_ref})"
        print(f"| {name} | {n} | {statistics.median(times[name]):.2f} | {rate:.1f} | {rate / ref_rate:.2f}x | "
              f"{rate / bound:.0%} | {same} |")
    one, five, _ = os.getloadavg()
    needed = TARGET_RATIO * ref_rate
    if floor_s is not None:
        print(f"\nthe weight matmuls alone, one token: {floor_s * 1e3:.1f} ms ({1 / floor_s:.1f} tokens/s, "
              f"{n_weights / floor_s / bandwidth:.0%} of the read bandwidth); the target leaves "
              f"{(1 / needed - floor_s) * 1e3:.1f} ms per token for everything else (attention over the "
              f"{kv_bytes / 1e6:.0f} MB cache alone takes {kv_bytes / bandwidth * 1e3:.1f} ms at the read bandwidth)")
    print(f"\ntarget: kvlab >= {TARGET_RATIO:g}x transformers' loop = {needed:.1f} tokens/s: {needed / bound:.0%} of the "
          f"weight bound, {needed / bound_kv:.0%} of the bound with the cache; "
          f"load average at the end {one:.2f}, {five:.2f}")
    print("answer:", lm.tokenizer.decode(written["kvlab (lean forward)"])[:160].replace("\n", " "), "...")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
