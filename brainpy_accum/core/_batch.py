"""Finding the batch axis of every leaf of a data pytree, slicing micro-batches out of it, and the shapes of
what a function of a micro-batch returns at several sizes.

``data_first_axis='B'`` puts the batch on axis 0 of every input leaf and
``'T'`` on axis 1 (time first), exactly as :class:`brainpy.BPTT` reads them.
A target leaf is cut along the one of its axes 0 and 1 that has the batch's size
(class labels of shape ``(batch, n_class)`` with time-first inputs: axis 0;
``(time, batch, ...)`` targets: axis 1). When both have it (``n_class`` or ``T``
equal to the batch size), the trainer decides from evidence, tracing the loss
with each choice at two micro-batch sizes, or raises an error that names
``target_batch_axis``; nothing is guessed.

Where an output, a metric or a target holds the batch shows in how its shape changes with the number of
samples: :func:`traced_shapes` traces (never runs) a function at two sizes, :func:`second_sizes` picks them.
"""

from typing import Any, Callable, List, Optional, Sequence, Tuple

import brainpy.math as bm
import brainstate
import jax
import jax.numpy as jnp
import numpy as np

from ._cut import MicroBatchPlan

__all__ = ['BatchLayout', 'ambiguous_targets_error', 'batch_layout', 'describe_leaf', 'first_samples', 'is_array',
           'put_samples', 'samples_shape', 'second_sizes', 'take_samples', 'traced_shapes']


def is_array(x) -> bool:
  """A BrainPy array is a leaf of a data pytree, not a node to flatten."""
  return isinstance(x, bm.Array)


def _leaves_with_paths(tree):
  return jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_array)[0]


class BatchLayout:
  """The batch axis of each leaf of ``(inputs, targets)`` and the batch size they share.

  Attributes
  ----------
  batch_size : int
    The common size of every leaf along its batch axis.
  input_axes, target_axes : pytree of int
    The batch axis of each leaf, with the structure of the data.
  """

  def __init__(self, batch_size: int, input_axes: Any, target_axes: Any):
    self.batch_size = batch_size
    self.input_axes = input_axes
    self.target_axes = target_axes


def _shape(x):
  # ``.shape`` first: it also covers jax.ShapeDtypeStruct placeholders used for ahead-of-time compilation.
  return tuple(x.shape) if hasattr(x, 'shape') else np.shape(x)


def _describe(kind: str, path) -> str:
  return kind + jax.tree_util.keystr(path)


describe_leaf = _describe


def _input_axes(inputs, data_first_axis: str):
  axis = 0 if data_first_axis == 'B' else 1
  sizes = {}
  for path, leaf in _leaves_with_paths(inputs):
    shape = _shape(leaf)
    if len(shape) < 2:
      raise ValueError(f'{_describe("inputs", path)} has shape {shape}, which has no time axis: inputs are '
                       f'(batch, time, ...) with data_first_axis=\'B\' (the default) and (time, batch, ...) with '
                       f'\'T\'. Add the time axis, e.g. x[:, None] for one time step of a (batch, features) '
                       f'array.')
    sizes[_describe('inputs', path)] = shape[axis]
  if not sizes:
    raise ValueError('inputs hold no arrays: give each batch as (x, y) with x an array or a pytree of arrays.')
  if len(set(sizes.values())) != 1:
    raise ValueError(f'The input arrays disagree on the batch size along axis {axis} ({data_first_axis=}): '
                     f'{sizes}. Every input leaf must hold the same samples.')
  return jax.tree_util.tree_map(lambda _: axis, inputs, is_leaf=is_array), next(iter(sizes.values()))


def _target_candidates(path, shape, batch_size: int, preferred: int, forced: Optional[int]) -> List[int]:
  """The axes of a target leaf that may hold the batch: ``forced``, else axes 0 and 1 of size ``batch_size``
  (``preferred`` first); raises when none has that size."""
  if forced is not None:
    candidates = [forced] if len(shape) > forced and shape[forced] == batch_size else []
  else:
    candidates = [a for a in dict.fromkeys((preferred, 0, 1)) if len(shape) > a and shape[a] == batch_size]
  if not candidates:
    looked = (forced,) if forced is not None else tuple(dict.fromkeys((preferred, 0, 1)))
    raise ValueError(f'{_describe("targets", path)} has shape {shape}, but the inputs hold batch_size={batch_size} '
                     f'samples and no target axis among {looked} has that size. Give targets with the '
                     f'same samples as the inputs, or set target_batch_axis to the axis that holds them. Targets '
                     f'are cut into micro-batches with the inputs: a value that holds no samples (class weights, a '
                     f'mask over classes) belongs in loss_fun instead, bound with functools.partial or a closure.')
  return candidates


