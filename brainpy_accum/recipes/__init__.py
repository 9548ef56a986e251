"""Recipes: published trainings run with ``AccumBPTT`` on real data, each a command that records its learning.

``python -m brainpy_accum.recipes.evidence`` trains e-prop's LIF/ALIF network on the evidence-accumulation task
(2,200 time steps, brainpy-datasets) and records its held-out accuracy curve; ``python -m
brainpy_accum.recipes.mnist1d`` trains spiking networks on MNIST-1D. They report learning; the speed and memory
measurements are in :mod:`brainpy_accum.bench`.
"""
