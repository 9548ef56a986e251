"""Shapes of what a function of a micro-batch returns, at several micro-batch sizes, by tracing alone.

Where an output, a metric or a target holds the batch shows in how its shape changes with the number of
samples: :func:`traced_shapes` traces (never runs) a function at two sizes, :func:`second_sizes` picks them.
"""

from typing import Any, Callable, Sequence, Tuple

import brainpy.math as bm
import brainstate
import jax
import jax.numpy as jnp

from ._batch import is_array, take_samples
from ._cut import MicroBatchPlan

__all__ = ['first_samples', 'second_sizes', 'traced_shapes']


def first_samples(x, axis: int, n: int):
  """The first ``n`` samples of ``x`` on ``axis``; zeros stand in for samples beyond its size."""
  x = bm.as_jax(x)
  size = x.shape[axis]
  if n <= size:
    return take_samples(x, axis, 0, n)
  pad = x.shape[:axis] + (n - size,) + x.shape[axis + 1:]
  return jnp.concatenate([x, jnp.zeros(pad, x.dtype)], axis=axis)


def traced_shapes(forward: Callable, args: tuple, axes, states: Sequence[Tuple[Any, int]], sizes):
  """The shapes of ``forward(micro_args, n)`` for each ``n`` in ``sizes``: traced only, nothing changes.

  ``states`` hold the whole batch's values; each trace starts from their first ``n`` samples (zeros beyond
  the batch, for a size larger than it: only shapes matter).
  """
  leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=is_array)
  values = [state.value for state, _ in states]

  def at(n):
    def run(*cut):
      for (state, axis), value in zip(states, values):
        state.value = first_samples(value, axis, n)
      return forward(treedef.unflatten(cut), n)

    cut = [x if a is None else first_samples(x, a, n) for x, a in zip(leaves, axes)]
    traced = brainstate.transform.StatefulFunction(run, return_only_write=False)
    traced.make_jaxpr(*cut)
    return traced.get_out_shapes(*cut)[0]

  return [at(n) for n in sizes]


def second_sizes(plan: MicroBatchPlan) -> Tuple[int, int]:
  """Two different micro-batch sizes to trace the outputs at, so that their batch axes show."""
  size = plan.micro_batch_size
  return size, (plan.remainder if plan.remainder else (size - 1 if size > 1 else 2))