def ambiguous_targets_error(names, shapes, candidates, batch_size: int, why: str) -> ValueError:
  """The error for target leaves whose batch axis cannot be told: it names ``target_batch_axis`` and the shapes."""
  leaves = ', '.join(f'{n} of shape {s} (axes {c} have size {batch_size})' for n, s, c in zip(names, shapes, candidates))
  return ValueError(f'The batch axis of {leaves} is ambiguous: {why}. Set target_batch_axis to the axis that '
                    f'holds the samples (e.g. target_batch_axis=0 for (batch, ...) targets), or give targets whose '
                    f'other axes differ from the batch size.')


def batch_layout(inputs, targets, data_first_axis: str, target_batch_axis: Optional[int] = None,
                 resolve: Optional[Callable] = None) -> BatchLayout:
  """Find and check the batch axis of every leaf of ``inputs`` and ``targets``.

  Parameters
  ----------
  inputs, targets : pytree of arrays
    One batch, as given to :meth:`brainpy.BPTT.fit`.
  data_first_axis : {'B', 'T'}
    Whether inputs are batch-first or time-first.
  target_batch_axis : int, optional
    Force the batch axis of every target leaf.
  resolve : callable, optional
    ``resolve(input_axes, batch_size, candidates) -> axes`` decides target leaves with two axes of the batch's
    size (``candidates``: one list of axes per target leaf) from evidence, or raises. Without it such leaves
    raise :func:`ambiguous_targets_error`.

  Returns
  -------
  BatchLayout

  Raises
  ------
  ValueError
    If a leaf has no batch axis, leaves disagree on the batch size, the batch is empty, or a target's batch
    axis is ambiguous.
  """
  input_axes, batch_size = _input_axes(inputs, data_first_axis)
  if batch_size == 0:
    raise ValueError('The batch is empty (batch size 0): drop empty batches from the training data.')
  preferred = 0 if data_first_axis == 'B' else 1
  leaves = _leaves_with_paths(targets)
  candidates = [_target_candidates(path, _shape(leaf), batch_size, preferred, target_batch_axis)
                for path, leaf in leaves]
  if any(len(c) > 1 for c in candidates):
    if resolve is None:
      ambiguous = [i for i, c in enumerate(candidates) if len(c) > 1]
      raise ambiguous_targets_error([_describe('targets', leaves[i][0]) for i in ambiguous],
                                    [_shape(leaves[i][1]) for i in ambiguous], [candidates[i] for i in ambiguous],
                                    batch_size, 'two of its axes have the batch size')
    axes = list(resolve(input_axes, batch_size, candidates))
  else:
    axes = [c[0] for c in candidates]
  treedef = jax.tree_util.tree_structure(targets, is_leaf=is_array)
  return BatchLayout(batch_size, input_axes, jax.tree_util.tree_unflatten(treedef, axes))


def take_samples(tree, axes, start, size: int):
  """Slice ``size`` samples beginning at ``start`` (an int or a traced index) out of every leaf."""
  return jax.tree_util.tree_map(
    lambda x, axis: jax.lax.dynamic_slice_in_dim(bm.as_jax(x), start, size, axis=axis),
    tree, axes, is_leaf=is_array)


def put_samples(tree, axes, start, values):
  """Write ``values`` into every leaf of ``tree`` at samples ``start, start + 1, ...``."""
  return jax.tree_util.tree_map(
    lambda x, axis, v: jax.lax.dynamic_update_slice_in_dim(x, v.astype(x.dtype), start, axis=axis),
    tree, axes, values, is_leaf=is_array)


def first_samples(x, axis: int, n: int):
  """The first ``n`` samples of ``x`` on ``axis``; zeros stand in for samples beyond its size."""
  x = bm.as_jax(x)
  size = x.shape[axis]
  if n <= size:
    return take_samples(x, axis, 0, n)
  pad = x.shape[:axis] + (n - size,) + x.shape[axis + 1:]
  return jnp.concatenate([x, jnp.zeros(pad, x.dtype)], axis=axis)


def samples_shape(x, axis: int, n: int) -> jax.ShapeDtypeStruct:
  """The shape and dtype of :func:`first_samples` ``(x, axis, n)``, without running it: a trace needs no more (a
  slice of host data run would copy it to the device and compile the slice, on every batch shape)."""
  x = x.value if isinstance(x, bm.Array) else x  # (a brainpy Array keeps its weak type in its value)
  shape = tuple(x.shape[:axis]) + (n,) + tuple(x.shape[axis + 1:])
  return jax.ShapeDtypeStruct(shape, x.dtype, weak_type=bool(getattr(x, 'weak_type', False)))


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

    cut = [x if a is None else samples_shape(x, a, n) for x, a in zip(leaves, axes)]
    traced = brainstate.transform.StatefulFunction(run, return_only_write=False)
    traced.make_jaxpr(*cut)
    return traced.get_out_shapes(*cut)[0]

  return [at(n) for n in sizes]


def second_sizes(plan: MicroBatchPlan) -> Tuple[int, int]:
  """Two different micro-batch sizes to trace the outputs at, so that their batch axes show."""
  size = plan.micro_batch_size
  return size, (plan.remainder if plan.remainder else (size - 1 if size > 1 else 2))
