"""bf16 on the CPU, as the GPU's stand-in: every method's attention-output error in bf16 against float32.

On a GPU kvlab runs models in bfloat16 (kvlab.models.pick_device), and the
solvers and fitted biases stay float32 inside. This file runs every
registered method on the same tiny random Llama twice, in float32 and in
bf16 (same weights, same document, same question), through the path of
kvlab.pipeline: prepare the context, ``method.compress(Request(...))``,
measure with kvlab.metrics.

The quantity, per method at ratio ``RATIO``:

    err_x = head_errors(ctx_x.full.stored, stored_x, Q).mean_output

the relative attention-output error ||y_c - y|| / ||y|| of run x's compressed
cache against run x's *own* full cache, averaged over layers, KV heads and
the held-out queries ``Q``; ``Q`` is the same for both runs: the float32
run's question and answer queries (kvlab.pipeline.evaluation), so the two
errors differ only by what bf16 did to the caches. The bound is

    |err_bf16 - err_fp32| <= TOLERANCE[method.bf16_tolerance] * max(1, err_fp32)

relative above an error of 1, because bf16 perturbs every output by a
fraction of its norm (errors reach 4-8 here for the summaries and no context).

Each run is compared with its own full cache because bf16 moves the full
cache too (about one bf16 rounding, 2^-8 ~ 0.4%, of every attention output):
measured against the float32 full cache, a bf16 run would be charged for
that as well, and its compressed cache for nothing it did.

For the methods that take no decision bf16 could flip (``DRIFT``: Attention
Matching, whose value refit makes up for a swapped key, and the positional
and seeded selections), a second, sharper quantity: the drift

    drift = mean ||y_c,bf16 - y_c,fp32|| / ||y_fp32||

of the compressed caches' attention outputs on ``Q``, in units of the floor
F, the same drift of the two full caches (bf16's own footprint on this model,
0.3-0.6%): ``drift <= DRIFT[method] * F``. An error difference is blind to
noise that adds to a large compression error in quadrature; the drift is not.

Discrete decisions that depend on the dtype by design are taken from the
bf16 run and replayed in the float32 one (``PINNED``): the byte plan of the
mixed-precision methods (their ratio is a memory ratio, and a bf16 full cache
has half the bytes, so the same ratio buys half the bytes) and the summary a
model writes greedily (a random model's logits are near ties: one flipped
argmax changes the whole summary). Everything else, the token selection
included, runs as it is.

Besides the bound: the bf16 caches really are bf16 (stored keys and values in
the model's dtype; a float32 copy would double the bytes), every stored bias
stays float32, and the bf16 runtime reads each compressed cache to finite
logits (bf16 keys with float32 biases in one attention call).
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from types import ModuleType
from typing import Any, Callable

import pytest
import torch

from conftest import with_template
from kvlab.compression.interface import Bf16Tolerance
from kvlab.context import Context, prepare_context
from kvlab.methods import REGISTRY, Request, beaconkv_mixed, get_method, kivi, summarisation, summary_am, turboquant
from kvlab.methods.families import engine_format
from kvlab.metrics import head_errors
from kvlab.pipeline import evaluation
from kvlab.runtime.attention import attend, group_queries
from kvlab.runtime.cache import CompressedKV
from kvlab.runtime.decode import extend, open_session
from kvlab.runtime.model import LoadedModel

DOC = " ".join(f"w{(i * 7) % 60 + 2}" for i in range(80))  # 80 tokens: CPU bf16 matmuls are slow
QUESTION = "w3 w5 w8"
RATIO = 4.0

# |err_bf16 - err_fp32| / max(1, err_fp32) allowed per tolerance class; each method declares its class
# (``bf16_tolerance``, kvlab.compression.interface.Bf16Tolerance, with its reason beside it). The
# scale: bf16 keeps 8 mantissa bits, a relative rounding of 2^-8 ~ 0.4%, and on this model the bf16
# full cache's attention outputs are F = 0.3-0.6% from the float32 ones (the floor). When bf16 keeps
# the same tokens, an error against its own full cache moves by at most about (2 + err) F <= 3 F
# max(1, err): errors of order 1e-2. "Spread": the largest |difference| / max(1, err_fp32) over 8
# seeds x 3 documents; at this file's seed and document every method is at least 3x inside its bound.
TOLERANCE: dict[str, float] = {
    # A least-squares fit absorbs the rounding of its inputs: within about one bf16 rounding
    # (spread 0.0031). A solver run in bf16 adds noise in quadrature to the compression
    # error and can even lower the held-out error: DRIFT is the check that sees it.
    "fit": 0.005,
    "same_tokens": 0.015,  # 3 F: the same tokens, or ones picked without near ties (spread <= 0.003)
    # 2- to 8-bit codes: a value rounded across a code boundary moves a whole step (spread <= 0.016;
    # summary_am's fit of its pinned summary moves like a selection, spread 0.012).
    "code_flips": 0.03,
    # Random weights give near-uniform attention (logits ~0.03): these scores are within a few bf16
    # roundings of each other, and bf16 swaps some of the ~20 tokens a head keeps; each swap moves
    # the error by a few percent (spread <= 0.072).
    "near_ties": 0.15,
}


def bound(name: str) -> float:
    """The method's allowed |err_bf16 - err_fp32| / max(1, err_fp32), from its tolerance class."""
    return TOLERANCE[REGISTRY[name].bf16_tolerance]


