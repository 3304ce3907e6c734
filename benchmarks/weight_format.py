"""A smaller weight format for decoding on a CPU: what 4-bit weights would buy and what they would change.

    python -m benchmarks.weight_format [--new-tokens 48]

The embedded model's file stores every projection as GGUF Q4_1 (groups of
32 weights along the input, ``w = d q + m`` with q in 0..15); transformers
dequantises them to float32, so the model kvlab runs is exactly those 4-bit
groups. This benchmark recovers the groups from the float32 weights (and
checks the recovery is exact), packs them for PyTorch's CPU int4 kernel
(``aten._weight_int4pack_mm_for_cpu``: ``w = (q - 8) s + z`` per group, so
``s = d`` and ``z = m + 8 d``) and answers the bundled examples' questions
from the full cache twice, one question after the other:

- float32: kvlab's answer loop as it is (the lean forward);
- int4: the same loop with every one-token step's q/k/v, output, gate/up
  and down projections through the int4 kernel. Its fast path takes
  bfloat16 activations and bfloat16 scales only (float32 activations run a
  scalar path many times slower), so the model then computes each
  projection's input and scales in bfloat16. Multi-token passes (the
  question turn) stay in float32.

Printed per question: both answers, whether each is right, and the answer
time of each; then the answers that changed, the accuracy of both, and the
ratio of the two total answer times measured in the same run. Where the
int4 answers lose a bundled answer the format is not adopted (issue #20: a
smaller format only if the bundled examples' answers still hold).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Iterator

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
    """One projection's 4-bit groups packed for the CPU kernel: packed [N, K / 2] uint8, scale_zero [K / 32, N, 2] bf16."""

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


def pack_model(lean: LeanModel) -> dict[int, Int4Weight]:
    """Every projection of the lean model packed, by its float32 weight's data pointer."""
    return {
        w.data_ptr(): pack(w)
        for layer in lean.layers
        for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
    }


class _Int4Steps:
    """``torch.nn.functional`` as the lean forward calls it, with one-token projections through the int4 kernel."""

    def __init__(self, weights: dict[int, Int4Weight]) -> None:
        self.weights = weights

    def __getattr__(self, name: str):
        return getattr(F, name)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        int4 = self.weights.get(weight.data_ptr())
        if int4 is None or x.shape[0] != 1:
            return F.linear(x, weight, bias)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), int4.packed, GROUP, int4.scale_zero).float()
        return y if bias is None else y + bias


@contextlib.contextmanager
def int4_steps(weights: dict[int, Int4Weight]) -> Iterator[None]:
    """Within the block, the lean forward's one-token projections use the int4 weights."""
    lean_module.F = _Int4Steps(weights)
    try:
        yield
    finally:
        lean_module.F = F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=48, help="answer length cap (the app's default, 48)")
    args = parser.parse_args()
    lm = get_model()
    lean = lean_model(lm.model)
    if lean is None:
        raise SystemExit("the lean forward does not support this model")
    weights = pack_model(lean)
    print(f"{len(weights)} projections recovered exactly as Q4_1 groups of {GROUP} and packed for the int4 kernel")
    contexts, rows = {}, []
    for item in examples(100, 0):
        item = dataclasses.replace(item, max_new_tokens=args.new_tokens)
        ctx = contexts.get(item.document) or contexts.setdefault(item.document, prepare_context(lm, item.document))
        prompt = item_prompt_ids(lm, item)
        start = time.perf_counter()
        dense = answer_item(lm, ctx.full.stored, item, prompt)
        dense_s = time.perf_counter() - start
        with int4_steps(weights):
            start = time.perf_counter()
            small = answer_item(lm, ctx.full.stored, item, prompt)
            small_s = time.perf_counter() - start
        rows.append((item, dense, small, dense_s, small_s))
        print(f"{item.item_id}: float32 {'right' if dense.score >= 1 else 'wrong'} {dense_s:.1f} s "
              f"| int4 {'right' if small.score >= 1 else 'wrong'} {small_s:.1f} s"
              f"{'' if small.answer == dense.answer else '  (answer changed)'}", flush=True)
        if small.answer != dense.answer:
            print(f"    float32: {dense.answer!r}\n    int4:    {small.answer!r}")
    n = len(rows)
    changed = sum(r[1].answer != r[2].answer for r in rows)
    right = [sum(r[i].score >= 1 for r in rows) for i in (1, 2)]
    total = [sum(r[i] for r in rows) for i in (3, 4)]
    print()
    print("| weights | bundled answers right | answers changed | answer time, all questions |")
    print("|---|---|---|---|")
    print(f"| float32 (the model as loaded) | {right[0]}/{n} | - | {total[0]:.1f} s |")
    print(f"| int4 groups, bf16 activations in one-token steps | {right[1]}/{n} | {changed}/{n} | {total[1]:.1f} s "
          f"({total[0] / total[1]:.2f}x faster) |")
    verdict = "hold" if right[1] >= right[0] and changed == 0 else "do not hold"
    print(f"\nThe bundled answers {verdict} with int4 steps.")


if __name__ == "__main__":
    main()
