"""Memory at long context, measured: peak resident memory of every method's compression
and of one lab run at 15k tokens stays under stated multiples of the KV cache's bytes.

A random-weights Llama (GQA 4:1 like Llama-3.1-8B, head dim 128; one layer and
8/2 heads so the CPU prefill of 15k tokens takes seconds) runs in a subprocess
(benchmarks.memory_model), which reads the kernel's resident-set high-water
mark around each phase. A [T, T] matrix at 15k tokens would be 0.9 GiB per
head, 32 times this cache: any method or metric building one fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvlab.methods import REGISTRY

pytestmark = (
    pytest.mark.slow
)  # a 15k-token lab run on a random Llama-3.1-8B geometry, in subprocesses: left out of make test-fast

ROOT = Path(__file__).resolve().parents[1]
# Not a multiple of the prefill's 2,048-token chunks nor of the decode buffers' doubling:
# a held cache that kept the buffers' spare capacity would show here.
TOKENS = 15000

# The stated multiples of the KV cache's bytes (keys and values, float32), and why:
# - a prefilled context holds the cache (1; its keep-all stored view shares that
#   storage) and the prefill's queries (2: four query heads per KV head, against
#   two tensors of keys and values), counted by Context.nbytes: at most twice the
#   cache plus the queries, measured 3.0;
# - an eviction or quantisation method adds its recorded queries (KVzip's repeat
#   pass: 2, and its keys: 0.5), working copies of one layer and the compressed
#   cache, and attention blocks of bounded size (kvlab.compression.scoring.BLOCK_ELEMENTS);
#   measured at most 7.5 (Expected Attention: the keys copied per query head);
# - Attention Matching also holds its fit's designs: the reference queries'
#   attention over the kept keys, [n, t] per KV head (n = 2,048 queries, t =
#   15000 / 5 keys), a few at a time; each is 1.7x this cache here, and they
#   grow like t, i.e. linearly in T (the mass fit solves the n x n dual when
#   n < t, never a t x t system); measured 14.5; KVSculpt runs the same fit, then
#   learns one head's keys at a time (its [n, t] attention and their gradients):
#   measured 14.7;
# - a lab run: the prefill, Attention Matching's compression, both answers, the
#   errors; measured 18.9.
HELD_MAX_CACHES = 2.0  # multiples of the KV cache, besides the recorded queries
COMPRESS_MAX = 9.0
ATTENTION_MATCHING_MAX = 17.0
LAB_RUN_MAX = 22.0


@pytest.fixture(scope="module")
def figures(tmp_path_factory) -> dict:
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the high-water mark")
    out = tmp_path_factory.mktemp("memory") / "figures.json"
    # A fixed mmap threshold: freed tensors leave the resident set at once.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.memory_model",
        "--tokens",
        str(TOKENS),
        "--layers",
        "1",
        "--heads",
        "8",
        "--kv-heads",
        "2",
        "--json",
        str(out),
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(out.read_text())


def multiples(figures: dict) -> dict[str, float]:
    return {p["phase"]: p["kv_multiple"] for p in figures["peaks"]}


def test_the_document_is_15k_tokens_and_the_cache_is_counted_in_full(figures):
    cfg = figures["config"]
    assert figures["tokens"] >= TOKENS
    # keys + values, float32, every layer and KV head
    expected = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * figures["tokens"] * cfg["head_dim"] * 4
    assert figures["kv_bytes"] == expected


def test_a_prefilled_context_holds_its_cache_and_queries_only(figures):
    cfg = figures["config"]
    # The queries have num_attention_heads heads where keys and values have 2 x
    # num_key_value_heads, all float32: their bytes as a multiple of the cache's.
    queries = cfg["num_attention_heads"] / (2 * cfg["num_key_value_heads"])
    assert multiples(figures)["held"] <= HELD_MAX_CACHES + queries
    # The cache once (its keep-all view shares it), the queries once.
    assert multiples(figures)["held"] == pytest.approx(1 + queries, rel=0.05)


@pytest.mark.parametrize("method", sorted(REGISTRY))
def test_each_method_compresses_within_a_bounded_multiple_of_the_cache(figures, method):
    limit = ATTENTION_MATCHING_MAX if method in ("attention_matching", "kvsculpt") else COMPRESS_MAX
    assert multiples(figures)[method] <= limit, f"{method}: {multiples(figures)[method]:.2f}x the KV cache"


def test_one_lab_run_stays_within_a_bounded_multiple_of_the_cache(figures):
    assert multiples(figures)["lab_run"] <= LAB_RUN_MAX
