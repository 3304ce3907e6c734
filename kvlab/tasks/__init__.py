"""Tasks with known answers, their scoring, and a resumable benchmark runner.

- :mod:`kvlab.tasks.marking`: answer normalisation, exact / contains match, token F1;
- :mod:`kvlab.tasks.items`: :class:`~kvlab.tasks.items.TaskItem`, one question with its gold answer;
- :mod:`kvlab.tasks.copying`: a long-generation task (copy a list of codes back) for bounded caches;
- :mod:`kvlab.tasks.synthetic`: RULER-style needles and variable tracking, ``needle_items`` for a user's document;
- :mod:`kvlab.tasks.datasets`: QuALITY and HotpotQA (shared data), the bundled examples;
- :mod:`kvlab.tasks.task_registry`: every task by name, ``build_items``;
- :mod:`kvlab.tasks.runner`: ``run_items`` (one prefill per document) and ``summarise``;
- :mod:`kvlab.tasks.store`: JSONL results that resume and merge across shards;
- :mod:`kvlab.tasks.report`: CSV, plotly figures and the HTML report.

The command that drives them, ``python -m kvlab bench``, is a front end: :mod:`kvlab.bench_command`.
"""
