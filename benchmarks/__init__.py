"""Benchmarks: commands that print the figures quoted in README and in issue notes."""
