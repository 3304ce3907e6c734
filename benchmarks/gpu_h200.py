"""The prepared GPU run: kernel correctness and speed, and end-to-end decode speed at 32k tokens.

``python -m benchmarks.gpu_h200 [--out PATH] [--dry-run]``

Needs no model download: the end-to-end part builds a random-weights model
with Llama-3.1-8B's configuration in code, and fills its caches with random
keys and values (decode speed does not depend on what the cache holds).
Sections, each recorded in one markdown file (tables, then all figures as a
JSON block) at ``--out`` (default ``$OUT/gpu_figures.md``, else
``gpu_figures.md``):

1. correctness on the GPU: each kernel against its torch reference, bf16
   and float32, with the largest differences;
2. kernel benchmarks (:mod:`kvlab.kernels.bench`): time, bandwidth, speed-up;
3. decode tokens/s at batch 1, 4 and 8 over a full 32k-token cache and over
   Attention-Matching-shaped compacted caches (4x and 10x: ragged heads,
   one float32 bias per key) through the Triton kernel and through SDPA
   with a float mask.

Designed to finish well under 8 minutes on an H200; a section that would
start past ``--budget-s`` is skipped and says so. ``--dry-run`` runs every
section with tiny sizes (CPU-safe: Triton parts are skipped without CUDA).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from kvlab import kernels
from kvlab.kernels import bench, reference
from kvlab.methods.solvers import score_keys
from kvlab.runtime.decode import GrowingLayer, _working_cache
from kvlab.runtime.hooks import ForwardContext
from kvlab.runtime.quant import quantize_keys, quantize_values
from kvlab.synthetic import random_llama

LLAMA_31_8B = dict(
    num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
    intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072,
)
TINY = dict(
    num_hidden_layers=2, hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
    intermediate_size=256, vocab_size=512, rope_theta=500000.0, max_position_embeddings=4096,
)


@dataclass
class DecodeRow:
    """Decode speed for one cache at one batch size."""

    cache: str
    attention: str
    batch: int
    stored_keys: int
    tokens_per_s: float
    ms_per_step: float


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    finite = torch.isfinite(b)
    return float((a.float() - b.float())[finite].abs().max()) if finite.any() else 0.0


def check_kernels(device: torch.device) -> list[dict]:
    """Each kernel vs its torch reference on ``device`` (ragged -inf bias, GQA 4, head dims 128 and 80)."""
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for d in (128, 80):
            q = torch.randn(2, 32, 2, d, device=device, dtype=dtype, generator=gen)
            k, v = torch.randn(2, 2, 8, 3000, d, device=device, dtype=dtype, generator=gen)
            bias = torch.randn(8, 2900, device=device, generator=gen)
            bias[::2, 2000:] = float("-inf")
            got = kernels.decode_attention(q, k, v, bias)
            out, lse = reference.decode_attention(q, k, v, bias[None], d**-0.5)
            rows.append(dict(kernel="decode_attention", dtype=str(dtype), head_dim=d,
                             max_abs_err_out=max_err(got.output, out), max_abs_err_lse=max_err(got.lse, lse)))
        for bits in (2, 4):
            keys = quantize_keys(torch.randn(8, 3000, 128, device=device, generator=gen), bits, 32)
            values = quantize_values(torch.randn(8, 3000, 128, device=device, generator=gen), bits, 32)
            q = torch.randn(32, 1, 128, device=device, dtype=dtype, generator=gen)
            kf, vf = torch.randn(2, 8, 100, 128, device=device, dtype=dtype, generator=gen)
            bf = torch.randn(8, 50, device=device, generator=gen)
            got = kernels.mixed_attention(q, keys, values, kf, vf, bf)
            out, lse = reference.mixed_attention(q, keys, values, kf, vf, bf, 128**-0.5)
            rows.append(dict(kernel=f"mixed_attention_{bits}bit", dtype=str(dtype), head_dim=128,
                             max_abs_err_out=max_err(got.output, out), max_abs_err_lse=max_err(got.lse, lse)))
        q = torch.randn(8, 500, 128, device=device, dtype=dtype, generator=gen)
        k = torch.randn(8, 3000, 128, device=device, dtype=dtype, generator=gen)
        bias = torch.randn(8, 3000, device=device, generator=gen)
        bias[:, 2500:] = float("-inf")
        for scoring in ("rms", "mean", "max"):
            rows.append(dict(kernel=f"key_scores_{scoring}", dtype=str(dtype), head_dim=128,
                             max_abs_err_out=max_err(kernels.key_scores(q, k, bias, scoring=scoring),
                                                     score_keys(q, k, bias, scoring=scoring))))
    return rows


def compacted_cache(n_layers: int, batch: int, n_kv: int, stored: int, head_dim: int, device: torch.device,
                    dtype: torch.dtype, biased: bool) -> tuple[list[GrowingLayer], list[torch.Tensor] | None]:
    """Random cache of ``stored`` keys per head; with ``biased``, float32 betas and ragged heads.

    Raggedness as Attention Matching's non-uniform budgets give it: odd KV
    heads keep only 3/4 of the width, the rest being -inf padding.
    """
    gen = torch.Generator(device=device).manual_seed(0)
    layers, biases = [], []
    for _ in range(n_layers):
        k, v = torch.randn(2, batch, n_kv, stored, head_dim, device=device, dtype=dtype, generator=gen)
        layers.append(GrowingLayer(k, v))
        bias = torch.randn(n_kv, stored, device=device, generator=gen)
        bias[1::2, (3 * stored) // 4 :] = float("-inf")
        biases.append(bias)
    return layers, (biases if biased else None)


@torch.inference_mode()
def decode_speed(model: LlamaForCausalLM, layers: list[GrowingLayer], bias: list[torch.Tensor] | None,
                 batch: int, logical_len: int, steps: int, device: torch.device) -> float:
    """Median-free plain timing: seconds per greedy step over ``steps`` steps (after 3 warm-up steps)."""
    cache = _working_cache(layers)
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    ctx = ForwardContext(key_bias=bias)
    position = logical_len
    start = 0.0
    for step in range(steps + 3):
        if step == 3:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
        out = model(input_ids=ids, position_ids=torch.full((batch, 1), position, device=device),
                    cache=cache, use_cache=True, logits_to_keep=1, kvlab=ctx)
        ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        position += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / steps


def end_to_end(device: torch.device, dry_run: bool, deadline: float) -> list[DecodeRow]:
    """Decode tokens/s: full cache (SDPA) vs compacted caches (Triton kernel and SDPA with a float mask)."""
    config = TINY if dry_run else LLAMA_31_8B
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_llama(config, device, dtype)
    seq_len, steps = (256, 4) if dry_run else (32 * 1024, 32)
    n_layers, n_kv = config["num_hidden_layers"], config["num_key_value_heads"]
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    backends = ["triton", "torch"] if kernels.backend(torch.empty(0, device=device)) == "triton" else ["torch"]
    caches = [("full", seq_len, False)] + [(f"compacted {r}x", seq_len // r, True) for r in (4, 10)]
    rows = []
    for batch in (1, 4, 8) if not dry_run else (1, 2):
        for name, stored, biased in caches:
            for attention in backends if biased else ["sdpa"]:
                if time.monotonic() > deadline:
                    print(f"skipped {name} batch {batch} ({attention}): time budget spent", flush=True)
                    continue
                os.environ["KVLAB_KERNELS"] = attention if biased else "auto"
                layers, bias = compacted_cache(n_layers, batch, n_kv, stored, head_dim, device, dtype, biased)
                per_step = decode_speed(model, layers, bias, batch, seq_len, steps, device)
                rows.append(DecodeRow(name, "sdpa" if attention == "torch" else attention, batch, stored,
                                      batch / per_step, per_step * 1e3))
                print(rows[-1], flush=True)
                del layers, bias
    os.environ.pop("KVLAB_KERNELS", None)
    return rows


def markdown(device_name: str, checks: list[dict], kernel_rows: list[bench.BenchRow], decode_rows: list[DecodeRow],
             notes: list[str]) -> str:
    lines = [f"# kvlab GPU figures: {device_name}, {time.strftime('%Y-%m-%d')}", "", *notes, "",
             "## Kernels vs torch references on this device", "",
             "| kernel | dtype | head dim | max abs err (out) | max abs err (lse) |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {c['kernel']} | {c['dtype']} | {c['head_dim']} | {c['max_abs_err_out']:.2e} | "
              f"{c.get('max_abs_err_lse', float('nan')):.2e} |" for c in checks]
    lines += ["", "## Kernel benchmarks", "", bench.format_table(kernel_rows), "",
              "## End-to-end decode (random-weights model, Llama-3.1-8B configuration)", "",
              "| cache | attention | batch | stored keys/head | tokens/s | ms/step |", "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r.cache} | {r.attention} | {r.batch} | {r.stored_keys} | {r.tokens_per_s:.1f} | {r.ms_per_step:.2f} |"
              for r in decode_rows]
    figures = dict(device=device_name, checks=checks, kernels=[asdict(r) for r in kernel_rows],
                   decode=[asdict(r) for r in decode_rows], notes=notes)
    lines += ["", "## All figures (JSON)", "", "```json", json.dumps(figures, indent=1), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_h200", description=__doc__.split("\n\n")[0])
    default_out = Path(os.environ["OUT"]) / "gpu_figures.md" if os.environ.get("OUT") else Path("gpu_figures.md")
    parser.add_argument("--out", type=Path, default=default_out, help=f"markdown file to write (default {default_out})")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes: checks that every section runs")
    parser.add_argument("--budget-s", type=float, default=420.0, help="no section starts after this many seconds")
    args = parser.parse_args(argv)
    if not args.out.parent.is_dir():
        parser.exit(2, f"error: {args.out.parent} is not a directory\n")
    deadline = time.monotonic() + args.budget_s
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (no CUDA: torch paths only)"
    notes = [f"torch {torch.__version__}; dry run: {args.dry_run}"]
    if device.type == "cuda":
        checks = check_kernels(device)
        print(json.dumps(checks, indent=1), flush=True)
    else:
        checks, notes = [], notes + ["Triton needs CUDA: no kernel ran, the correctness section is empty."]
    kernel_rows = bench.run_benchmarks(device, dry_run=args.dry_run or device.type != "cuda", reps=20)
    print(bench.format_table(kernel_rows), flush=True)
    decode_rows = end_to_end(device, args.dry_run or device.type != "cuda", deadline)
    args.out.write_text(markdown(device_name, checks, kernel_rows, decode_rows, notes))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
