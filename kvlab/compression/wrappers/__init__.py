"""The selection wrappers (AdaKV, ChunkKV, CriticalKV, key re-rotation): one module each, its maths
and the stage it declares as ``STAGE`` (a :class:`kvlab.compression.stage.Stage`: its knobs, its place
in the order, its preset, its Learn sentences, the stages it cannot run with).

kvlab.compression.selection discovers them when it is imported (kvlab.compression.stage.stages) and
assembles the knobs every scoring method gets. A new wrapper is a file here and nothing else
(tests/test_add_a_wrapper.py adds one).
"""
