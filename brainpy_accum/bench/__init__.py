"""Benchmarks: memory and speed of AccumBPTT against bp.BPTT, a hand-written recipe and plain JAX + optax.

``python -m brainpy_accum.bench`` builds every configuration in one process,
reads its memory from XLA's compile-time analysis, times the steps in
interleaved rounds (ratios are medians of per-round ratios) and writes
``docs/benchmark.md``, ``.png`` and ``.json``; ``--quick`` runs a small
workload in a minute. ``python -m brainpy_accum.bench.soak`` checks that
resident memory stops growing over 2,000 steps. The inputs are random
numbers: these scripts time and measure steps, they do not report learning.
"""
