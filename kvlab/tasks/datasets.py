"""Tasks read from files: QuALITY and HotpotQA from the evaluation data (:func:`data_dir`), and the bundled examples.

The shared data is evaluation data, not part of the product: the app and its
image never need it, and a task that reads it fails with one clear line when
it is absent. ``KVLAB_DATA`` points elsewhere.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from kvlab.documents import DocumentError
from kvlab.examples import load_examples
from kvlab.tasks.items import TaskError, TaskItem

_QA_INSTRUCTION = "Answer the question from the documents above with a short phrase only."


def data_dir() -> Path:
    """``$KVLAB_DATA``, else ``shared/data`` beside the project folder."""
    env = os.environ.get("KVLAB_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _read_json(name: str, task: str) -> object:
    path = data_dir() / name
    if not path.is_file():
        raise TaskError(f"task {task} needs {path} (set KVLAB_DATA to the folder holding {name})")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TaskError(f"could not read {path}: {exc}") from exc


def choice_question(question: str, options: tuple[str, ...]) -> str:
    """A multiple-choice question turn: the question, then the options, one a line."""
    lines = [f"Question: {question}"] + [f"{chr(65 + i)}. {o}" for i, o in enumerate(options)]
    return "\n".join(lines + ["Answer with the correct option's text."])


def quality(n: int, seed: int) -> list[TaskItem]:
    """QuALITY questions (four options, scored by option log-likelihood), at most ``n``, in file order.

    All questions of an article share its document (and so one prefill).
    """
    articles = _read_json("quality_examples.json", "quality")
    items: list[TaskItem] = []
    for article in articles:
        for qi, q in enumerate(article["questions"]):
            options = tuple(q["options"])
            items.append(
                TaskItem(
                    "quality",
                    f"quality-{article['article_id']}-{qi}",
                    article["text"],
                    question=choice_question(q["question"], options),
                    answers=(options[q["gold_index"]],),
                    scoring="choice",
                    choices=options,
                    gold_index=q["gold_index"],
                )
            )
    return items[:n]


def hotpot_document(entry: dict, seed: int) -> str:
    """The two gold paragraphs and the distractors, shuffled (seeded) into one titled document."""
    paragraphs = [(entry["title_a"], entry["para_a"]), (entry["title_b"], entry["para_b"])]
    paragraphs += [(d[0], d[1]) for d in entry["distractors"]]
    random.Random(f"hotpotqa:{seed}:{entry['_id']}").shuffle(paragraphs)
    return "\n\n".join(f"{title}\n{''.join(sentences).strip()}" for title, sentences in paragraphs)


def hotpotqa(n: int, seed: int) -> list[TaskItem]:
    """HotpotQA in the distractor setting: free-text answers, token F1 and exact match."""
    entries = _read_json("hotpotqa_distractor_dev_sample100.json", "hotpotqa")
    return [
        TaskItem(
            "hotpotqa",
            f"hotpotqa-{e['_id']}-s{seed}",
            hotpot_document(e, seed),
            question=f"{_QA_INSTRUCTION}\nQuestion: {e['question']}",
            answers=(e["answer"],),
            scoring="f1",
            answer_prefix="Answer:",
        )
        for e in entries[:n]
    ]


def examples(n: int, seed: int) -> list[TaskItem]:
    """The bundled examples' suggested questions, asked as the app asks them (no answer prefix)."""
    try:
        bundled = load_examples()
    except DocumentError as exc:
        raise TaskError(str(exc)) from exc
    items = []
    for ex in bundled:
        text = ex.text()
        for qi, (question, answer) in enumerate(zip(ex.questions, ex.answers)):
            aliases = (answer,) if isinstance(answer, str) else tuple(answer)
            items.append(
                TaskItem(
                    "examples",
                    f"examples-{ex.id}-{qi}",
                    text,
                    question=question,
                    answers=aliases,
                    scoring="contains",
                    max_new_tokens=48,
                )
            )
    return items[:n]
