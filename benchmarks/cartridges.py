"""Cartridges against Attention Matching: compression time and the answer, on the story.

    python -m benchmarks.cartridges                       # the embedded model, the story, 10x
    python -m benchmarks.cartridges --ratios 5 10 20 --question "What is the name of the island?"

On one prepared document (the prefill and the self-study conversations made first and timed as the
preparation a page does once per document: the conversations are kept in the result store, and
Attention Matching's self-study source reads the same ones), for each ratio, side by side:

- ``cartridges`` with its default knobs: its compression time (the teacher's distributions and the
  training) and the training's own seconds, which the result store keeps with the cartridge (a
  cartridge trained before, by this code, is read back: then the compression time is the read's and
  "stored" says so, the training's seconds are those it took then);
- ``attention_matching`` with its default knobs: its compression time;

each one's answer to the question and whether it holds the example's expected answer
(assets/examples/examples.json), and the full cache's answer.
"""

from __future__ import annotations

import argparse
import time

from kvlab.context import prepare_context
from kvlab.examples import load_examples
from kvlab.methods import get_method
from kvlab.models import get_model
from kvlab.pipeline import run
from kvlab.queries import self_study
from kvlab.tasks.marking import contains_match

METHODS = ("cartridges", "attention_matching")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="embedded (default) or any model kvlab loads")
    p.add_argument("--ratios", type=float, nargs="+", default=[10.0])
    p.add_argument("--question", default="Who was the ferryman?", help="one of the story's questions")
    p.add_argument("--max-new-tokens", type=int, default=32)
    args = p.parse_args(argv)
    story = next(e for e in load_examples() if e.kind == "story")
    if args.question not in story.questions:
        p.error(f"--question must be one of the story's: {'; '.join(story.questions)}")
    expected = story.aliases[story.questions.index(args.question)]
    lm = get_model(args.model)
    start = time.perf_counter()
    ctx = prepare_context(lm, story.text())
    prefill_s = time.perf_counter() - start
    methods = [get_method(name) for name in METHODS]
    tokens = methods[0].options.self_study_tokens
    start = time.perf_counter()
    study = self_study(ctx, tokens)
    study_s = time.perf_counter() - start
    print(
        f"model {lm.name}; {story.path.name}, {ctx.doc_len} document tokens; preparation: prefill {prefill_s:.1f} s, "
        f"self-study {study_s:.1f} s ({len(study.turns)} conversations, {sum(t.numel() for t in study.turns)} "
        f"tokens, {tokens} generated)"
    )
    print(f"question: {args.question} (expected: {expected[0]})")
    full = None
    print(f"{'ratio':>5}  {'method':<20} {'compress s':>10} {'training s':>16}  right  answer")
    for ratio in args.ratios:
        for method in methods:
            result = run(ctx, method, ratio, args.question, args.max_new_tokens).result
            full = result.answer_full
            details = result.details
            training = f"{details['train_s']:.1f} ({details['trained']})" if "train_s" in details else ""
            right = "yes" if contains_match(result.answer_compressed, expected) else "no"
            print(
                f"{ratio:>5g}  {method.name:<20} {result.compress_s:>10.1f} {training:>16}  {right:<5}  "
                f"{result.answer_compressed!r}",
                flush=True,
            )
    if full is not None:
        print(f"full cache: {'yes' if contains_match(full, expected) else 'no'}  {full!r}")


if __name__ == "__main__":
    main()
