"""Attention Matching's head budgets at equal bytes: the model's profile (the default) against uniform.

    python -m benchmarks.head_budgets                      # the story, 2x 5x 10x, the embedded model
    python -m benchmarks.head_budgets --model gemma3-270m --ratios 2 5 10 20 --repeats 5

For each ratio, in one process, on one prepared document (its reference queries recorded first, so
both runs time the fit alone): the compression time of ``budgets=uniform`` and of the default
(the model's profile where it has one), each the best and the median of ``--repeats`` runs taken in
turn (this machine's times wander by 20-30 % between identical runs), their ratios, and the memory
ratio of each stored cache (the same bytes: what a head capped at the document's length cannot use
goes to the others). The non-uniform heads are solved batched by
budget (kvlab.compression.block_solve.solve_ragged), never padded to the largest.

Then, for the story's questions, each cache's attention-output error on the held-out queries, the
plain mean over layers x heads and the mean weighted by each head's share of its layer's output
(kvlab.metrics.output_shares), beside whether its answer holds the example's expected answer.
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
from kvlab.tasks.marking import contains_match


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="embedded (default) or any model kvlab loads")
    p.add_argument("--ratios", type=float, nargs="+", default=[2.0, 5.0, 10.0])
    p.add_argument("--repeats", type=int, default=5, help="runs of each, taken in turn; the best and the median")
    args = p.parse_args(argv)
    lm = get_model(args.model)
    story = next(e for e in load_examples() if e.kind == "story")
    ctx = prepare_context(lm, story.text())
    methods = {
        "uniform": get_method("attention_matching", budgets="uniform"),
        "default": get_method("attention_matching"),
    }
    methods["uniform"].prepare(ctx)  # the repeat pass's queries, shared by both
    print(f"model {lm.name}; {story.path.name}, {ctx.doc_len} document tokens; {args.repeats} runs of each, in turn")
    print(
        f"{'ratio':>5} {'uniform s best/median':>21} {'default s best/median':>21} {'time x best/median':>18} "
        f"{'mem uniform':>11} {'mem default':>11}  default budgets"
    )
    for ratio in args.ratios:
        times: dict[str, list[float]] = {name: [] for name in methods}
        stored = {}
        for _ in range(args.repeats):
            for name, method in methods.items():
                start = time.perf_counter()
                stored[name] = method.compress(Request(ctx, ratio))
                times[name].append(time.perf_counter() - start)
        best = {name: min(t) for name, t in times.items()}
        median = {name: statistics.median(t) for name, t in times.items()}
        memory = {name: ctx.full.nbytes / s.nbytes for name, s in stored.items()}
        print(
            f"{ratio:>5g} {best['uniform']:>10.2f}/{median['uniform']:<10.2f} {best['default']:>10.2f}/"
            f"{median['default']:<10.2f} {best['default'] / best['uniform']:>9.2f}/"
            f"{median['default'] / median['uniform']:<8.2f} {memory['uniform']:>11.3f} {memory['default']:>11.3f}  "
            f"{stored['default'].meta['budgets']}: {stored['default'].meta['budgets_source']}",
            flush=True,
        )
    print(
        f"\n{'ratio':>5} {'budgets':>10} {'mean err':>8} {'weighted':>8}  right (of {len(story.questions)} questions)"
    )
    for ratio in args.ratios:
        for name, method in methods.items():
            results = [run(ctx, method, ratio, q).result for q in story.questions]
            right = sum(contains_match(r.answer_compressed, list(a)) for r, a in zip(results, story.aliases))
            mean = sum(r.attn_output_rel_err for r in results) / len(results)
            weighted = sum(r.attn_output_rel_err_weighted for r in results) / len(results)
            print(f"{ratio:>5g} {results[0].details['budgets']:>10} {mean:>8.4f} {weighted:>8.4f}  {right}", flush=True)


if __name__ == "__main__":
    main()
