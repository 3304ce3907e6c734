"""The bundled examples against the model that reads them (the embedded one, or a long example's own:
kvlab.examples.Example.model): token counts, and the suggested questions.

A suggested question the model gets wrong from its full cache shows nothing
about compression; each must be answered right before any method is tried.
"""

from __future__ import annotations

import pytest

from kvlab.context_store import CONTEXTS
from kvlab.examples import Example, load_examples
from kvlab.models import get_model
from kvlab.pipeline import DEFAULT_MAX_NEW_TOKENS, evaluation
from kvlab.tasks.marking import contains_match

pytestmark = pytest.mark.slow  # the embedded model answers every suggested question: left out of make test-fast

EXAMPLES = load_examples()


def reader(example: Example, embedded):
    """The model the page reads ``example`` with: its own, else the embedded one."""
    return embedded if example.model is None else get_model(example.model)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda ex: ex.id)
def test_manifest_token_count_is_the_tokenizers(embedded, example):
    # The tokenizer alone, without the chat template around the document.
    ids = reader(example, embedded).tokenizer(example.text(), add_special_tokens=False)["input_ids"]
    assert example.tokens == len(ids)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda ex: ex.id)
def test_full_cache_answers_every_suggested_question(embedded, example):
    # Asked as the app asks: the prepared document, greedy, the app's default answer length.
    ctx = CONTEXTS.get(reader(example, embedded), example.text())
    answers = {q: evaluation(ctx, q, DEFAULT_MAX_NEW_TOKENS).answer.text for q in example.questions}
    wrong = [
        (q, gold, answers[q])
        for q, gold in zip(example.questions, example.aliases)
        if not contains_match(answers[q], gold)
    ]
    assert not wrong
