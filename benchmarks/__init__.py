"""Benchmark suite of raytrain: every figure is a ratio against a baseline run in the same
invocation, interleaved (A B A B ...), warm-up excluded, median of several repeats.

``python -m benchmarks.run`` runs them all; ``--only NAME`` runs one. Results go to
``benchmarks/results/<machine>-<date>.{json,md}``.
"""
