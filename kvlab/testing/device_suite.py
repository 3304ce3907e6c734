"""Every path that meets the model's tensors, run on one model: the device suite.

``make test`` runs it on a tiny random model whose tensors are tagged "cuda"
(:mod:`kvlab.testing.fake_cuda`), so a CPU tensor meeting a GPU tensor fails
there as it would on a GPU; ``python -m benchmarks.gpu_check`` runs the same
steps on a real GPU. The steps cover:

* every registered method, with its default knobs and each published
  preset, at two ratios, through :func:`kvlab.pipeline.run` (compress, answer
  from both caches, measure errors);
* the lab's entry points: ``explore``, ``compare``, ``needle_test`` and
  ``generate`` (every bounded method);
* ``kvlab bench`` on one item.

The models have random weights and read through a byte-level tokenizer with
a ChatML template (:func:`kvlab.testing.random_models.byte_tokenizer`), so any text reads
as tokens and nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

import torch

from kvlab import models
from kvlab.compression.selection import SELECTION_PRESETS
from kvlab.context_store import CONTEXTS
from kvlab.methods import REGISTRY, get_method
from kvlab.runtime.model import LoadedModel
from kvlab.testing.random_models import byte_tokenizer, synthetic_lm

#: Tiny Llama geometry: GQA 2:1, 2 layers, head dim 16; the vocabulary covers the byte tokenizer.
TINY = dict(
    num_hidden_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=260,
    max_position_embeddings=4096,
)
DOCUMENT = (
    "The lighthouse keeper wrote in her log every evening. On Monday the wind came from the north "
    "and the boats stayed in the harbour. On Tuesday a storm broke two windows of the lamp room. "
    "The secret code for the supply locker is 4172. On Wednesday the supply ship brought oil, "
    "bread and a new lens. On Thursday the fog was so thick that the horn sounded all night. "
)
QUESTION = "What is the secret code for the supply locker?"
#: Two ratios, so a second compression of the same context (reused scores and queries) runs too.
RATIOS = (4.0, 8.0)
#: Knobs that only make a step shorter: writing a summary token by token is the slow part of
#: the summary methods, and its length takes no other code path.
QUICK_OPTIONS: dict[str, dict[str, Any]] = {"summarisation": {"max_tokens": 12}, "summary_am": {"summary_tokens": 12}}
#: Presets whose code paths another preset of the same method runs faster: plain OMP refits after
#: every key it adds, AM-OMP-fast runs the same selection and refit with 4 keys per refit.
COVERED_PRESETS = {"AM-OMP-basic": "AM-OMP-fast", "AM-OMP": "AM-OMP-fast"}
#: The selection wrappers' presets (AdaKV, ChunkKV, CriticalKV), which every scoring method has,
#: run for these: the wrappers' code is the same whatever the scores; KVzip's heads may keep nothing.
WRAPPED_IN_SUITE = ("snapkv", "kvzip")


def suite_model(
    config: dict[str, Any] | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    name: str = "suite-llama",
    seed: int = 0,
    family: str = "llama",
) -> LoadedModel:
    """A seeded random ``family`` model (``config`` overrides :data:`TINY`) with the byte tokenizer, on ``device``."""
    return synthetic_lm({**TINY, **(config or {})}, name, seed, family, torch.device(device), dtype, byte_tokenizer())


@contextlib.contextmanager
def serving(lm: LoadedModel) -> Iterator[LoadedModel]:
    """Every ``kvlab.models.get_model`` call (the lab's, the CLI's) returns ``lm`` meanwhile.

    Its prepared contexts are dropped afterwards, so they do not outlive the model.
    """
    with mock.patch.object(models, "get_model", lambda spec=None: lm):
        try:
            yield lm
        finally:
            CONTEXTS.forget(lm)


@dataclass(frozen=True)
class Step:
    """One path of the suite: ``run(lm, workdir)`` raises if anything on it fails."""

    name: str
    run: Callable[[LoadedModel, Path], None]


def method_configs() -> list[tuple[str, str | None]]:
    """(method, preset) for every registered method: its defaults (preset None), then each preset.

    A preset table shared with a method listed before (Summary + AM reuses
    Attention Matching's) is not run again: the same knobs take the same code paths.
    """
    out: list[tuple[str, str | None]] = []
    seen: list[dict] = []
    for name in sorted(REGISTRY):
        out.append((name, None))
        presets = getattr(REGISTRY[name], "presets", {})
        if presets and not any(presets is table for table in seen):
            seen.append(presets)
            out += [
                (name, preset)
                for preset in presets
                if COVERED_PRESETS.get(preset) not in presets
                and (preset not in SELECTION_PRESETS or name in WRAPPED_IN_SUITE)
            ]
    return out


def _method_step(name: str, preset: str | None) -> Step:
    """A method's defaults at both :data:`RATIOS`; a preset at the higher one only (plain OMP
    refits after every key it adds, and the lower ratio would only repeat that path for longer)."""
    from kvlab.pipeline import run

    ratios = RATIOS if preset is None else RATIOS[-1:]

    def go(lm: LoadedModel, workdir: Path) -> None:
        ctx = CONTEXTS.get(lm, DOCUMENT)
        method = get_method(name, preset=preset, **QUICK_OPTIONS.get(name, {}))
        for ratio in ratios:
            result = run(ctx, method, ratio, QUESTION, max_new_tokens=4).result
            if not result.kept_tokens_mean > 0:
                raise AssertionError(f"{name} kept nothing at {ratio:g}x")

    return Step(f"{name}" + (f"[{preset}]" if preset else ""), go)


def _explore(lm: LoadedModel, workdir: Path) -> None:
    """One Explore run and the figures its page draws (run, fit and divergence figures), built by the lab
    (the UI only serialises them): no gradio needed, which a GPU machine may lack."""
    from kvlab.lab import explore, run_spec
    from kvlab.lab.views import present, run_figures

    run_figures(present(explore(run_spec(DOCUMENT, None, "attention_matching", 4.0, QUESTION, max_new_tokens=4))))


def _compare(lm: LoadedModel, workdir: Path) -> None:
    """A sweep and its charts."""
    from kvlab.lab import compare, sweep_charts

    sweep = compare(DOCUMENT, None, ["snapkv", "attention_matching"], list(RATIOS), QUESTION, max_new_tokens=4)
    if sweep.errors:
        raise AssertionError(f"sweep points failed: {sweep.errors}")
    sweep_charts(sweep)


def _budgets(lm: LoadedModel, workdir: Path) -> None:
    """Every head-budget allocation: a profile written for ``lm`` (shares that cap some heads at the
    document's length at 2x), Attention Matching's default finding it, a scorer following it, and
    the document's own and the global ranking, through a Compare sweep's budgets axis."""
    import json
    import os

    from kvlab.compression.budget_profiles import profile_name
    from kvlab.lab import compare

    shares = [[float(1 + 8 * ((layer + head) % 2)) for head in range(lm.n_kv_heads)] for layer in range(lm.n_layers)]
    (workdir / profile_name(lm.name)).write_text(json.dumps({"model": lm.name, "shares": shares}))
    before = os.environ.get("KVLAB_BUDGETS_DIR")
    os.environ["KVLAB_BUDGETS_DIR"] = str(workdir)
    try:
        sweep = compare(
            DOCUMENT,
            None,
            ["snapkv", "attention_matching"],
            [2.0, 8.0],
            QUESTION,
            max_new_tokens=4,
            budgets=["profile", "document", "global"],
        )
    finally:
        if before is None:
            os.environ.pop("KVLAB_BUDGETS_DIR")
        else:
            os.environ["KVLAB_BUDGETS_DIR"] = before
    ran = {(r.method, r.details["budgets"]) for r in sweep.results}
    if sweep.errors or ran != {
        (m, b) for m in ("snapkv", "attention_matching") for b in ("profile", "document", "global")
    }:
        raise AssertionError(f"budget allocations failed or missing: {sweep.errors}")


def _needle_test(lm: LoadedModel, workdir: Path) -> None:
    from kvlab.lab import needle_test

    needle_test(DOCUMENT, None, ["kvzip", "attention_matching"], [4.0], depths=1)


def _generate(lm: LoadedModel, workdir: Path) -> None:
    from kvlab.lab import generate

    generate(document=DOCUMENT, question=QUESTION, budget=96, max_new_tokens=6)


def _bench(lm: LoadedModel, workdir: Path) -> None:
    from kvlab.cli import main

    argv = [
        "bench",
        "--tasks",
        "niah_single",
        "--limit",
        "1",
        "--length",
        "300",
        "--ratios",
        "4",
        "--methods",
        "snapkv,attention_matching",
        "--out",
        str(workdir / "bench"),
    ]
    if main(argv) != 0:
        raise AssertionError("kvlab bench failed")


LAB_STEPS = [
    Step("lab.explore", _explore),
    Step("lab.compare", _compare),
    Step("head budgets (profile, document, global)", _budgets),
    Step("lab.needle_test", _needle_test),
    Step("lab.generate", _generate),
    Step("kvlab bench (one item)", _bench),
]


def steps() -> list[Step]:
    """Every step of the suite: each method configuration, then the lab's entry points."""
    return [_method_step(name, preset) for name, preset in method_configs()] + LAB_STEPS


def run_step(step: Step, lm: LoadedModel) -> None:
    """Run one step with ``lm`` served to the lab, in a scratch folder of its own."""
    with tempfile.TemporaryDirectory(prefix="kvlab_device_") as tmp, serving(lm):
        step.run(lm, Path(tmp))
