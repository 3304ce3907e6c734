"""What happened to every token of a run, as light plain data a front end can keep per user."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvlab.figures import EVICTED
from kvlab.lab.explore import Explored
from kvlab.metrics import percentile_levels, question_attention


def level_bytes(per_layer: list[torch.Tensor]) -> list[list[bytes]]:
    """Per layer [H_kv, T] scores -> [layer][head] one level byte per token (kvlab.metrics.percentile_levels)."""
    levels = percentile_levels(torch.stack(per_layer)).cpu()  # [L, H_kv, T] bytes, for the front end
    return [[bytes(row.numpy()) for row in layer] for layer in levels]


@dataclass
class TokenFates:
    """What happened to every context token in every layer and KV head of a run: plain, light data.

    codes[layer][head] holds one byte per context token, an index into
    ``names`` (0: evicted). levels[source][layer][head] holds one byte per
    context token for each intensity source the run has ("score": the
    method's own score, absent for a method without one; "question": the
    question's attention over the full cache): 0 for a token without a
    score, else its percentile rank within the head (1-255). This is what the
    app keeps per user between runs, instead of the run and its cache.
    """

    token_texts: list[str]
    names: list[str]
    codes: list[list[bytes]]
    levels: dict[str, list[list[bytes]]] = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return len(self.codes)

    @property
    def n_kv_heads(self) -> int:
        return len(self.codes[0]) if self.codes else 0

    @classmethod
    def of(cls, ex: Explored) -> TokenFates:
        names, index = [EVICTED], {EVICTED: 0}
        n = len(ex.token_texts)
        codes = []
        for layer in range(ex.n_layers):
            row = []
            for head in range(ex.n_kv_heads):
                buf = bytearray(n)
                for i, fate in ex.run.stored.fates(layer, head).items():
                    if 0 <= i < n:
                        if fate not in index:
                            index[fate] = len(names)
                            names.append(fate)
                        buf[i] = index[fate]
                row.append(bytes(buf))
            codes.append(row)
        run, ev = ex.run, ex.run.evaluation
        # The same for every method's run on this question (the full cache's attention): made once per context.
        levels = {"question": run.ctx.cached(
            "memos", ("question levels", ev.question, tuple(ev.answer.ids)),
            lambda: level_bytes(question_attention(ev.queries, run.ctx.full.keys)), ev.question,
        )}
        if run.stored.importance is not None:
            levels["score"] = level_bytes(run.stored.importance)
        return cls(ex.token_texts, names, codes, levels)

    def fates(self, layer: int, head: int) -> dict[int, str]:
        """Token index -> fate, for the tokens not evicted in one layer and KV head."""
        return {i: self.names[c] for i, c in enumerate(self.codes[layer][head]) if c}
