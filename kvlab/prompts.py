"""Where the document and the questions go in the model's chat template.

The document is the start of the user turn; a question (or the repeat
instruction) continues that turn after the cached context, then the assistant
turn opens. Each piece is tokenised on its own, so the document's token span
is exact and the context cache can be reused for any continuation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

_MARK = "\x00KVLAB-DOCUMENT\x00"
#: The repeat-prefill prompt: KVzip's (and kvpress's) wording. One repeat pass per
#: document serves KVzip's reconstruction and Attention Matching's reference queries.
REPEAT_INSTRUCTION = "Repeat the previous context exactly."


@dataclass(frozen=True)
class Template:
    """The chat template cut around the user's content.

    prefix: everything before the user content (system prompt, turn header);
    suffix: what closes the user turn and opens the assistant's;
    label: what goes before a question (a base model's "Question: "; a chat turn needs none).
    """

    prefix: str
    suffix: str
    label: str = ""

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> "Template":
        if getattr(tokenizer, "chat_template", None):
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": _MARK}], tokenize=False, add_generation_prompt=True
            )
            prefix, suffix = rendered.split(_MARK)
            return cls(prefix, suffix)
        # Base models: a plain reading-comprehension layout, "<document>\n\nQuestion: ...\nAnswer:".
        return cls("", "\nAnswer:", "Question: ")


def answer_end_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Tokens that end an answer besides end-of-sequence: in the plain layout, a line break.

    A base model's answer is the rest of the "Answer:" line; after it, the model
    writes its own next "Question:" (Gemma 3 270M does), which is not the answer.
    A chat model's end-of-turn token ends its answer (kvlab.runtime.decode), so
    none here. The ids of one to three newlines that are single tokens.
    """
    if getattr(tokenizer, "chat_template", None):
        return set()
    singles = (tokenizer(breaks, add_special_tokens=False).input_ids for breaks in ("\n", "\n\n", "\n\n\n"))
    return {ids[0] for ids in singles if len(ids) == 1}


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> torch.Tensor:
    """Token ids [n] of ``text`` with special tokens parsed, none added.

    On the CPU: ids are the tokenizer's, and the decode path moves what it feeds to the model's device.
    """
    return torch.tensor(tokenizer(text, add_special_tokens=False).input_ids, dtype=torch.long, device="cpu")


@dataclass(frozen=True)
class ContextTokens:
    """The cached context: template prefix then document. ids: [prefix_len + doc_len]."""

    ids: torch.Tensor
    prefix_len: int

    @property
    def doc_len(self) -> int:
        return self.ids.numel() - self.prefix_len


def context_tokens(tokenizer: PreTrainedTokenizerBase, document: str) -> ContextTokens:
    template = Template.of(tokenizer)
    prefix = encode(tokenizer, template.prefix)
    if tokenizer.bos_token_id is not None and (prefix.numel() == 0 or prefix[0] != tokenizer.bos_token_id):
        # What the tokenizer itself puts first (its post-processor; transformers 5 does not keep an
        # add_bos_token flag through save_pretrained, so the flag alone would lose Gemma's <bos>).
        if tokenizer("").input_ids[:1] == [tokenizer.bos_token_id]:
            prefix = torch.cat([torch.tensor([tokenizer.bos_token_id], device="cpu"), prefix])
    return ContextTokens(torch.cat([prefix, encode(tokenizer, document)]), prefix.numel())


def question_tokens(tokenizer: PreTrainedTokenizerBase, question: str) -> torch.Tensor:
    """The question turn asked after the context: ids [n], ending where the answer starts."""
    template = Template.of(tokenizer)
    return encode(tokenizer, "\n\n" + template.label + question.strip() + template.suffix)


def repeat_tokens(
    tokenizer: PreTrainedTokenizerBase, doc_ids: torch.Tensor, instruction: str = REPEAT_INSTRUCTION
) -> torch.Tensor:
    """The repeat instruction, then the document itself as the (teacher-forced) answer."""
    return torch.cat([question_tokens(tokenizer, instruction), doc_ids])
