"""Random-weights models built in code: large geometries with no download.

The memory benchmark (``python -m benchmarks.memory_model``) and the GPU
script (``python -m benchmarks.gpu_h200``) need the shapes of real models
(Llama-3.1-8B's heads and head size) at long context, not their knowledge:
memory and speed depend on the geometry only.
"""
from __future__ import annotations

from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from kvlab.models import ATTENTION_NAME, LoadedModel, register_attention


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over ``<unk>``, ``<eos>`` and words w0 .. w{vocab_size - 3}.

    Any text of those words is one token per word, so a document of exactly
    N tokens is N words.
    """
    vocab = {"<unk>": 0, "<eos>": 1} | {f"w{i}": i + 2 for i in range(vocab_size - 2)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def random_llama(config: dict[str, Any], device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """A Llama with random weights, initialised directly on ``device``, kvlab's attention switched on.

    config: LlamaConfig fields (layers, heads, sizes...).
    """
    with torch.device(device):
        model = LlamaForCausalLM._from_config(LlamaConfig(**config), dtype=dtype)
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    return model.eval()


def synthetic_lm(config: dict[str, Any], name: str, seed: int = 0) -> LoadedModel:
    """A seeded random Llama on the CPU in float32 with a word tokenizer of its vocabulary."""
    torch.manual_seed(seed)
    config = {"eos_token_id": 1, "bos_token_id": None, "pad_token_id": None, **config}
    model = random_llama(config, torch.device("cpu"), torch.float32)
    return LoadedModel(name, model, word_tokenizer(config["vocab_size"]), torch.device("cpu"), torch.float32)
