"""Kernel benchmarks: ``python -m kvlab.kernels.bench [--dry-run] [--json PATH]``.

Per kernel and size: the time of the Triton kernel and of the torch path it
replaces, the achieved memory bandwidth (the bytes the kernel must read at
least once, divided by its time) and the speed-up. The torch paths are what
the project would run without the kernels:

* decode attention: SDPA with the float bias mask of
  :func:`kvlab.runtime.attention.causal_bias_mask`;
* mixed precision: dequantise the packed codes, then the same SDPA;
* key scores: the chunked torch reference (:func:`kvlab.kernels.reference.key_scores`),
  which the solvers call when Triton is absent.

Triton needs CUDA: on the CPU only the torch paths are timed, and the table
says so. Default sizes are Llama-3.1-8B's attention geometry (32 query
heads, 8 KV heads, head dim 128) at a 32k-token cache; ``--dry-run`` uses
tiny ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from kvlab.kernels import dispatch as kernels
from kvlab.kernels import reference
from kvlab.runtime.attention import causal_bias_mask, sdpa
from kvlab.runtime.low_bit import PackedTensor, quantize_keys, quantize_values

# Published peak HBM bandwidth (bytes/s) of GPUs whose name contains the key.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


@dataclass(frozen=True)
class DecodeSize:
    """One decode step: ``n`` new tokens over ``seq_len`` keys, the last ``recent`` of them unbiased."""

    batch: int
    seq_len: int
    n_heads: int = 32
    n_kv: int = 8
    head_dim: int = 128
    n: int = 1
    recent: int = 1024


@dataclass(frozen=True)
class MixedSize:
    """``n_quant`` packed tokens then ``n_full`` full-precision ones; batch folded into the heads."""

    batch: int
    n_quant: int
    bits: int
    n_full: int = 128
    n_heads: int = 32
    n_kv: int = 8
    head_dim: int = 128
    n: int = 1
    group_size: int = 32


@dataclass(frozen=True)
class ScoreSize:
    """Key scores of ``n_queries`` reference queries over ``seq_len`` keys, for ``heads`` KV heads."""

    heads: int
    n_queries: int
    seq_len: int
    head_dim: int = 128


@dataclass
class BenchRow:
    """One kernel at one size. Times in ms (``triton_ms`` None where Triton cannot run)."""

    kernel: str
    size: str
    bytes_read: int
    torch_ms: float
    triton_ms: float | None
    triton_gb_s: float | None
    torch_gb_s: float
    speedup: float | None
    peak_fraction: float | None


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median milliseconds of ``fn`` after one warm-up call (which also compiles Triton kernels)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def packed_bytes(p: PackedTensor) -> int:
    return nbytes(p.codes, p.scale, p.zero)


def sdpa_with_bias(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """The torch decode path over a biased cache: float mask [1, H, n, S] in q's dtype, then SDPA."""
    mask = causal_bias_mask(q.shape[2], k.shape[2], bias, q.shape[1], q.dtype, q.device)
    return sdpa(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def peak_bandwidth(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)


def make_row(
    kernel: str, size: object, bytes_read: int, torch_ms: float, triton_ms: float | None, device: torch.device
) -> BenchRow:
    peak = peak_bandwidth(device)
    gb_s = None if triton_ms is None else bytes_read / triton_ms / 1e6
    return BenchRow(
        kernel=kernel,
        size=", ".join(f"{k}={v}" for k, v in asdict(size).items()),
        bytes_read=bytes_read,
        torch_ms=torch_ms,
        triton_ms=triton_ms,
        triton_gb_s=gb_s,
        torch_gb_s=bytes_read / torch_ms / 1e6,
        speedup=None if triton_ms is None else torch_ms / triton_ms,
        peak_fraction=None if gb_s is None or peak is None else gb_s * 1e9 / peak,
    )


def bench_decode(size: DecodeSize, device: torch.device, dtype: torch.dtype, reps: int, with_triton: bool) -> BenchRow:
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(size.batch, size.n_heads, size.n, size.head_dim, device=device, dtype=dtype, generator=gen)
    k, v = torch.randn(2, size.batch, size.n_kv, size.seq_len, size.head_dim, device=device, dtype=dtype, generator=gen)
    bias = torch.randn(size.n_kv, size.seq_len - size.recent, device=device, generator=gen)
    scale = size.head_dim**-0.5
    torch_ms = timed(lambda: sdpa_with_bias(q, k, v, bias, scale), device, reps)
    triton_ms = timed(lambda: kernels.decode_attention(q, k, v, bias, scale), device, reps) if with_triton else None
    return make_row("decode_attention", size, nbytes(q, k, v, bias), torch_ms, triton_ms, device)


def bench_mixed(size: MixedSize, device: torch.device, dtype: torch.dtype, reps: int, with_triton: bool) -> BenchRow:
    gen = torch.Generator(device=device).manual_seed(0)
    n_kv = size.batch * size.n_kv
    shape = (n_kv, size.n_quant, size.head_dim)
    keys = quantize_keys(torch.randn(shape, device=device, generator=gen), size.bits, size.group_size)
    values = quantize_values(torch.randn(shape, device=device, generator=gen), size.bits, size.group_size)
    q = torch.randn(size.batch * size.n_heads, size.n, size.head_dim, device=device, dtype=dtype, generator=gen)
    k_full, v_full = torch.randn(2, n_kv, size.n_full, size.head_dim, device=device, dtype=dtype, generator=gen)
    scale = size.head_dim**-0.5
    no_bias = torch.zeros(n_kv, size.n_quant, device=device)

    def dequantise_then_sdpa() -> torch.Tensor:
        k = torch.cat([keys.dequantize(dtype), k_full], dim=1)[None]
        v = torch.cat([values.dequantize(dtype), v_full], dim=1)[None]
        return sdpa_with_bias(q[None], k, v, no_bias, scale)

    torch_ms = timed(dequantise_then_sdpa, device, reps)
    triton_ms = (
        timed(lambda: kernels.mixed_attention(q, keys, values, k_full, v_full, None, scale), device, reps)
        if with_triton
        else None
    )
    read = packed_bytes(keys) + packed_bytes(values) + nbytes(q, k_full, v_full)
    return make_row(f"mixed_attention_{size.bits}bit", size, read, torch_ms, triton_ms, device)


def bench_scores(size: ScoreSize, device: torch.device, dtype: torch.dtype, reps: int, with_triton: bool) -> BenchRow:
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(size.heads, size.n_queries, size.head_dim, device=device, dtype=dtype, generator=gen)
    k = torch.randn(size.heads, size.seq_len, size.head_dim, device=device, dtype=dtype, generator=gen)
    bias = torch.randn(size.heads, size.seq_len, device=device, generator=gen)
    torch_ms = timed(lambda: reference.key_scores(q, k, bias, size.head_dim**-0.5), device, reps)
    triton_ms = timed(lambda: kernels.key_scores(q, k, bias), device, reps) if with_triton else None
    return make_row("key_scores_rms", size, nbytes(q, k, bias), torch_ms, triton_ms, device)


def default_sizes(dry_run: bool) -> tuple[list[DecodeSize], list[MixedSize], list[ScoreSize]]:
    """Llama-3.1-8B attention at 32k tokens, batch 1/4/8 (tiny shapes for a dry run)."""
    if dry_run:
        return (
            [DecodeSize(batch=1, seq_len=256, n_heads=8, n_kv=2, head_dim=64, recent=64)],
            [MixedSize(batch=1, n_quant=256, bits=b, n_full=16, n_heads=8, n_kv=2, head_dim=64) for b in (2, 4)],
            [ScoreSize(heads=2, n_queries=64, seq_len=256, head_dim=64)],
        )
    seq = 32 * 1024
    return (
        [DecodeSize(batch=b, seq_len=seq) for b in (1, 4, 8)],
        [MixedSize(batch=b, n_quant=seq, bits=bits) for bits in (4, 2) for b in (1, 8)],
        [ScoreSize(heads=8, n_queries=2048, seq_len=seq)],
    )


def run_benchmarks(device: torch.device, dry_run: bool = False, reps: int = 20) -> list[BenchRow]:
    """Every kernel at every default size on ``device`` (Triton timed only on CUDA)."""
    with_triton = kernels.backend(torch.empty(0, device=device)) == "triton"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    decode, mixed, scores = default_sizes(dry_run)
    rows = [bench_decode(s, device, dtype, reps, with_triton) for s in decode]
    rows += [bench_mixed(s, device, dtype, reps, with_triton) for s in mixed]
    rows += [bench_scores(s, device, dtype, reps, with_triton) for s in scores]
    return rows


def format_table(rows: list[BenchRow]) -> str:
    """A markdown table of the rows."""

    def fmt(x: float | None, spec: str, unit: str = "") -> str:
        return "n/a" if x is None else format(x, spec) + unit

    lines = [
        "| kernel | size | MB read | torch ms | triton ms | triton GB/s | speed-up | of peak BW |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.kernel} | {r.size} | {r.bytes_read / 1e6:.1f} | {r.torch_ms:.3f} | {fmt(r.triton_ms, '.3f')} "
            f"| {fmt(r.triton_gb_s, '.0f')} | {fmt(r.speedup, '.2f', 'x')} | {fmt(r.peak_fraction, '.0%')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvlab.kernels.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes (checks that everything runs)")
    parser.add_argument("--reps", type=int, default=20, help="timed repetitions per measurement (median)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.exit(2, "error: --reps must be at least 1\n")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        print("No CUDA device: Triton needs CUDA, so only the torch paths are timed.")
    rows = run_benchmarks(device, args.dry_run or device.type != "cuda", args.reps)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