# drift / F allowed (see the module docstring); spreads over 8 seeds x 3 documents.
DRIFT: dict[str, float] = {
    # Spread 1.4-3.3 F; the solver run in bf16 (solvers.py without its float32 casts) gives 5.8-70 F.
    "attention_matching": 4.5,
    "streaming_llm": 3.0,  # the same tokens, as the full cache stores them: spread 1.2-1.9 F
    "random": 3.0,  # seeded: the same tokens too (spread 1.2-1.9 F)
}

# The dtype-dependent decisions the float32 run replays from the bf16 run: (module, function).
PINNED: dict[str, tuple[ModuleType, str]] = {
    "kivi": (kivi, "context_plan"),
    "beaconkv_mixed": (beaconkv_mixed, "context_plan"),
    "summarisation": (summarisation, "write_summary"),
    "summary_am": (summary_am, "write_summary"),
    # The engine formats' shared byte plan (kvlab/methods/families/engine_format.py), dtype-dependent as KIVI's.
    "fp8_e4m3": (engine_format, "document_tokens"),
    "fp8_e5m2": (engine_format, "document_tokens"),
    "nvfp4": (engine_format, "document_tokens"),
    "fp4_e2m1": (engine_format, "document_tokens"),
    "turboquant": (turboquant, "document_tokens_by_layer"),  # its own plan: the boundary layers cost more per token
}


# Knobs other than the defaults: a summary of 256 tokens is 256 bf16 decode steps (~30 s here).
# TurboQuant keeps its 2 first and 2 last layers unquantised, which on this 2-layer model is all of them.
OPTIONS: dict[str, dict[str, Any]] = {"summary_am": {"summary_tokens": 40}, "turboquant": {"boundary_skip_layers": 0}}


def bf16_twin(lm: LoadedModel) -> LoadedModel:
    """The same model with its parameters in bfloat16, as kvlab.models.load_model puts it on a GPU.

    Parameters only: from_pretrained(dtype=torch.bfloat16) keeps the RoPE inverse
    frequencies (buffers) in float32, while ``model.to(torch.bfloat16)`` would round them
    too and turn every key by up to position x 2^-9 radians more: not the GPU's path.
    """
    model = copy.deepcopy(lm.model)
    for param in model.parameters():
        param.data = param.data.to(torch.bfloat16)
    return dataclasses.replace(lm, name=f"{lm.name}-bf16", model=model, dtype=torch.bfloat16)


@dataclasses.dataclass
class Twins:
    """The float32 and bf16 contexts of one document, and the held-out queries both are measured on."""

    fp32: Context
    bf16: Context
    queries: list[torch.Tensor]


@pytest.fixture(scope="module")
def twins(tiny: LoadedModel) -> Twins:
    fp32 = with_template(tiny)  # every method also keeps a template prefix (2 tokens), as with real models
    ctx32, ctx16 = prepare_context(fp32, DOC), prepare_context(bf16_twin(fp32), DOC)
    # Otherwise the test would compare float32 with float32 and pass for nothing.
    assert ctx32.full.keys[0].dtype == torch.float32 and ctx16.full.keys[0].dtype == torch.bfloat16
    assert ctx16.prefix_len == 2 and ctx16.length == ctx32.length
    return Twins(ctx32, ctx16, evaluation(ctx32, QUESTION, max_new_tokens=4).queries)


