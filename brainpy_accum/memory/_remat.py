"""Rematerialisation over time: a time loop that keeps one state per segment instead of every step.

BPTT stores the activations of every time step for the backward pass.
:func:`checkpointed_time_loop` cuts the ``T`` steps into segments of ``S``
steps (``S ~ sqrt(T)`` by default) and checkpoints each segment with
:func:`brainstate.transform.checkpoint` (JAX's ``jax.checkpoint`` for code
with BrainPy Variables): the forward pass keeps only the model state at
segment boundaries, and the backward pass re-runs one segment at a time.
Activation memory drops from ``O(T)`` to ``O(T / S + S)`` steps, for about one
extra forward pass of compute. Gradients are the same.
"""

import math
from typing import Callable, Optional

import brainpy.math as bm
import brainstate
import jax
import jax.numpy as jnp

__all__ = ['default_segment_length', 'checkpointed_time_loop']


def default_segment_length(num_steps: int) -> int:
  """``round(sqrt(num_steps))``, at least 1: balances stored boundaries against one re-run segment."""
  return max(1, round(math.sqrt(num_steps)))


def checkpointed_time_loop(step: Callable, indices, inputs, segment_length: Optional[int] = None, jit: bool = True):
  """Run ``step(i, *x_i)`` over time like :func:`brainpy.math.for_loop`, checkpointed segment by segment.

  Parameters
  ----------
  step : callable
    One time step, ``step(i, *inputs_at_i) -> outputs``.
  indices : array
    The time indices, shape ``(T,)``.
  inputs : sequence of pytrees
    Time-first inputs, each leaf of shape ``(T, ...)``.
  segment_length : int, optional
    Steps per checkpointed segment; ``round(sqrt(T))`` by default.
  jit : bool
    Passed to :func:`brainpy.math.for_loop`.

  Returns
  -------
  The outputs of ``step`` stacked over time, as :func:`brainpy.math.for_loop` returns them.
  """
  num_steps = indices.shape[0]
  length = segment_length or default_segment_length(num_steps)
  num_segments, rest = divmod(num_steps, length)
  if num_segments <= 1:
    return bm.for_loop(step, (indices, *inputs), jit=jit)

  def run_segment(segment_indices, *segment_inputs):
    return bm.for_loop(step, (segment_indices, *segment_inputs), jit=jit)

  cut = num_segments * length
  fold = lambda a: a[:cut].reshape((num_segments, length) + a.shape[1:])
  outs = bm.for_loop(brainstate.transform.checkpoint(run_segment),
                     (fold(indices), *jax.tree_util.tree_map(fold, inputs)), jit=jit)
  outs = jax.tree_util.tree_map(lambda a: a.reshape((cut,) + a.shape[2:]), outs)
  if rest:
    tail = bm.for_loop(step, (indices[cut:], *jax.tree_util.tree_map(lambda a: a[cut:], inputs)), jit=jit)
    outs = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a, b]), outs, tail)
  return outs
