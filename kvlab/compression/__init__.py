"""What every compression method stands on, and nothing that is a method (those are kvlab.methods).

options (knobs and their checks), request (what a method is asked), interface (the Method and
EvictionMethod classes), selection (the wrappers' knobs and top-k), registry (names, discovery),
catalog (the methods as front ends show them), and the shared maths: scoring, budgets,
memory_plan, beacon_core, engine_format, compaction (Attention Matching's fit) and its solvers,
wrappers (AdaKV, ChunkKV, CriticalKV). Importing this package runs nothing.
"""
