"""Peak memory at long context, measured: each method's compression and one lab run, as multiples of the KV cache.

``python -m benchmarks.memory_model [--tokens 16384] [--layers 4] [--ratio 5] [--methods a,b] [--json PATH]``

A random-weights Llama (kvlab.testing.random_models) with Llama-3.1-8B's attention
geometry (32 query heads, 8 KV heads, head dim 128; ``--layers`` layers,
a narrow residual stream, MLP and vocabulary, which do not change what is measured) reads a
document of ``--tokens`` tokens on the CPU in float32. Peaks are the
process's resident-set high-water mark (Linux ``VmHWM``, reset through
``/proc/self/clear_refs`` before each phase) above the resident size at the
phase's start, so every allocation counts, torch's and Python's alike.

Phases, each from a context holding only its cache and the prefill's queries
(``Context.forget`` in between):

- ``lab_run``: prefill, then one lab run (kvlab.pipeline.run: the full
  cache's answer, Attention Matching's compression, the compressed answer,
  the per-head errors and log-probabilities), from the loaded model;
- ``held``: the bytes the context keeps after its prefill (counted by
  ``Context.nbytes``: cache, keep-all view, the prefill's queries);
- one row per method: its compression at ``--ratio`` (question-aware methods
  get a question).

glibc keeps freed blocks below its mmap threshold in the heap, where they
still count as resident: run with ``MALLOC_MMAP_THRESHOLD_=65536`` (the test
does) so freed tensors leave the resident set and peaks are not inflated.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import resource
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, TypeVar

import torch

from kvlab import pipeline
from kvlab.context import Context, prepare_context
from kvlab.methods import REGISTRY, Request, get_method
from kvlab.testing.random_models import synthetic_lm

T = TypeVar("T")

# Llama-3.1-8B's attention (32 query heads, 8 KV heads, head dim 128). The
# residual stream and MLP are narrow: they set the weights' bytes and the
# projections' time, not the cache, the queries or any method's work.
GEOMETRY = dict(
    num_hidden_layers=4,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    hidden_size=256,
    intermediate_size=512,
    vocab_size=512,
    rope_theta=500000.0,
)
QUESTION = "w1 w2 w3 w4 w5 w6 w7 w8"


@dataclass
class Peak:
    """One phase: peak resident bytes above its start, and that as a multiple of the KV cache's bytes."""

    phase: str
    peak_bytes: int
    kv_multiple: float
    seconds: float


def resident_bytes() -> int:
    """The resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def high_water_bytes() -> int:
    """The resident-set high-water mark since the last reset."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


def reset_high_water() -> None:
    """Set the high-water mark to the current resident size (Linux 4.0+)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def measure(fn: Callable[[], T]) -> tuple[T, int, float]:
    """(fn(), its peak resident bytes above the resident size before it, seconds)."""
    gc.collect()
    start = resident_bytes()
    reset_high_water()
    t0 = time.perf_counter()
    out = fn()
    return out, max(0, high_water_bytes() - start), time.perf_counter() - t0


def document(n_tokens: int, vocab: int, seed: int = 0) -> str:
    """``n_tokens`` seeded random words of the synthetic vocabulary (one token each)."""
    gen = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(i)}" for i in torch.randint(0, vocab - 2, (n_tokens,), generator=gen))


def run(n_tokens: int, geometry: dict, ratio: float, methods: list[str], log: Callable[[str], None]) -> dict:
    """Measure every phase; returns {"kv_bytes", "config", "peaks": [Peak...]} as plain data.

    geometry: LlamaConfig fields over :data:`GEOMETRY`'s.
    """
    config = {**GEOMETRY, **geometry, "max_position_embeddings": n_tokens + 1024}
    lm = synthetic_lm(
        config,
        "random Llama ({num_hidden_layers} layers, {num_attention_heads}/"
        "{num_key_value_heads} heads, dim {head_dim})".format(**config),
    )
    text = document(n_tokens, config["vocab_size"])
    peaks: list[Peak] = []
    holder: dict[str, Context] = {}

    def lab_run() -> pipeline.Run:
        holder["ctx"] = prepare_context(lm, text)
        return pipeline.run(holder["ctx"], get_method("attention_matching"), ratio, QUESTION, max_new_tokens=8)

    with torch.inference_mode():
        _, lab_peak, lab_s = measure(lab_run)
        ctx = holder["ctx"]
        kv = ctx.full.nbytes
        log(f"{ctx.length} tokens, KV cache {kv / 2**20:.0f} MiB; lab run peak {lab_peak / kv:.2f}x KV ({lab_s:.0f} s)")
        peaks.append(Peak("lab_run", lab_peak, lab_peak / kv, lab_s))
        ctx.forget()
        held = ctx.nbytes
        peaks.append(Peak("held", held, held / kv, ctx.prefill_s))
        for name in methods:
            ctx.forget()

            def compress() -> int:
                return get_method(name).compress(Request(ctx, ratio, QUESTION)).nbytes

            _, peak, secs = measure(compress)
            peaks.append(Peak(name, peak, peak / kv, secs))
            log(f"{name:20s} peak {peak / 2**20:8.0f} MiB = {peak / kv:5.2f}x KV ({secs:.0f} s)")
    return {"kv_bytes": kv, "tokens": ctx.length, "ratio": ratio, "config": config, "peaks": [asdict(p) for p in peaks]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384, help="document tokens (default 16384)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--heads", type=int, default=32, help="query heads (default 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="KV heads (default 8)")
    p.add_argument("--head-dim", type=int, default=128, help="head dimension (default 128)")
    p.add_argument("--hidden", type=int, default=256, help="residual stream width (default 256)")
    p.add_argument("--ratio", type=float, default=5.0, help="compression ratio (default 5)")
    p.add_argument("--methods", default="", help="comma-separated methods (default: every registered one)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures as JSON here")
    args = p.parse_args(argv)
    if not Path("/proc/self/clear_refs").exists():
        print("memory_model needs Linux's /proc/self/clear_refs", file=sys.stderr)
        return 2
    methods = [m for m in args.methods.split(",") if m] or sorted(REGISTRY)
    unknown = [m for m in methods if m not in REGISTRY]
    if unknown:
        print(f"unknown method(s): {', '.join(unknown)}", file=sys.stderr)
        return 2
    geometry = dict(
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        hidden_size=args.hidden,
    )
    figures = run(args.tokens, geometry, args.ratio, methods, lambda line: print(line, flush=True))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
