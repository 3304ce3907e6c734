"""Attention Matching on the embedded model: quality, downstream, speed, online compaction.

    python -m benchmarks.attention_matching            # the full table (several minutes on 2 CPU cores)
    python -m benchmarks.attention_matching --json out.json
    python -m benchmarks.attention_matching --app   # only the app's fit on the bundled story (a minute)
    python -m benchmarks.attention_matching --app --app-options max_queries=50000   # every repeat query

``--app`` times the fit as the app's Explore tab runs it (issue #20): the
bundled story (about 2,058 tokens) prepared through kvlab.lab.explore's
prepared_context and the method's own prepare (the repeat pass, not timed),
then compress at the ratio with the token importance recorded, as explore
asks; wall and CPU seconds per repeat, and the fit's own split.

Setting (issue #3): SmolLM2-135M-Instruct, the QuALITY story cut to its first
1,500 tokens, repeat-prefill fitting queries, its five questions (with their
options) asked after the document as held-out evaluation queries.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field

import torch

from benchmarks.common import (
    Measured,
    first_tokens,
    full_first_nll,
    full_logppl,
    measure,
    quality_setting,
    quality_story,
)
from kvlab.bounded.online import bounded_logprobs, window_compactor
from kvlab.context import prepare_context
from kvlab.methods import get_method
from kvlab.models import get_model
from kvlab.prompts import question_tokens
from kvlab.queries import repeat_queries
from kvlab.runtime.decode import continuation_logprobs, greedy


def table(rows: list[Measured], ref_ppl: float, ref_first: float) -> str:
    lines = [
        "| method | ratio | attn-output err (document block) | mass err | attn-output err (whole cache) "
        "| answer log-ppl (full: %.3f) | per-answer log-ppl gap | per-token log-prob gap "
        "| first-token NLL (full: %.3f) | bytes | compress s |" % (ref_ppl, ref_first),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.method} | {r.ratio:g}x | {r.output_err:.3f} | {r.mass_err:.3f} | {r.output_err_cache:.3f} "
            f"| {r.logppl:.3f} | {r.answer_gap:.3f} | {r.token_gap:.3f} | {r.first_nll:.3f} | {r.bytes:,} "
            f"| {r.compress_s:.2f} |"
        )
    return "\n".join(lines)


def online_run(lm, doc_tokens: int, budget: int, new_tokens: int) -> dict:
    """The unbounded model's own continuation, re-read under a bounded, self-compacting cache
    (Attention Matching), and under a sliding window of the same budget for reference."""
    ctx = prepare_context(lm, first_tokens(lm, quality_story()["text"], doc_tokens))
    prompt = question_tokens(lm.tokenizer, "Retell this story in detail, then continue it.")
    gen = greedy(lm, ctx.full.stored, prompt, max_new_tokens=new_tokens)
    target = torch.tensor(gen.ids)
    ids = torch.cat([prompt, target])
    unbounded = continuation_logprobs(lm, ctx.full.stored, prompt, target)
    am = bounded_logprobs(lm, ctx.full.stored, ids, target.numel(), budget, ctx.prefix_len)
    window = bounded_logprobs(lm, ctx.full.stored, ids, target.numel(), budget, ctx.prefix_len, window_compactor)
    return {
        "doc_tokens": ctx.doc_len,
        "generated_tokens": target.numel(),
        "budget": budget,
        "compactions": [vars(c) for c in am.compactions],
        "logppl_unbounded": float(-unbounded.mean()),
        "logppl_online_am": float(-am.logprobs.mean()),
        "logppl_streaming_llm": float(-window.logprobs.mean()),
    }


def app_fit(ratio: float, options: dict, repeats: int) -> list[dict]:
    """The app path's fit: the story prepared as Explore prepares it, then compressed ``repeats`` times."""
    from kvlab.examples import load_examples
    from kvlab.lab.explore import prepared_context
    from kvlab.methods import Request

    lm = get_model()
    story = next(ex for ex in load_examples() if ex.id == "story")
    ctx, _ = prepared_context(lm, story.text())
    method = get_method("attention_matching", **options)
    method.prepare(ctx)
    out = []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        stored = method.compress(Request(ctx, ratio, story.questions[0], record_importance=True))
        out.append(
            {
                "wall_s": time.perf_counter() - wall,
                "cpu_s": time.process_time() - cpu,
                "fit_s": stored.meta["fit_s"],
                "queries_per_head": stored.meta["queries_per_head"][0],
                "doc_tokens": ctx.doc_len,
                "threads": torch.get_num_threads(),
            }
        )
        print(
            f"  story ({ctx.doc_len} tokens) {ratio:g}x {options or 'defaults'}: {out[-1]['wall_s']:.2f} s wall, "
            f"{out[-1]['cpu_s']:.2f} s CPU, {torch.get_num_threads()} thread(s), "
            f"{out[-1]['queries_per_head']} queries per KV head; "
            + ", ".join(f"{k} {v:.2f}" for k, v in out[-1]["fit_s"].items()),
            flush=True,
        )
    return out


