"""The first command to run on a lent GPU: ``python -m benchmarks.gpu_check [--out PATH] [--only S] [--dry-run]``.

Needs no model download: every model is built in code with random weights
(memory, speed and device placement depend on the geometry, not on what the
model knows) and reads through a byte-level tokenizer. One JSON file at
``--out`` (default ``$OUT/gpu_check.json``, else ``gpu_check.json``) holds:

1. ``suite``: the device suite (:mod:`kvlab.testing.device_suite`: every
   method and preset, the lab's explore, compare, needle test and generate,
   ``kvlab bench`` on one item) on a real GPU, the model in bf16, each step's
   status and time. ``make test`` runs the same steps under the CPU stand-in
   for CUDA (tests/test_device_mixing.py);
2. ``explore``: every method end to end through :func:`kvlab.lab.explore` in
   bf16 at 10x on an 8k-token document, on random-weights models with
   Llama-3.1-8B's and Qwen3-8B's attention geometry (2 layers each), with
   the run's times, error and bytes;
3. ``kernel_checks``: each Triton kernel against its torch reference on the
   device (bf16 and float32, ragged -inf biases, GQA 4, head dims 128 and 80);
4. ``kernels``: the kernel benchmark (:mod:`kvlab.kernels.bench`);
5. ``decode``: decode tokens/s at batch 1, 4 and 8 over a full 32k-token
   cache and over Attention-Matching-shaped compacted caches (4x and 10x:
   ragged heads, one float32 bias per key), through the Triton kernel and
   through the torch path (grouped float32 matmuls); the median step.

Designed to finish in under 8 minutes on an H200: a section that would start
past ``--budget-s`` is skipped and says so. ``--only decode`` (any
comma-separated sections) reruns some after a fix. ``--dry-run`` runs every section
on tiny sizes on whatever device there is (on a CPU: the torch paths; a few
suite steps), which ``make test`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import PreTrainedModel

from kvlab.compression.solvers.scores import score_keys
from kvlab.kernels import bench, reference
from kvlab.kernels import dispatch as kernels
from kvlab.methods import REGISTRY
from kvlab.models import pick_device
from kvlab.runtime.decode import GrowingLayer, _working_cache
from kvlab.runtime.hooks import ForwardContext
from kvlab.runtime.low_bit import quantize_keys, quantize_values
from kvlab.testing import device_suite
from kvlab.testing.random_models import random_llama

LLAMA_31_8B = dict(
    num_hidden_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=14336,
    vocab_size=128256,
    max_position_embeddings=131072,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
QWEN3_8B = dict(
    num_hidden_layers=36,
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)
#: Suite steps a dry run takes: one method, one preset, the bounded writers, the bench (the code path, not the matrix).
DRY_RUN_STEPS = ("attention_matching", "kvzip", "lab.generate", "kvlab bench (one item)")


def timed(fn: Callable[[], Any]) -> tuple[Any, float, str | None]:
    """(result or None, seconds, error line or None): a failure is a figure, not the end of the run."""
    start = time.perf_counter()
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON, the next section still runs
        traceback.print_exc()
        return None, time.perf_counter() - start, f"{type(exc).__name__}: {exc}"
    return out, time.perf_counter() - start, None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_suite(device: torch.device, dtype: torch.dtype, dry_run: bool, deadline: float) -> list[dict]:
    """Every device-suite step on a tiny model placed on ``device``: status and seconds per step."""
    lm = device_suite.suite_model(device=device, dtype=dtype, name=f"suite-llama-{device.type}")
    rows = []
    for step in device_suite.steps():
        if dry_run and step.name not in DRY_RUN_STEPS:
            continue
        if time.monotonic() > deadline:
            rows.append(dict(step=step.name, status="skipped: time budget spent"))
            continue
        _, seconds, error = timed(lambda: (device_suite.run_step(step, lm), sync(device)))
        rows.append(dict(step=step.name, status="ok" if error is None else "failed", seconds=seconds, error=error))
        print(rows[-1], flush=True)
    return rows


def long_document(n_tokens: int) -> str:
    """About ``n_tokens`` byte tokens of the suite's document, repeated, with its question's answer in it."""
    text = device_suite.DOCUMENT
    return (text * (n_tokens // len(text.encode()) + 1))[:n_tokens]


def run_explore(device: torch.device, dtype: torch.dtype, dry_run: bool, deadline: float) -> list[dict]:
    """Every method through ``kvlab.lab.explore`` at 10x on each geometry (2 layers of it)."""
    from kvlab.lab import explore, run_spec

    geometries = {"Llama-3.1-8B": ("llama", LLAMA_31_8B), "Qwen3-8B": ("qwen3", QWEN3_8B)}
    n_tokens = 600 if dry_run else 8192
    rows = []
    for label, (family, config) in geometries.items():
        config = {**config, "num_hidden_layers": 2}
        if dry_run:
            config = {**config, **device_suite.TINY}
        lm = device_suite.suite_model(config, device, dtype, name=f"random {label} geometry, 2 layers", family=family)
        document = long_document(n_tokens)
        with device_suite.serving(lm):
            for name in sorted(REGISTRY):
                if time.monotonic() > deadline:
                    rows.append(dict(model=label, method=name, status="skipped: time budget spent"))
                    continue
                options = device_suite.QUICK_OPTIONS.get(name, {}) if dry_run else {}
                out, seconds, error = timed(
                    lambda: explore(
                        run_spec(document, None, name, 10.0, device_suite.QUESTION, max_new_tokens=16, options=options)
                    )
                )
                row = dict(
                    model=label, method=name, status="ok" if error is None else "failed", wall_s=seconds, error=error
                )
                if out is not None:
                    r = out.run.result
                    row.update(
                        doc_tokens=r.doc_tokens,
                        prefill_s=r.prefill_s,
                        compress_s=r.compress_s,
                        answer_full_s=r.answer_full_s,
                        answer_compressed_s=r.answer_compressed_s,
                        attn_output_rel_err=r.attn_output_rel_err,
                        bytes_full=r.bytes_full,
                        bytes_compressed=r.bytes_compressed,
                    )
                rows.append(row)
                print(row, flush=True)
        del lm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


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
            out, lse = reference.eager_decode_attention(q, k, v, bias[None], d**-0.5)
            rows.append(
                dict(
                    kernel="decode_attention",
                    dtype=str(dtype),
                    head_dim=d,
                    max_abs_err_out=max_err(got.output, out),
                    max_abs_err_lse=max_err(got.lse, lse),
                )
            )
        for bits in (2, 4):
            keys = quantize_keys(torch.randn(8, 3000, 128, device=device, generator=gen), bits, 32)
            values = quantize_values(torch.randn(8, 3000, 128, device=device, generator=gen), bits, 32)
            q = torch.randn(32, 1, 128, device=device, dtype=dtype, generator=gen)
            kf, vf = torch.randn(2, 8, 100, 128, device=device, dtype=dtype, generator=gen)
            bf = torch.randn(8, 50, device=device, generator=gen)
            got = kernels.mixed_attention(q, keys, values, kf, vf, bf)
            out, lse = reference.mixed_attention(q, keys, values, kf, vf, bf, 128**-0.5)
            rows.append(
                dict(
                    kernel=f"mixed_attention_{bits}bit",
                    dtype=str(dtype),
                    head_dim=128,
                    max_abs_err_out=max_err(got.output, out),
                    max_abs_err_lse=max_err(got.lse, lse),
                )
            )
        q = torch.randn(8, 500, 128, device=device, dtype=dtype, generator=gen)
        k = torch.randn(8, 3000, 128, device=device, dtype=dtype, generator=gen)
        bias = torch.randn(8, 3000, device=device, generator=gen)
        bias[:, 2500:] = float("-inf")
        for scoring in ("rms", "mean", "max"):
            rows.append(
                dict(
                    kernel=f"key_scores_{scoring}",
                    dtype=str(dtype),
                    head_dim=128,
                    max_abs_err_out=max_err(
                        kernels.key_scores(q, k, bias, scoring=scoring), score_keys(q, k, bias, scoring=scoring)
                    ),
                )
            )
    return rows


def compacted_cache(
    n_layers: int,
    batch: int,
    n_kv: int,
    stored: int,
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype,
    biased: bool,
) -> tuple[list[GrowingLayer], list[torch.Tensor] | None]:
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


#: Steps before timing: the first steps of a new cache shape pay one-off costs (kernel selection, allocator growth).
WARMUP_STEPS = 5


@torch.inference_mode()
def decode_speed(
    model: PreTrainedModel,
    layers: list[GrowingLayer],
    bias: list[torch.Tensor] | None,
    batch: int,
    logical_len: int,
    steps: int,
    device: torch.device,
) -> float:
    """Seconds per greedy step: the median over ``steps`` steps, each timed alone after WARMUP_STEPS.

    Each step ends with a synchronisation, as a real decode loop's stop check
    does; the median keeps one slow step (a sandbox's scheduling hiccup) out of
    the figure, which a mean over all steps let in.
    """
    cache = _working_cache(layers)
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    ctx = ForwardContext(key_bias=bias)
    times = []
    for step in range(steps + WARMUP_STEPS):
        start = time.perf_counter()
        out = model(
            input_ids=ids,
            position_ids=torch.full((batch, 1), logical_len + step, device=device),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
            kvlab=ctx,
        )
        ids = out.logits[:, -1].argmax(dim=-1, keepdim=True)
        sync(device)
        if step >= WARMUP_STEPS:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


#: What a compacted cache's decode step runs, per backend (kvlab.runtime.attention's decode step): Triton's
#: split-K kernel, or two grouped float32 matmuls with the biases added to the logits.
COMPACTED_ATTENTION = {"triton": "triton", "torch": "torch matmuls"}


def end_to_end(device: torch.device, dry_run: bool, deadline: float) -> list[DecodeRow]:
    """Decode tokens/s: full cache (SDPA) vs compacted caches (the Triton kernel, and the torch path)."""
    config = device_suite.TINY if dry_run else LLAMA_31_8B
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
            for attention in backends if biased else ["auto"]:
                if time.monotonic() > deadline:
                    print(f"skipped {name} batch {batch} ({attention}): time budget spent", flush=True)
                    continue
                os.environ["KVLAB_KERNELS"] = attention
                layers, bias = compacted_cache(n_layers, batch, n_kv, stored, head_dim, device, dtype, biased)
                per_step = decode_speed(model, layers, bias, batch, seq_len, steps, device)
                label = COMPACTED_ATTENTION[attention] if biased else "sdpa"
                rows.append(DecodeRow(name, label, batch, stored, batch / per_step, per_step * 1e3))
                print(rows[-1], flush=True)
                del layers, bias
    os.environ.pop("KVLAB_KERNELS", None)
    return rows


#: The sections, in the order they run (``--only`` picks some: a rerun after a fix, inside a lent machine's minutes).
SECTIONS = ("suite", "explore", "kernel_checks", "kernels", "decode")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    default_out = Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else Path("gpu_check.json")
    parser.add_argument("--out", type=Path, default=default_out, help=f"JSON file to write (default {default_out})")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes: checks that every section runs")
    parser.add_argument(
        "--budget-s", type=float, default=420.0, help="no section or step starts after this many seconds"
    )
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help=f"sections to run, comma-separated (default: {','.join(SECTIONS)})"
    )
    args = parser.parse_args(argv)
    if not args.out.parent.is_dir():
        parser.exit(2, f"error: {args.out.parent} is not a directory\n")
    only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in only if name not in SECTIONS]
    if unknown or not only:
        parser.exit(2, f"error: --only takes sections among {', '.join(SECTIONS)}, got {args.only!r}\n")
    deadline = time.monotonic() + args.budget_s
    device, dtype = pick_device()
    on_gpu = device.type == "cuda"
    figures: dict[str, Any] = dict(
        date=time.strftime("%Y-%m-%d"),
        device=torch.cuda.get_device_name(device) if on_gpu else "CPU (no CUDA)",
        torch=torch.__version__,
        dtype=str(dtype),
        dry_run=args.dry_run,
        notes=[],
    )
    small = args.dry_run or not on_gpu

    def section(name: str, fn: Callable[[], Any]) -> None:
        if name not in only:
            return
        if time.monotonic() > deadline:
            figures[name], figures[f"{name}_s"] = "skipped: time budget spent", 0.0
            return
        out, seconds, error = timed(fn)
        figures[name], figures[f"{name}_s"] = (out if error is None else f"failed: {error}"), seconds
        args.out.write_text(json.dumps(figures, indent=1))  # what is done so far survives a later failure

    section("suite", lambda: run_suite(device, dtype, small, deadline))
    section("explore", lambda: run_explore(device, dtype, small, deadline))
    if on_gpu:
        section("kernel_checks", lambda: check_kernels(device))
    elif "kernel_checks" in only:
        figures["kernel_checks"] = "skipped: Triton needs CUDA (tests/test_kernels.py runs them under the interpreter)"
    section("kernels", lambda: [asdict(r) for r in bench.run_benchmarks(device, dry_run=small, reps=20)])
    section("decode", lambda: [asdict(r) for r in end_to_end(device, small, deadline)])
    figures["wall_s"] = sum(v for k, v in figures.items() if k.endswith("_s") and isinstance(v, float))
    args.out.write_text(json.dumps(figures, indent=1))
    print(f"wrote {args.out}")
    failed = [k for k, v in figures.items() if isinstance(v, str) and v.startswith("failed")]
    failed += [
        f"{k}: {r.get('step') or r.get('method')}"
        for k in ("suite", "explore")
        if isinstance(figures.get(k), list)
        for r in figures[k]
        if r.get("status") == "failed"
    ]
    if failed:
        print("failed: " + "; ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
