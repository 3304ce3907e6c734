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
and the floor of a step: the model's weight matmuls alone for one token (as the lean pass computes
them, kvlab.runtime.lean.project, and in torch.nn.functional.linear's form beside it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import kvlab.runtime.decode as decode  # noqa: E402
from kvlab.context import Context, prepare_context  # noqa: E402
from kvlab.examples import Example, load_examples  # noqa: E402
from kvlab.models import get_model  # noqa: E402
from kvlab.prompts import question_tokens  # noqa: E402
from kvlab.runtime.decode import greedy, stop_token_ids  # noqa: E402
from kvlab.runtime.lean import project  # noqa: E402
from kvlab.runtime.model import LoadedModel  # noqa: E402

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


def matmul_floor_s(lean, product: Callable = project, repeats: int = 5) -> float:
    """Seconds of one token's weight matmuls alone, nothing else: every projection of every layer and
    the head, on the model's own (fused) weights, computed by ``product`` (the lean pass's own,
    kvlab.runtime.lean.project, or ``torch.nn.functional.linear`` to compare), the best of ``repeats``.
    A step can be no faster."""
    weights = [w for layer in lean.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    weights.append(lean.lm_head.weight)
    inputs = {w.shape[1]: torch.ones(1, w.shape[1], dtype=w.dtype, device=w.device) for w in weights}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for w in weights:
                product(inputs[w.shape[1]], w)
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


@dataclass
class Bench:
    """The request each loop answers: the model, its prefilled document, the question turn [n], the end
    tokens and the most tokens to write."""

    lm: LoadedModel
    ctx: Context
    prompt: torch.Tensor
    stops: list[int]
    new_tokens: int


@dataclass
class Bounds:
    """The memory bound: the read bandwidth (bytes/s), the weights' and the KV cache's bytes, and the
    seconds of one token's weight matmuls as the lean pass computes them and in linear's own form
    (None: the model's family has no lean forward)."""

    bandwidth: float
    weights: int
    kv: int
    floor_s: float | None
    floor_linear_s: float | None

    @property
    def tokens_s(self) -> float:
        """Tokens per second when each token reads the weights once."""
        return self.bandwidth / self.weights

    @property
    def tokens_s_kv(self) -> float:
        """Tokens per second when each token reads the weights and the KV cache once."""
        return self.bandwidth / (self.weights + self.kv)


def kvlab_loop(bench: Bench, use_lean: bool) -> tuple[float, list[int]]:
    """kvlab's greedy answer from the full stored cache, with or without the lean forward: (seconds, ids)."""
    lean = decode.lean_model
    decode.lean_model = lean if use_lean else (lambda m: None)
    try:
        start = time.perf_counter()
        gen = greedy(bench.lm, bench.ctx.full.stored, bench.prompt, bench.new_tokens)
        return time.perf_counter() - start, gen.ids
    finally:
        decode.lean_model = lean


def transformers_loop(bench: Bench) -> tuple[float, list[int]]:
    """transformers' ``generate`` (SDPA) from a copy of the prefilled document: (seconds, ids written
    without the end tokens)."""
    model, stops = bench.lm.model, bench.stops
    cache = copy_cache(bench.ctx.full)
    ids = torch.cat([bench.ctx.tokens.ids, bench.prompt]).unsqueeze(0).to(bench.lm.device)
    model.set_attn_implementation("sdpa")
    try:
        start = time.perf_counter()
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            max_new_tokens=bench.new_tokens,
            do_sample=False,
            eos_token_id=stops,
            pad_token_id=stops[0],
        )
        elapsed = time.perf_counter() - start
    finally:
        model.set_attn_implementation("kvlab")
    written = out[0, ids.shape[1] :].tolist()
    return elapsed, [t for t in written if t not in stops]


def time_loops(loops: dict, repeats: int) -> tuple[dict[str, list[float]], dict[str, list[int]]]:
    """Each loop once to warm up, then ``repeats`` times in alternation: (seconds per loop, its written ids)."""
    with torch.inference_mode():
        for fn in loops.values():  # warm-up: first calls allocate and fuse
            fn()
        times: dict[str, list[float]] = {name: [] for name in loops}
        written: dict[str, list[int]] = {}
        for _ in range(repeats):
            for name, fn in loops.items():
                elapsed, ids = fn()
                times[name].append(elapsed)
                written[name] = ids
    return times, written


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Example]:
    """The options, and the bundled example they name."""
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
    return args, examples[args.example]