def compress_both(name: str, twins: Twins, monkeypatch: pytest.MonkeyPatch) -> tuple[CompressedKV, CompressedKV]:
    """(float32, bf16) stored caches of ``name``; a PINNED decision is the bf16 run's in both."""
    method = get_method(name, **OPTIONS.get(name, {}))
    if name not in PINNED:
        return method.compress(Request(twins.fp32, RATIO, QUESTION)), method.compress(
            Request(twins.bf16, RATIO, QUESTION)
        )
    module, attr = PINNED[name]
    decide: Callable[..., Any] = getattr(module, attr)
    taken: list[Any] = []

    def record(*args: Any, **kwargs: Any) -> Any:
        taken.append(decide(*args, **kwargs))
        return taken[-1]

    monkeypatch.setattr(module, attr, record)
    stored16 = method.compress(Request(twins.bf16, RATIO, QUESTION))
    monkeypatch.setattr(module, attr, lambda *args, **kwargs: taken.pop(0))
    stored32 = method.compress(Request(twins.fp32, RATIO, QUESTION))
    assert not taken, f"{attr} was called more often in the bf16 run than in the float32 one"
    return stored32, stored16


def outputs(stored: CompressedKV, queries: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per layer, the attention outputs [H_kv, g*n, d] (float32) of the grouped ``queries`` over ``stored``."""
    out = []
    for layer, q in enumerate(queries):
        view = stored.layer_view(layer)
        out.append(attend(group_queries(q, view.keys.shape[0]), view.keys, view.values, bias=view.bias).output)
    return out


def drift(
    reference: CompressedKV, stored32: CompressedKV, stored16: CompressedKV, queries: list[torch.Tensor]
) -> float:
    """mean ||y(stored16) - y(stored32)|| / ||y(reference)|| over layers, KV heads and queries."""
    ratios = [
        (y16 - y32).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)
        for ref, y32, y16 in zip(outputs(reference, queries), outputs(stored32, queries), outputs(stored16, queries))
    ]
    return float(torch.stack(ratios).mean())


def test_every_method_has_a_bound():
    assert set(TOLERANCE) == set(typing.get_args(Bf16Tolerance))
    undeclared = sorted(name for name, cls in REGISTRY.items() if getattr(cls, "bf16_tolerance", None) not in TOLERANCE)
    assert not undeclared, f"declare bf16_tolerance ({', '.join(TOLERANCE)}) in: {', '.join(undeclared)}"
    assert set(DRIFT) | set(PINNED) | set(OPTIONS) <= set(REGISTRY)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_bf16_attention_error_stays_within_its_bound_of_float32(
    twins: Twins, name: str, monkeypatch: pytest.MonkeyPatch
):
    stored32, stored16 = compress_both(name, twins, monkeypatch)
    err32 = head_errors(twins.fp32.full.stored, stored32, twins.queries).mean_output
    err16 = head_errors(twins.bf16.full.stored, stored16, twins.queries).mean_output
    allowed = bound(name) * max(1.0, err32)
    assert abs(err16 - err32) <= allowed, (
        f"{name}: attention-output error {err16:.4f} in bf16, {err32:.4f} in float32 "
        f"(|difference| {abs(err16 - err32):.4f} > {allowed:.4f})"
    )

    if name in DRIFT:
        full32, full16 = twins.fp32.full.stored, twins.bf16.full.stored
        floor = drift(full32, full32, full16, twins.queries)
        moved = drift(full32, stored32, stored16, twins.queries)
        assert moved <= DRIFT[name] * floor, (
            f"{name}: bf16 moved the compressed cache's outputs by {moved:.4f}, "
            f"{moved / floor:.1f}x what it moves the full cache's ({floor:.4f}; allowed {DRIFT[name]}x)"
        )

    for layer in stored16.layers:
        for seg in layer:
            view = seg.view()
            assert view.keys.dtype == view.values.dtype == torch.bfloat16, f"{name}: a {seg.fate} segment left bf16"
            bias = getattr(seg, "bias", None)
            # A fitted beta rounded to bf16 keeps 8 bits (kvlab.runtime.attention.causal_attention).
            assert bias is None or bias.dtype == torch.float32, f"{name}: a stored bias in {bias.dtype}"
    lm = twins.bf16.lm
    logits = extend(lm, open_session(lm, stored16), torch.tensor([5, 9, 11], device=lm.device))
    assert torch.isfinite(logits).all()
