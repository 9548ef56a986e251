"""Finding the batch axis of every leaf of a data pytree, and slicing micro-batches out of it.

``data_first_axis='B'`` puts the batch on axis 0 of every input leaf and
``'T'`` on axis 1 (time first), exactly as :class:`brainpy.BPTT` reads them.
Targets follow the same convention; a target leaf with one dimension, or one
whose preferred axis does not hold the batch while axis 0 does (class labels
of shape ``(batch, n_class)`` with time-first inputs), is cut along axis 0.
"""

from typing import Any, Optional

import brainpy.math as bm
import jax
import numpy as np

__all__ = ['BatchLayout', 'batch_layout', 'is_array', 'take_samples', 'put_samples']


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


def _input_axes(inputs, data_first_axis: str):
  axis = 0 if data_first_axis == 'B' else 1
  sizes = {}
  for path, leaf in _leaves_with_paths(inputs):
    shape = _shape(leaf)
    if len(shape) <= axis:
      raise ValueError(f'{_describe("inputs", path)} has shape {shape}, which has no batch axis {axis} '
                       f'for {data_first_axis=}. Inputs are (batch, time, ...) for "B" and (time, batch, ...) for "T".')
    sizes[_describe('inputs', path)] = shape[axis]
  if not sizes:
    raise ValueError('inputs hold no arrays: give each batch as (x, y) with x an array or a pytree of arrays.')
  if len(set(sizes.values())) != 1:
    raise ValueError(f'The input arrays disagree on the batch size along axis {axis} ({data_first_axis=}): '
                     f'{sizes}. Every input leaf must hold the same samples.')
  return jax.tree_util.tree_map(lambda _: axis, inputs, is_leaf=is_array), next(iter(sizes.values()))


def _target_axis(path, shape, batch_size: int, preferred: int, forced: Optional[int]) -> int:
  if forced is not None:
    candidates = (forced,)
  else:
    candidates = (preferred, 0) if len(shape) > preferred else (0,)
  for axis in candidates:
    if len(shape) > axis and shape[axis] == batch_size:
      return axis
  raise ValueError(f'{_describe("targets", path)} has shape {shape}, but the inputs hold batch_size={batch_size} '
                   f'samples and no target axis among {candidates} has that size. Give targets with the '
                   f'same samples as the inputs, or set target_batch_axis to the axis that holds them.')


def batch_layout(inputs, targets, data_first_axis: str, target_batch_axis: Optional[int] = None) -> BatchLayout:
  """Find and check the batch axis of every leaf of ``inputs`` and ``targets``.

  Parameters
  ----------
  inputs, targets : pytree of arrays
    One batch, as given to :meth:`brainpy.BPTT.fit`.
  data_first_axis : {'B', 'T'}
    Whether inputs are batch-first or time-first.
  target_batch_axis : int, optional
    Force the batch axis of every target leaf.

  Returns
  -------
  BatchLayout

  Raises
  ------
  ValueError
    If a leaf has no batch axis, leaves disagree on the batch size, or the batch is empty.
  """
  input_axes, batch_size = _input_axes(inputs, data_first_axis)
  if batch_size == 0:
    raise ValueError('The batch is empty (batch size 0): drop empty batches from the training data.')
  preferred = 0 if data_first_axis == 'B' else 1
  axes = [_target_axis(path, _shape(leaf), batch_size, preferred, target_batch_axis)
          for path, leaf in _leaves_with_paths(targets)]
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