def parse_options(pairs: list[str]) -> dict:
    """``key=value`` pairs -> AM options (numbers where they parse)."""
    out: dict = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        for kind in (int, float):
            try:
                out[key] = kind(value)
                break
            except ValueError:
                continue
        else:
            out[key] = value
    return out


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1500, help="document tokens (default 1500)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[5, 10, 20, 50])
    parser.add_argument("--omp-ratios", type=float, nargs="+", default=[10, 20, 50])
    parser.add_argument("--downstream-ratios", type=float, nargs="+", default=[10, 20])
    parser.add_argument("--online-doc", type=int, default=200, help="online run: document tokens")
    parser.add_argument("--online-budget", type=int, default=320, help="online run: physical keys per head")
    parser.add_argument("--online-tokens", type=int, default=950, help="online run: generated tokens")
    parser.add_argument("--skip-online", action="store_true")
    parser.add_argument("--json", default=None, help="also write all figures to this file")
    parser.add_argument("--app", action="store_true", help="only time the app's fit on the bundled story")
    parser.add_argument("--app-ratio", type=float, default=10.0)
    parser.add_argument("--app-repeats", type=int, default=3)
    parser.add_argument("--app-options", nargs="*", default=[], help="AM options as key=value")
    return parser.parse_args()


def plan(args: argparse.Namespace) -> list[tuple[str, dict, float]]:
    """The table's (method, options, ratio) rows, in order."""
    rows = [("attention_matching", {}, r) for r in args.ratios]
    rows += [("attention_matching", {"key_selection": "omp"}, r) for r in args.omp_ratios]
    rows += [("attention_topk", {}, r) for r in args.ratios]
    # HighestAttnKeys scored by mean attention instead of the published RMS, with its own top-k.
    rows += [
        (m, {"scoring": "mean"}, r) for m in ("attention_matching", "attention_topk") for r in args.downstream_ratios
    ]
    rows += [(m, {}, r) for m in ("streaming_llm", "snapkv") for r in args.downstream_ratios]
    # The floor: shows how much of the answers' log-ppl the document explains at all.
    rows += [("no_context", {}, args.downstream_ratios[0])]
    return rows