def report(bench: Bench, times: dict[str, list[float]], written: dict[str, list[int]], bounds: Bounds) -> None:
    """The table of the loops against transformers' and the bound, the target, and the start of the answer."""
    reference = "transformers generate (SDPA)"
    n_ref = len(written[reference])
    ref_rate = n_ref / statistics.median(times[reference])
    bound, bound_kv, kv_bytes, n_weights = bounds.tokens_s, bounds.tokens_s_kv, bounds.kv, bounds.weights
    print(
        f"\nread bandwidth {bounds.bandwidth / 1e9:.1f} GB/s; weights {n_weights / 1e6:.0f} MB -> bound "
        f"{bound:.1f} tokens/s (with the {kv_bytes / 1e6:.0f} MB KV cache read too: {bound_kv:.1f} tokens/s)\n"
    )
    print("| loop | tokens | s (median) | tokens/s | vs transformers | of the weight bound | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for name in times:
        n = len(written[name])
        rate = n / statistics.median(times[name])
        same = "yes" if written[name] == written[reference] else f"no (first {n} vs {n_ref})"
        print(
            f"| {name} | {n} | {statistics.median(times[name]):.2f} | {rate:.1f} | {rate / ref_rate:.2f}x | "
            f"{rate / bound:.0%} | {same} |"
        )
    one, five, _ = os.getloadavg()
    needed = TARGET_RATIO * ref_rate
    if (floor_s := bounds.floor_s) is not None:
        print(
            f"\nthe weight matmuls alone, one token: {floor_s * 1e3:.1f} ms ({1 / floor_s:.1f} tokens/s, "
            f"{n_weights / floor_s / bounds.bandwidth:.0%} of the read bandwidth; as torch.nn.functional.linear: "
            f"{bounds.floor_linear_s * 1e3:.1f} ms); the target leaves "
            f"{(1 / needed - floor_s) * 1e3:.1f} ms per token for everything else (attention over the "
            f"{kv_bytes / 1e6:.0f} MB cache alone takes {kv_bytes / bounds.bandwidth * 1e3:.1f} ms at the read "
            "bandwidth)"
        )
    print(
        f"\ntarget: kvlab >= {TARGET_RATIO:g}x transformers' loop = {needed:.1f} tokens/s: {needed / bound:.0%} of the "
        f"weight bound, {needed / bound_kv:.0%} of the bound with the cache; "
        f"load average at the end {one:.2f}, {five:.2f}"
    )
    print("answer:", bench.lm.tokenizer.decode(written["kvlab (lean forward)"])[:160].replace("\n", " "), "...")


def main(argv: list[str] | None = None) -> int:
    args, example = parse_args(argv)
    one, five, _ = os.getloadavg()
    print(f"load average {one:.2f}, {five:.2f} on {os.cpu_count()} CPUs; torch threads {torch.get_num_threads()}")

    lm = get_model()
    ctx = prepare_context(lm, example.text())
    question = "Retell the story in detail, event by event."
    bench = Bench(lm, ctx, question_tokens(lm.tokenizer, question), sorted(stop_token_ids(lm)), args.new_tokens)
    print(
        f"{lm.name}, {lm.dtype}; document {ctx.length:,} tokens (prefill {ctx.prefill_s:.1f} s), "
        f"question turn {bench.prompt.numel()} tokens, up to {args.new_tokens} new tokens"
    )

    times, written = time_loops(
        {
            "kvlab (lean forward)": lambda: kvlab_loop(bench, True),
            "kvlab through transformers' modules": lambda: kvlab_loop(bench, False),
            "transformers generate (SDPA)": lambda: transformers_loop(bench),
        },
        args.repeats,
    )
    bandwidth = read_bandwidth()
    lean = decode.lean_model(lm.model)
    floors = (matmul_floor_s(lean), matmul_floor_s(lean, torch.nn.functional.linear)) if lean else (None, None)
    report(bench, times, written, Bounds(bandwidth, weight_bytes(lm.model), ctx.full.nbytes, *floors))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
