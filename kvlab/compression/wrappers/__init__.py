"""The selection wrappers (AdaKV, ChunkKV, CriticalKV, key re-rotation): one module each, its maths
and the stage it declares as ``STAGE`` (a :class:`kvlab.compression.stage.Stage`: its knobs, its place
in the order, its preset, the stages it cannot run with), named as the module; its Learn sentences are
the markdown file beside it (``adakv.py``, ``adakv.md``: kvlab.learn_text).

kvlab.compression.selection discovers them when it is imported (kvlab.compression.stage.stages) and
assembles the knobs every scoring method gets. A new wrapper is a file here and its Learn
text, and nothing else (tests/test_add_a_wrapper.py adds one).
"""
