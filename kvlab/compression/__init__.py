"""What every compression method stands on, and nothing that is a method (those are kvlab.methods).

options (knobs and their checks), request (what a method is asked), interface (the Method and
EvictionMethod classes), selection (the wrappers' knobs, assembled from their stages, and top-k),
stage (what a wrapper declares), registry (names), discovery (a package's modules imported),
and the shared maths: scoring, budgets, the
batched solves of Attention Matching's head blocks (block_solve) and their solvers, wrappers (AdaKV,
ChunkKV, CriticalKV, key re-rotation: a stage each). What a family of methods shares is
kvlab.methods.families. Importing this package runs nothing.
"""
