"""A smaller weight format for decoding on a CPU: what each would buy and what it would change.

    python -m benchmarks.weight_format [--new-tokens 48] [--formats fp16,bf16,int8,int4]

Issue #20 allows a smaller weight format (fp16/int8 weights) for the answer
loop only if the bundled examples' answers still hold. Each format here is
PyTorch's own CPU kernel for it, run on every one-token step's q/k/v,
output, gate/up and down projections (and the head where the format can
hold it); multi-token passes (the question turn) stay float32:

- fp16: float16 weights, float32 activations (fbgemm's packed fp16 GEMM,
  ``quantized.linear_dynamic_fp16``);
- bf16: bfloat16 weights and activations (oneDNN's packed weights,
  ``mkldnn._linear_pointwise``, AMX where the CPU has it);
- int8: int8 weights per output channel, activations quantised to 8 bits
  per call (PyTorch's dynamic quantisation, fbgemm);
- int4: the file's own 4-bit groups. The embedded model's file stores every
  projection as GGUF Q4_1 (groups of 32 weights along the input,
  ``w = d q + m`` with q in 0..15); transformers dequantises them to
  float32, so the model kvlab runs is exactly those groups. The benchmark
  recovers them (and checks the recovery is exact) and packs them for
  ``aten._weight_int4pack_mm_for_cpu`` (``w = (q - 8) s + z`` per group, so
  ``s = d`` and ``z = m + 8 d``), whose fast path takes bfloat16
  activations and scales only (float32 activations run a scalar path many
  times slower). The head (the tied embedding) is not Q4_1 and stays
  float32.

The bundled examples' questions are answered from the full cache in
float32 and then in each format, one question after the other. Printed per
question: whether each answer is right, its time, and any answer that
changed; then per format the bundled answers right, the answers changed,
the total answer time and its ratio to float32's in the same run, the
time per written token (answers that change also change length; the
question turn is included), and the time of one token's weight matmuls
alone in that format (the floor of a step). A format is adoptable only
where no bundled answer changes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kvlab.runtime.lean as lean_module  # noqa: E402
from kvlab.context import prepare_context  # noqa: E402
from kvlab.models import get_model  # noqa: E402
from kvlab.runtime.lean import LeanModel, lean_model  # noqa: E402
from kvlab.tasks.datasets import examples  # noqa: E402
from kvlab.tasks.runner import answer_item, item_prompt_ids  # noqa: E402

GROUP = 32  # Q4_1's block: 32 weights along the input share d and m


@dataclass
class Int4Weight:
    """One projection's 4-bit groups packed for the CPU kernel.

    packed [N, K / 2] uint8, scale_zero [K / 32, N, 2] bf16.
    """

    packed: torch.Tensor
    scale_zero: torch.Tensor


def q4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K] in 0..15, d [N, K/32], m [N, K/32]) with ``weight == d q + m`` group by group.

    Q4_1 puts each group's minimum at q = 0 and its maximum at q = 15, so
    m is the group's minimum and d its range over 15. Raises ValueError when
    the weight is not such groups exactly (another file type, or a model
    whose weights were never 4-bit).
    """
    n, k = weight.shape
    groups = weight.view(n, k // GROUP, GROUP)
    m = groups.amin(-1)
    d = (groups.amax(-1) - m) / 15
    q = ((groups - m[..., None]) / d.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).round().clamp(0, 15)
    if not torch.equal(q * d[..., None] + m[..., None], groups):
        raise ValueError("the weights are not Q4_1 groups of 32 exactly")
    return q.view(n, k), d, m


def pack(weight: torch.Tensor) -> Int4Weight:
    q, d, m = q4_groups(weight)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 8)
    scale_zero = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return Int4Weight(packed, scale_zero)


#: A format's kernel for one weight [N, K]: the one-token projection x [1, K] float32 -> [1, N] float32.
Step = Callable[[torch.Tensor], torch.Tensor]


def int4_step(weight: torch.Tensor) -> Step:
    """One-token projection through the int4 kernel: x [1, K] float32 -> [1, N] float32."""
    int4 = pack(weight)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16), int4.packed, GROUP, int4.scale_zero
    ).float()


