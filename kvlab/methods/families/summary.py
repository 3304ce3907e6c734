"""What the summarising methods share (kvlab/methods/summarisation.py, summary_am.py): the request
for a summary and the greedy writing of it after the document."""

from __future__ import annotations

import torch

from kvlab.runtime.cache import CompressedKV
from kvlab.runtime.decode import extend, open_session, stop_token_ids
from kvlab.runtime.model import LoadedModel

SUMMARY_PROMPT = "Summarise the text above in about {words} words. Keep the names, numbers and dates."


def write_summary(
    lm: LoadedModel, stored: CompressedKV, prompt_ids: torch.Tensor, n_tokens: int, fill: bool
) -> list[int]:
    """Greedy summary ids after ``prompt_ids``: 1 to ``n_tokens`` of them, exactly ``n_tokens`` with ``fill``."""
    session = open_session(lm, stored)
    stops = stop_token_ids(lm)
    banned = torch.tensor(sorted(stops), dtype=torch.long, device=lm.device)
    logits = extend(lm, session, prompt_ids, logits_to_keep=1)[-1]
    ids: list[int] = []
    while len(ids) < n_tokens:
        if (fill or not ids) and banned.numel():  # never an empty summary
            logits = logits.index_fill(0, banned, float("-inf"))
        token = int(torch.argmax(logits))
        if token in stops:
            break
        ids.append(token)
        if len(ids) < n_tokens:
            logits = extend(lm, session, torch.tensor([token], device=lm.device), logits_to_keep=1)[-1]
    return ids
