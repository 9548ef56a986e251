"""Benchmarks: memory and speed of AccumBPTT against bp.BPTT, a hand-written recipe and plain JAX + optax.

``python -m brainpy_accum.bench`` runs every configuration in a subprocess of
its own (so that each peak resident memory is its own) and writes
``docs/benchmark.md`` and ``docs/benchmark.png``; ``--quick`` runs a small
workload in a minute. ``python -m brainpy_accum.bench.soak`` checks that
resident memory stops growing over 2,000 steps. The inputs are random
numbers: these scripts time and measure steps, they do not report learning.
"""