@dataclass
class Verdicts:
    """What the table shows: checks (text, passed) with a target, and notes without one."""

    checks: list[tuple[str, bool]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def verdicts(rows: list[Measured], args: argparse.Namespace, ref_ppl: float, prefill_s: float) -> Verdicts:
    """The table's checks: AM against top-k, OMP against HighestAttnKeys, AM's downstream gaps against
    the eviction methods (``ref_ppl`` the full cache's answer log-ppl), and AM's speed against the prefill."""
    by = {(r.method, r.ratio): r for r in rows}
    out = Verdicts()
    for r in args.ratios:
        if r in (10, 20, 50):
            am, topk = by[("attention_matching", r)], by[("attention_topk", r)]
            out.checks.append(
                (
                    f"AM/top-k error at {r:g}x = {am.output_err / topk.output_err:.2f} (<= 0.45)",
                    am.output_err <= 0.45 * topk.output_err,
                )
            )
    for r in args.downstream_ratios:
        am, topk = by[("attention_matching/mean", r)], by[("attention_topk/mean", r)]
        out.notes.append(f"AM/top-k error with mean scoring at {r:g}x = {am.output_err / topk.output_err:.2f}")
    for r in args.omp_ratios:
        if r in (20, 50):
            omp, ha = by[("attention_matching/omp", r)], by[("attention_matching", r)]
            out.checks.append(
                (
                    f"OMP {omp.output_err:.3f} < HighestAttnKeys {ha.output_err:.3f} at {r:g}x",
                    omp.output_err < ha.output_err,
                )
            )
    for r in args.downstream_ratios:
        others = [by[(other, r)] for other in ("streaming_llm", "snapkv")]
        for variant in ("attention_matching", "attention_matching/omp", "attention_matching/mean"):
            am = by.get((variant, r))
            if am is None:
                continue
            # The mean log-ppl over five answers lets answers that got easier cancel
            # answers that got harder; the per-answer and per-token gaps cannot.
            for what, gap in (
                ("|mean log-ppl gap|", lambda m: abs(m.logppl - ref_ppl)),
                ("per-answer log-ppl gap", lambda m: m.answer_gap),
                ("per-token log-prob gap", lambda m: m.token_gap),
            ):
                text = ", ".join(f"{o.method} {gap(o):.4f}" for o in others)
                out.checks.append(
                    (f"{r:g}x {what}: {variant} {gap(am):.4f} vs {text}", all(gap(am) < gap(o) for o in others))
                )
    speed = by[("attention_matching", 10.0)].compress_s / prefill_s
    out.checks.append((f"AM compaction at 10x / prefill = {speed:.2f} (<= 1.0)", speed <= 1.0))
    return out


def main() -> None:
    args = parse_args()
    if args.app:
        runs = app_fit(args.app_ratio, parse_options(args.app_options), args.app_repeats)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(runs, f, indent=1)
        return

    lm = get_model()
    setting = quality_setting(lm, args.tokens)
    ctx = setting.ctx
    start = time.perf_counter()
    repeat_queries(ctx)
    repeat_s = time.perf_counter() - start
    print(
        f"document: {ctx.doc_len} tokens; prefill {ctx.prefill_s:.2f}s; repeat-prefill queries {repeat_s:.2f}s",
        flush=True,
    )
    queries = setting.eval_queries
    rows: list[Measured] = []
    for name, opts, ratio in plan(args):
        label = name + "".join(f"/{v}" for v in opts.values())
        row = measure(setting, label, get_method(name, **opts), ratio, queries)
        rows.append(row)
        print(
            f"  {label} {ratio:g}x: err {row.output_err:.3f}, log-ppl {row.logppl:.3f}, {row.compress_s:.2f}s",
            flush=True,
        )
    ref_ppl = full_logppl(setting)
    print()
    print(table(rows, ref_ppl, full_first_nll(setting)))
    found = verdicts(rows, args, ref_ppl, ctx.prefill_s)
    online = None
    if not args.skip_online:
        online = online_run(lm, args.online_doc, args.online_budget, args.online_tokens)
        print(
            f"\nonline: {online['generated_tokens']} tokens after a {online['doc_tokens']}-token document, budget "
            f"{online['budget']} keys/head, {len(online['compactions'])} compactions; log-ppl unbounded "
            f"{online['logppl_unbounded']:.4f}, online AM {online['logppl_online_am']:.4f}, "
            f"streaming_llm {online['logppl_streaming_llm']:.4f}"
        )
        found.checks.append(
            (f"online compactions: {len(online['compactions'])} (>= 6)", len(online["compactions"]) >= 6)
        )
    print()
    for text in found.notes:
        print("INFO " + text)
    for text, ok in found.checks:
        print(("PASS " if ok else "FAIL ") + text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "doc_tokens": ctx.doc_len,
                    "prefill_s": ctx.prefill_s,
                    "repeat_queries_s": repeat_s,
                    "full_logppl": ref_ppl,
                    "rows": [{k: v for k, v in vars(r).items() if k != "stored"} for r in rows],
                    "online": online,
                    "checks": [{"check": t, "pass": ok} for t, ok in found.checks],
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
