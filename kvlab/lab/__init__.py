"""The lab: everything a front end does that is not widgets, with no gradio import.

The app (kvlab.ui), the CLI (kvlab.cli) and the benchmarks call these:

- :func:`run_spec`: a run's inputs checked once into a :class:`RunSpec` (document, method with its
  knobs, ratio, question, answer length, model), which the rest takes; its store key, link and
  command line are made from it;
- :func:`explore`: one run (a :class:`RunSpec`) -> :class:`Explored`;
- :func:`compare`: a sweep of methods x ratios on one document -> :class:`Sweep`,
  written out by :func:`write_exports` (CSV and JSON);
- :func:`generate`: every bounded-cache method writing after one prompt -> :class:`Generated`;
- :func:`prepare_document`: the prefill and a method's document-only work, ahead of a run;
  :func:`ensure_prepared`, the same by a background job that a request waits for (:class:`PreparationStatus`);
- :func:`pick`: the learner's own pick of the document's spans (the ``manual`` method) ranked among
  the methods at one ratio -> :class:`Picked`; :func:`read_for_pick`, what to pick from;
- :class:`TokenFates`: what happened to every token of a run, as light data;
- :func:`run_tasks`, :func:`needle_test`, :func:`load_results`: accuracy on tasks
  with known answers (a small live set, a needle in the user's document, a bench's results);
- the input checks of :mod:`kvlab.lab.inputs` (their errors are fit to show as is).
"""

from kvlab.lab.background import PreparationStatus, ensure_prepared
from kvlab.lab.compare import MAX_SWEEP_POINTS, Sweep, SweepError, compare, sweep_charts, sweep_label
from kvlab.lab.explore import DoneForIt, Explored, explore, prepared_context, sub_progress, token_texts
from kvlab.lab.exports import EXPORT_FIELDS, export_dir, sweep_json, sweep_records, write_exports
from kvlab.lab.fates import TokenFates
from kvlab.lab.generate import MAX_GENERATE_TOKENS, Generated, MethodGeneration, generate, generation_record
from kvlab.lab.inputs import (
    InputError,
    check_answer_length,
    check_question,
    document_text,
    example_label,
    examples,
    expected_answer,
    model_choices,
    offered_examples,
    parse_ratios,
    pick_examples,
)
from kvlab.lab.pick import PickDocument, Picked, pick, read_for_pick, token_budget
from kvlab.lab.prepare import Prepared, prepare_document
from kvlab.lab.spec import RunSpec, run_spec
from kvlab.lab.tasks import TaskRun, load_results, needle_test, needle_test_items, run_tasks

__all__ = [
    "MAX_GENERATE_TOKENS",
    "Generated",
    "MethodGeneration",
    "generate",
    "generation_record",
    "DoneForIt",
    "EXPORT_FIELDS",
    "MAX_SWEEP_POINTS",
    "Explored",
    "InputError",
    "PickDocument",
    "Picked",
    "PreparationStatus",
    "Prepared",
    "RunSpec",
    "Sweep",
    "SweepError",
    "TaskRun",
    "TokenFates",
    "load_results",
    "needle_test",
    "needle_test_items",
    "run_tasks",
    "check_answer_length",
    "check_question",
    "compare",
    "document_text",
    "ensure_prepared",
    "example_label",
    "examples",
    "expected_answer",
    "explore",
    "export_dir",
    "model_choices",
    "offered_examples",
    "parse_ratios",
    "pick",
    "pick_examples",
    "prepare_document",
    "prepared_context",
    "read_for_pick",
    "run_spec",
    "sub_progress",
    "sweep_json",
    "sweep_charts",
    "sweep_label",
    "sweep_records",
    "token_budget",
    "token_texts",
    "write_exports",
]