def fp16_step(weight: torch.Tensor) -> Step:
    """float16 weights, float32 activations (fbgemm's packed fp16 GEMM)."""
    packed = torch.ops.quantized.linear_prepack_fp16(weight, None)
    return lambda x: torch.ops.quantized.linear_dynamic_fp16(x, packed)


def bf16_step(weight: torch.Tensor) -> Step:
    """bfloat16 weights and activations (oneDNN's packed weights for one row; on a CPU whose oneDNN has
    no bf16 path, without AVX-512 or AVX-NE-CONVERT, PyTorch's own bf16 matmul: the same rounding, slower)."""
    w16 = weight.to(torch.bfloat16)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w16, 1)
    except RuntimeError:
        return lambda x: torch.nn.functional.linear(x.to(torch.bfloat16), w16).float()
    return lambda x: torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", [], "").float()


def int8_step(weight: torch.Tensor) -> Step:
    """int8 weights, symmetric per output channel; activations quantised per call (dynamic quantisation)."""
    n, k = weight.shape
    scale = (weight.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    # PyTorch's dynamic-quantisation modules still build on its quantized tensors, which warn that they are
    # deprecated; the kernel measured is the one those modules call.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        layer = torch.ao.nn.quantized.dynamic.Linear(k, n, bias_=False)
        zero = torch.zeros(n, dtype=torch.long, device=weight.device)
        layer.set_weight_bias(torch.quantize_per_channel(weight, scale.double(), zero, 0, torch.qint8), None)
    return layer


@dataclass(frozen=True)
class Format:
    """A weight format: its name, the table's description, and its kernel's builder for one weight."""

    name: str
    label: str
    step: Callable[[torch.Tensor], Step]
    head: bool  # whether the head (the tied embedding, not Q4_1) runs in the format too


FORMATS = {
    f.name: f
    for f in (
        Format("fp16", "fp16 weights, float32 activations (fbgemm)", fp16_step, True),
        Format("bf16", "bf16 weights and activations (oneDNN, packed)", bf16_step, True),
        Format("int8", "int8 weights per channel, int8 dynamic activations (fbgemm)", int8_step, True),
        Format("int4", "the file's 4-bit groups, bf16 activations and scales (head float32)", int4_step, False),
    )
}


def build_steps(lean: LeanModel, fmt: Format) -> dict[int, Step]:
    """Every projection's one-token kernel in ``fmt`` (and the head's), by its float32 weight's data pointer."""
    weights = [w for layer in lean.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    if fmt.head:
        weights.append(lean.lm_head.weight)
    return {w.data_ptr(): fmt.step(w) for w in weights}


class _Steps:
    """``torch.nn.functional`` as the lean forward calls it, with one-token projections through a format's kernels."""

    def __init__(self, steps: dict[int, Step]) -> None:
        self.steps = steps

    def __getattr__(self, name: str):
        return getattr(F, name)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        step = self.steps.get(weight.data_ptr())
        if step is None or x.shape[0] != 1:
            return F.linear(x, weight, bias)
        y = step(x)
        return y if bias is None else y + bias


class _Head(torch.nn.Module):
    """The model's head with one-token rows through a format's kernel (``lean.lm_head`` is called on [keep, D])."""

    def __init__(self, head: torch.nn.Linear, steps: _Steps) -> None:
        super().__init__()
        self.head, self.steps = head, steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.steps.linear(x, self.head.weight)


@contextlib.contextmanager
def format_steps(lean: LeanModel, steps: dict[int, Step]) -> Iterator[None]:
    """Within the block, the lean forward's one-token projections (and head) use the format's kernels."""
    functional, head = _Steps(steps), lean.lm_head
    lean_module.F, lean.lm_head = functional, _Head(head, functional)
    try:
        yield
    finally:
        lean_module.F, lean.lm_head = F, head


def matmul_floor_ms(lean: LeanModel, steps: dict[int, Step] | None, repeats: int = 5) -> float:
    """Milliseconds of one token's weight matmuls alone (every projection and the head), best of ``repeats``:
    float32 ``F.linear`` where ``steps`` has no kernel for a weight."""
    weights = [w for layer in lean.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    weights.append(lean.lm_head.weight)
    calls = [(steps or {}).get(w.data_ptr(), lambda x, w=w: F.linear(x, w)) for w in weights]
    inputs = [torch.ones(1, w.shape[1], dtype=w.dtype, device=w.device) for w in weights]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for call, x in zip(calls, inputs):
                call(x)
            best = min(best, time.perf_counter() - start)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=48, help="answer length cap (the app's default, 48)")
    parser.add_argument(
        "--formats",
        default=",".join(FORMATS),
        help=f"comma-separated formats to try (default: all of {', '.join(FORMATS)})",
    )
    args = parser.parse_args(argv)
    chosen = [f.strip() for f in args.formats.split(",") if f.strip()]
    unknown = [f for f in chosen if f not in FORMATS]
    if unknown or not chosen:
        parser.error(f"unknown format(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(FORMATS)}")
    if args.new_tokens < 1:
        parser.error("--new-tokens must be at least 1")
    lm = get_model()
    lean = lean_model(lm.model)
    if lean is None:
        print("the lean forward does not support this model", flush=True)
        return 2
    steps = {name: build_steps(lean, FORMATS[name]) for name in chosen}
    print(
        f"{len(lean.layers) * 4} projections per format; int4: recovered exactly as Q4_1 groups of {GROUP}"
        if "int4" in steps
        else f"{len(lean.layers) * 4} projections per format",
        flush=True,
    )
    contexts = {}
    answers: dict[str, list] = {name: [] for name in ["float32", *chosen]}
    seconds: dict[str, float] = {name: 0.0 for name in answers}
    written: dict[str, int] = {name: 0 for name in answers}
    for item in examples(100, 0):
        item = dataclasses.replace(item, max_new_tokens=args.new_tokens)
        ctx = contexts.get(item.document) or contexts.setdefault(item.document, prepare_context(lm, item.document))
        prompt = item_prompt_ids(lm, item)
        line = []
        for name in answers:
            with format_steps(lean, steps[name]) if name in steps else contextlib.nullcontext():
                start = time.perf_counter()
                outcome = answer_item(lm, ctx.full.stored, item, prompt)
                elapsed = time.perf_counter() - start
            answers[name].append(outcome)
            seconds[name] += elapsed
            written[name] += len(lm.tokenizer(outcome.answer, add_special_tokens=False).input_ids)
            changed = name != "float32" and outcome.answer != answers["float32"][-1].answer
            line.append(
                f"{name} {'right' if outcome.score >= 1 else 'wrong'} {elapsed:.1f} s{' (changed)' if changed else ''}"
            )
        print(f"{item.item_id}: " + " | ".join(line), flush=True)
        for name in chosen:
            if answers[name][-1].answer != answers["float32"][-1].answer:
                print(f"    float32: {answers['float32'][-1].answer!r}\n    {name}: {answers[name][-1].answer!r}")
    floors = {name: matmul_floor_ms(lean, steps.get(name)) for name in answers}
    n = len(answers["float32"])
    print(
        "\n| weights | bundled answers right | answers changed | answer time, all questions | "
        "per written token | one token's weight matmuls |"
    )
    print("|---|---|---|---|---|---|")
    per_token = {name: seconds[name] / max(1, written[name]) * 1e3 for name in answers}
    for name in answers:
        right = sum(o.score >= 1 for o in answers[name])
        label = "float32 (the model as loaded)" if name == "float32" else FORMATS[name].label
        changed = (
            "-"
            if name == "float32"
            else f"{sum(a.answer != b.answer for a, b in zip(answers[name], answers['float32']))}/{n}"
        )
        print(
            f"| {label} | {right}/{n} | {changed} "
            f"| {seconds[name]:.1f} s ({seconds['float32'] / seconds[name]:.2f}x) | "
            f"{per_token[name]:.1f} ms ({per_token['float32'] / per_token[name]:.2f}x) "
            f"| {floors[name]:.1f} ms ({floors['float32'] / floors[name]:.2f}x) |"
        )
    holding = [name for name in chosen if all(a.answer == b.answer for a, b in zip(answers[name], answers["float32"]))]
    print(f"\nformats whose bundled answers all hold: {', '.join(holding) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
