"""kvlab's decoding loop behind transformers' ``model.generate``: its ``custom_generate`` callable.

transformers 5 lets ``generate(..., custom_generate=fn)`` do its usual input
preparation (the generation config and its defaults, ``max_new_tokens``, the
end-of-sequence ids, the logits processors and stopping criteria) and then
hand the decoding loop to ``fn(model, input_ids, logits_processor=...,
stopping_criteria=..., generation_config=..., **model_kwargs)``. (It hands a
callable no ``streamer``: transformers 5.24 passes a callable only the
arguments of its own it declares, ``_extract_generation_mode_kwargs``, and
``streamer`` is one of its loop's, so a streamer given to ``generate`` sees
the prompt and no new token.) :func:`generate_from` is that loop over a stored
kvlab cache: it reads on from the cache's logical length (not from the
number of keys kept), with the cache's per-key biases and ragged heads,
through :func:`kvlab.runtime.decode.extend`, exactly as kvlab's own answers
do; transformers' processors pick each token and its criteria end the loop.

What it refuses, in one line each: more than one sequence (a stored cache is
one document's), padding, a second cache, beam search.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

from kvlab.runtime.cache import CompressedKV
from kvlab.runtime.decode import extend, open_session
from kvlab.runtime.model import LoadedModel


def check_generate_inputs(input_ids: torch.Tensor, generation_config: GenerationConfig, model_kwargs: dict) -> None:
    """ValueError, in one line, for what a stored cache cannot answer through ``generate``."""
    if generation_config.num_beams > 1:  # first: generate has repeated the input once per beam
        raise ValueError(
            f"a kvlab cache decodes greedily or by sampling: num_beams={generation_config.num_beams} is not supported"
        )
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(
            f"a kvlab cache answers one sequence at a time: input_ids must be [1, n], got {list(input_ids.shape)}"
        )
    if model_kwargs.get("attention_mask") is not None:  # generate drops a mask of all ones: this one pads
        raise ValueError("a kvlab cache reads on after its document: input_ids may not be padded (no attention_mask)")
    given = model_kwargs.get("cache")
    if given is not None and given.get_seq_length() > 0:
        raise ValueError("model.generate was given a cache as well: a kvlab cache takes its place, give it none")


def pick_tokens(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """scores [1, V] (after the logits processors) -> the next token [1].

    Greedy picks the argmax of the log-probabilities, as kvlab's own loop does
    (:func:`kvlab.runtime.decode.greedy_loop`): the same token as the argmax of
    the scores, and the same tie-breaking after float rounding.
    """
    if do_sample:
        return torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
    return torch.argmax(torch.log_softmax(scores, dim=-1), dim=-1)


@torch.inference_mode()
def generate_from(
    lm: LoadedModel,
    stored: CompressedKV,
    input_ids: torch.Tensor,
    logits_processor: Any,
    stopping_criteria: Any,
    generation_config: GenerationConfig,
    model_kwargs: dict | None = None,
) -> torch.Tensor | GenerateDecoderOnlyOutput:
    """Decode after ``input_ids`` [1, n] from a working copy of ``stored`` (left untouched).

    Returns ``input_ids`` followed by the new tokens ([1, n + m], on
    ``input_ids``' device), or a GenerateDecoderOnlyOutput with the
    sequences, and the scores and logits when the generation config asks
    for them (``return_dict_in_generate``, ``output_scores``,
    ``output_logits``), as transformers' own loop gives them.
    """
    check_generate_inputs(input_ids, generation_config, model_kwargs or {})
    session = open_session(lm, stored)
    sequences = input_ids
    logits = extend(lm, session, input_ids[0], logits_to_keep=1)[-1:]  # [1, V] float32
    scores: list[torch.Tensor] = []
    raw: list[torch.Tensor] = []
    while True:
        processed = logits_processor(sequences, logits)
        scores.append(processed)
        raw.append(logits)
        token = pick_tokens(processed, generation_config.do_sample)
        sequences = torch.cat([sequences, token.to(sequences.device)[:, None]], dim=-1)
        if bool(stopping_criteria(sequences, processed).all()):
            break
        logits = extend(lm, session, token, logits_to_keep=1)[-1:]
    if not generation_config.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=tuple(scores) if generation_config.output_scores else None,
        logits=tuple(raw) if generation_config.output_logits else None,
    )
