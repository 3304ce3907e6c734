"""Random-weights models built in code: large geometries, or tiny models of each family, with no download.

The memory benchmark (``python -m benchmarks.memory_model``) and the GPU
script (``python -m benchmarks.gpu_check``) need the shapes of real models
(Llama-3.1-8B's heads and head size) at long context, not their knowledge:
memory and speed depend on the geometry only.

The tests need the architectures researchers use, as tiny models
(:func:`random_model`; tests/conftest.py's ``tiny`` Llama is :func:`tiny_llama`): one per family
of :data:`FAMILIES`, each built from its own transformers config class so that the family's own modelling code
runs (Llama 3.1's RoPE scaling, Qwen2's q/k/v biases, Qwen3's and Gemma 3's
q/k norms, Gemma 3's interleaved sliding and global layers).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kvlab.runtime.adopt import take_over
from kvlab.runtime.model import LoadedModel


@dataclass(frozen=True)
class Family:
    """An architecture: its transformers classes and what its tiny model sets on top of :data:`TINY`."""

    config_class: type[PretrainedConfig]
    model_class: type[PreTrainedModel]
    tiny: dict[str, Any] = field(default_factory=dict)


#: The geometry every tiny model shares: 64 hidden, 2 layers, 4 query heads over 2 KV heads of
#: dimension 16, a 64-word vocabulary (:func:`word_tokenizer`). initializer_range 0.1 rather than
#: transformers' 0.02: attention that is not nearly uniform, so that a wrong key changes the logits.
TINY: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,
}

#: Llama 3.1's RoPE ("llama3": theta 500000, factor 8, low/high frequency factors 1 and 4) with its
#: original context scaled down from 8192 to 32, so that the scaled and smoothed bands are the
#: frequencies a 40-token test context actually turns through.
LLAMA_31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

FAMILIES: dict[str, Family] = {
    "llama": Family(LlamaConfig, LlamaForCausalLM, {"rope_parameters": LLAMA_31_ROPE}),
    "qwen2": Family(Qwen2Config, Qwen2ForCausalLM),  # q/k/v biases are Qwen2's own (no config field)
    "qwen3": Family(Qwen3Config, Qwen3ForCausalLM),  # q/k norms, no biases
    # Mistral v0.3 / Nemo: no sliding window (v0.1's window: tests/test_architectures.py builds it).
    "mistral": Family(MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    # Gemma 3 with sliding layers interleaved with a global one (Gemma 3 has five to one), a window
    # as long as the context and one RoPE for both layer types; Gemma 3 as released (a window shorter
    # than the document, two RoPEs, another scaling) is built in tests/test_architectures.py.
    "gemma3": Family(
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "sliding_window": 512,
            "query_pre_attn_scalar": 16,  # = head_dim
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
}

#: Token ids of :func:`word_tokenizer`'s vocabulary, for every config built here.
SPECIAL_IDS = {"eos_token_id": 1, "bos_token_id": None, "pad_token_id": None}


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer over ``<unk>``, ``<eos>`` and words w0 .. w{vocab_size - 3}.

    Any text of those words is one token per word, so a document of exactly
    N tokens is N words.
    """
    vocab = {"<unk>": 0, "<eos>": 1} | {f"w{i}": i + 2 for i in range(vocab_size - 2)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte (ids 0-255) plus ``<|im_start|>`` and ``<|im_end|>`` (end of turn, eos)."""
    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"]
    )
    fast.chat_template = CHATML
    return fast


def perturb_constant_init(model: PreTrainedModel, scale: float = 0.1) -> None:
    """Add seeded noise to every bias and norm weight of ``model``, in place.

    transformers initialises biases to 0 and norm weights to 1 (Gemma's norm
    offsets to 0): a random model built that way has q/k/v biases and q/k
    norms that do nothing, and could not tell a Qwen2 from a Llama.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * scale)


def random_weights(
    family: str,
    config: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
    name: str | None = None,
    perturb: bool = True,
) -> PreTrainedModel:
    """A ``family`` model of ``config`` (its config class's fields) with random weights on ``device``,
    kvlab's attention switched on; kvlab.runtime.model.ModelLoadError, naming ``name``, if kvlab does not support it.
    perturb: :func:`perturb_constant_init` (off: transformers' own initialisation, biases 0 and norms 1)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose from: {', '.join(FAMILIES)}")
    spec = FAMILIES[family]
    # A copy: config classes standardise nested dicts (rope_parameters) in place.
    config = copy.deepcopy(config)
    with torch.device(device):
        model = spec.model_class._from_config(spec.config_class(**config), dtype=dtype)
        if perturb:
            perturb_constant_init(model)
    return take_over(model, name or f"random {family}")


def random_llama(config: dict[str, Any], device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    """A Llama with random weights, initialised directly on ``device``, kvlab's attention switched on.

    config: LlamaConfig fields (layers, heads, sizes...).
    """
    return random_weights("llama", config, device, dtype)


def synthetic_lm(
    config: dict[str, Any],
    name: str,
    seed: int = 0,
    family: str = "llama",
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    tokenizer: PreTrainedTokenizerFast | None = None,
    perturb: bool = True,
) -> LoadedModel:
    """A seeded random ``family`` model (float32 on the CPU unless told) reading through ``tokenizer``.

    config: the family config class's fields. tokenizer: default, a word
    tokenizer of the vocabulary (its special ids are the defaults); another
    one's eos id is set in the config. perturb: as :func:`random_weights`.
    """
    device = device or torch.device("cpu")
    torch.manual_seed(seed)
    if tokenizer is None:
        config, tokenizer = {**SPECIAL_IDS, **config}, word_tokenizer(config["vocab_size"])
    else:
        config = {**SPECIAL_IDS, **config, "eos_token_id": tokenizer.eos_token_id}
    model = random_weights(family, config, device, dtype, name, perturb)
    return LoadedModel(name, model, tokenizer, device, dtype)


def random_model(
    family: str,
    config_overrides: dict[str, Any] | None = None,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> LoadedModel:
    """The tiny model of ``family`` (:data:`TINY` plus the family's settings, then ``config_overrides``),
    named ``tiny-<family>``: seeded random weights, kvlab's attention, a word tokenizer over w0..w61."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose from: {', '.join(FAMILIES)}")
    config = {**TINY, **FAMILIES[family].tiny, **(config_overrides or {})}
    return synthetic_lm(config, f"tiny-{family}", seed, family, device, dtype)


def tiny_llama(seed: int = 0) -> LoadedModel:
    """The tests' everyday model, "tiny-llama": :data:`TINY`'s geometry as a plain Llama (default RoPE),
    transformers' own initialisation (initializer_range 0.02, nothing perturbed), the word tokenizer."""
    return synthetic_lm({**TINY, "initializer_range": 0.02}, "tiny-llama", seed, perturb=False)


def save_tiny_llama(folder: Path, tokenizer: PreTrainedTokenizerFast, seed: int = 0, **config_overrides: Any) -> Path:
    """A random Llama of :data:`TINY`'s geometry (transformers' own initialisation, ``seed``) and ``tokenizer``,
    written by save_pretrained into ``folder`` as a model folder for ``--model DIR``; ``config_overrides``
    on top (e.g. the vocabulary of another tokenizer). Returns ``folder``."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY, "initializer_range": 0.02, **SPECIAL_IDS, **config_overrides})
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
