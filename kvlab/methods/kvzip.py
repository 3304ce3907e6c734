"""KVzip (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction").

Query-agnostic: after the document, the model is asked to repeat it
("Repeat the previous context exactly.", the paper's and kvpress's prompt)
and is teacher-forced through the document again. A key's score is the
largest attention it receives from any of those reconstruction queries and
any query head of its GQA group: a token the model needs to rebuild the
context is a token worth keeping. As in the paper's code and kvpress, each
reconstruction query's softmax runs over the first ``n_sink`` context tokens,
the document and the reconstruction's own tokens (causal).

The scores are then pruned globally across all layers and heads by default
(kvpress's ``layerwise=False``): heads keep different numbers of tokens
(ragged), the total stays what the ratio allows. ``prune=layer`` shares each
layer's total among its heads (kvpress's ``layerwise=True``); ``prune=head``
gives every head the uniform budget.

Deliberate differences from kvpress's KVzipPress: kvlab keeps the template
prefix (kvpress scores it 0 beyond the sinks, so it is evicted first), and
reconstructs the whole document in one pass (kvpress and the paper's code
replay contexts longer than ``chunk_size`` = 2048 tokens chunk by chunk, with
a "Repeat the part of the previous context exactly, starting with ..." prompt).
"""

from __future__ import annotations

import torch

from kvlab.compression.paper import Paper
from kvlab.compression.registry import register
from kvlab.compression.request import Request
from kvlab.methods.families.kvzip_pruning import KVzipPruning
from kvlab.methods.families.scorers import KVzipOptions, kvzip_scores


@register
class KVzip(KVzipPruning):
    name = "kvzip"
    summary = "query-agnostic: max attention while the model repeats the document; pruned across heads (ragged)"
    paper = Paper(
        "Kim et al.", 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction", arxiv="2505.23416"
    )
    family = "selection"
    bf16_tolerance = "near_ties"
    Options = KVzipOptions

    def scores(self, req: Request) -> list[torch.Tensor]:
        return kvzip_scores(req, self.options)
