"""Every registered method at memory ratios 2x, 4x and 10x on the shared setting.

    python -m benchmarks.methods                      # the full table (many minutes on 2 CPU cores)
    python -m benchmarks.methods --methods snapkv kivi --ratios 4

Setting (issue #4): SmolLM2-135M-Instruct, the QuALITY story cut to its first
1,500 tokens, its five questions (with their options) as held-out evaluation
queries. Errors are the document block's (the template prefix, which every
method keeps, excluded). "memory" is bytes_full / bytes_stored as really
stored (packed codes + scales + zero points for quantised tokens).
"""

from __future__ import annotations

import argparse
import json

from benchmarks.common import Measured, full_first_nll, full_logppl, measure, quality_setting
from kvlab.methods import REGISTRY, get_method
from kvlab.models import get_model

# Rows that are not token eviction (quantisation, summaries, the floor).
NOT_EVICTION = {
    "attention_matching",
    "summary_am",
    "beaconkv_mixed",
    "beaconkv_mixed/rest=2bit",
    "kivi",
    "summarisation",
    "no_context",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Methods that always compress for the question would need one compression per
    # question; they are compared in the app (Compare tab) instead.
    parser.add_argument("--methods", nargs="+", default=sorted(n for n, c in REGISTRY.items() if not c.query_aware))
    parser.add_argument("--ratios", type=float, nargs="+", default=[2, 4, 10])
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    lm = get_model()
    setting = quality_setting(lm, args.tokens)
    queries = setting.eval_queries
    full_bytes = setting.ctx.full.nbytes
    plan = [(name, {}, r) for name in args.methods for r in args.ratios]
    plan += [
        ("beaconkv_mixed", {"rest": rest}, r)
        for rest in ("2bit", "evict")
        for r in args.ratios
        if "beaconkv_mixed" in args.methods
    ]
    rows: list[Measured] = []
    for name, opts, ratio in plan:
        label = name + "".join(f"/{k}={v}" for k, v in opts.items())
        row = measure(setting, label, get_method(name, **opts), ratio, queries)
        rows.append(row)
        print(
            f"  {label} {ratio:g}x: err {row.output_err:.3f}, memory {full_bytes / row.bytes:.2f}x, "
            f"{row.compress_s:.2f}s",
            flush=True,
        )
    ref = full_logppl(setting)
    first = full_first_nll(setting)
    print(
        f"\n| method | ratio | memory | attn-output err | mass err | answer log-ppl (full {ref:.3f}) "
        f"| first-token NLL (full {first:.3f}) | bytes | compress s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r.method} | {r.ratio:g}x | {full_bytes / r.bytes:.2f}x | {r.output_err:.3f} | {r.mass_err:.3f} "
            f"| {r.logppl:.3f} | {r.first_nll:.3f} | {r.bytes:,} | {r.compress_s:.2f} |"
        )
    if 4 in args.ratios and "beaconkv_mixed" in args.methods:
        mixed = next(r for r in rows if r.method == "beaconkv_mixed" and r.ratio == 4)
        evictors = [r for r in rows if r.ratio == 4 and r.method not in NOT_EVICTION]
        best = min(evictors, key=lambda r: r.output_err)
        ok = all(mixed.output_err < r.output_err for r in evictors)
        print(
            f"\n{'PASS' if ok else 'FAIL'} mixed BeaconKV (4-bit rest) at 4x: {mixed.output_err:.3f} "
            f"< best eviction method at 4x ({best.method}: {best.output_err:.3f})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "full_logppl": ref,
                    "full_bytes": full_bytes,
                    "rows": [{k: v for k, v in vars(r).items() if k != "stored"} for r in rows],
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
