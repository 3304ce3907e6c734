"""Attention Matching's batched closed-form solvers, one module per job (see compact.py for the whole fit)."""
