"""Benchmarks: commands that print the figures quoted in docs/benchmarks.md and in issue notes."""
