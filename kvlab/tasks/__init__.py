"""Tasks with known answers, their scoring, and a resumable benchmark runner.

`scoring` normalises and scores answers; the rest of the package builds task
items (synthetic RULER-style tasks, shared data sets, the bundled examples),
runs them over methods and ratios, and writes JSONL, CSV and an HTML report.
"""
