"""Attention Matching on-policy: one forward sweep against the per-layer re-read, and the paper's query mix.

    python -m benchmarks.on_policy                        # the story, 2x 5x 10x, the embedded model
    python -m benchmarks.on_policy --model gemma3-270m --ratios 2 5 10 20

On one prepared document (the prefill, the repeat pass and the self-study conversations made first and
timed as the preparation a page does once per document), for each ratio, the compression time of:

- ``default``: today's default (off-policy, the repeat pass's queries, capped at 2,048 per head);
- ``sweep``: ``on_policy=true``, each layer's queries read through the layers fitted before it, in one
  forward sweep (kvlab.methods.families.document_fit.on_policy_cache);
- ``reread``: the same on-policy fit by re-reading the text once per layer, as the paper's code does
  (``on_policy_sweep=false``), timed once per ratio (it is the slow one);
- ``mix``: the recipe's query mix alone, off-policy: the repeat pass and the self-study conversations
  (``self_study_weight=1``), up to 50,000 queries per head;
- ``recipe``: the paper's headline recipe as far as the lab has it: on-policy (the sweep, each segment of
  the text read on its own after the document), the repeat pass with self-study conversations
  (``self_study_weight=1``), up to 50,000 queries per head.

Each (but ``reread``) the best and the median of ``--repeats`` runs taken in turn. Then how many times
faster the sweep is than the re-read (the re-read's time over the sweep's median) and the recipe's
time over the default's (medians), and, for the story's questions, whether each
cache's answer holds the example's expected answer (the re-read's cache is the sweep's, tested so: not
asked again).
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvlab.context import prepare_context
from kvlab.examples import load_examples
from kvlab.methods import Request, get_method
from kvlab.models import get_model
from kvlab.pipeline import run
from kvlab.queries import repeat_pass, self_study
from kvlab.tasks.marking import contains_match

#: The configurations timed, as attention_matching's knobs.
CONFIGS = {
    "default": {},
    "sweep": {"on_policy": True},
    "reread": {"on_policy": True, "on_policy_sweep": False},
    "mix": {"self_study_weight": 1.0, "max_queries": 50000},
    "recipe": {"on_policy": True, "self_study_weight": 1.0, "max_queries": 50000},
}


def timed(fn) -> tuple[object, float]:  # noqa: ANN001 - any callable
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="embedded (default) or any model kvlab loads")
    p.add_argument("--ratios", type=float, nargs="+", default=[2.0, 5.0, 10.0])
    p.add_argument("--repeats", type=int, default=3, help="runs of each fast configuration, taken in turn")
    p.add_argument("--no-answers", action="store_true", help="time only; skip the story's questions")
    args = p.parse_args(argv)
    lm = get_model(args.model)
    story = next(e for e in load_examples() if e.kind == "story")
    ctx, prefill_s = timed(lambda: prepare_context(lm, story.text()))
    _, repeat_s = timed(lambda: repeat_pass(ctx))
    tokens = get_method("attention_matching", **CONFIGS["recipe"]).options.self_study_tokens
    study, study_s = timed(lambda: self_study(ctx, tokens))
    print(
        f"model {lm.name}; {story.path.name}, {ctx.doc_len} document tokens; preparation: prefill {prefill_s:.1f} s, "
        f"repeat pass {repeat_s:.1f} s, self-study {study_s:.1f} s ({sum(t.numel() for t in study.turns)} tokens, "
        f"{tokens} generated); {args.repeats} runs of each, in turn (reread: one)"
    )
    methods = {name: get_method("attention_matching", **knobs) for name, knobs in CONFIGS.items()}
    header = " ".join(f"{name + ' s best/med':>20}" for name in methods)
    print(f"{'ratio':>5} {header}  reread/sweep recipe/default")
    for ratio in args.ratios:
        times: dict[str, list[float]] = {name: [] for name in methods}
        for rep in range(args.repeats):
            for name, method in methods.items():
                if name == "reread" and rep > 0:
                    continue
                _, seconds = timed(lambda method=method: method.compress(Request(ctx, ratio)))
                times[name].append(seconds)
        best = {name: min(t) for name, t in times.items()}
        median = {name: statistics.median(t) for name, t in times.items()}
        cells = " ".join(f"{best[n]:>9.2f} / {median[n]:>7.2f}" for n in methods)
        faster, slower = best["reread"] / median["sweep"], median["recipe"] / median["default"]
        print(f"{ratio:>5g} {cells}  {faster:>12.1f} {slower:>14.2f}", flush=True)
    if args.no_answers:
        return
    # The re-read's cache is the sweep's (tests/test_architectures.py): its answers are the sweep's.
    answering = {name: method for name, method in methods.items() if name != "reread"}
    print("\nanswers (right / asked), the story's questions (reread: as sweep):")
    for ratio in args.ratios:
        right = dict.fromkeys(answering, 0)
        for question, answer in zip(story.questions, story.answers):
            for name, method in answering.items():
                got = run(ctx, method, ratio, question, max_new_tokens=32).result.answer_compressed
                right[name] += contains_match(got, answer)
        print(f"{ratio:>5g}x " + "  ".join(f"{n} {right[n]}/{len(story.questions)}" for n in answering), flush=True)


if __name__ == "__main__":
    main()
