"""Deciding the batch axis of a target whose axes 0 and 1 both have the batch's size, from evidence.

``bp.BPTT`` never cuts targets, so it never needs their batch axis; micro-batches do. One-hot labels with as
many classes as samples, or ``(batch, time)`` targets with as many steps as samples, have two axes of the
batch's size. :func:`decide_target_axes` traces the model and the loss (shapes only: nothing runs, nothing
changes) at two micro-batch sizes that differ from the batch, once per choice of axes: the one choice for
which ``loss_fun`` accepts the micro-batch's predictions and targets at both sizes, and returns a scalar, is
the batch axis. No choice, or more than one, raises the error that names ``target_batch_axis``.
"""

import itertools
from typing import Callable, ContextManager, Dict, List, Sequence

import brainstate
import jax
import numpy as np
from brainpy import tools

from ._batch import ambiguous_targets_error, describe_leaf, is_array
from ._batch import samples_shape, traced_shapes
from ._states import batched_variables, declared_batch_axes

__all__ = ['TargetAxes', 'decide_target_axes', 'evidence_sizes']

MAX_CHOICES = 64


def evidence_sizes(batch_size: int):
  """Two micro-batch sizes unlike the batch's, so that an axis of the batch's size that is not the batch stays
  put while the batch axis moves (zeros stand in for samples beyond the batch: only shapes matter)."""
  return batch_size + 1, batch_size + 2


def decide_target_axes(predict_shapes: Callable, loss_of: Callable, targets, batch_size: int,
                       candidates: Sequence[List[int]]) -> List[int]:
  """The batch axis of every target leaf, chosen among ``candidates`` (one list per leaf) from evidence.

  ``predict_shapes(sizes)``: the shapes of the model's predictions at each of the micro-batch ``sizes``;
  ``loss_of(predicts, targets) -> (loss, aux)``.
  """
  sizes = evidence_sizes(batch_size)
  predicts = predict_shapes(sizes)
  paths = jax.tree_util.tree_flatten_with_path(targets, is_leaf=is_array)[0]
  leaves, treedef = [x for _, x in paths], jax.tree_util.tree_structure(targets, is_leaf=is_array)
  choices = list(itertools.islice(itertools.product(*candidates), MAX_CHOICES + 1))
  ambiguous = [i for i, c in enumerate(candidates) if len(c) > 1]
  names = [describe_leaf('targets', paths[i][0]) for i in ambiguous]
  shapes = [tuple(leaves[i].shape) for i in ambiguous]
  if len(choices) > MAX_CHOICES:
    raise ambiguous_targets_error(names, shapes, [candidates[i] for i in ambiguous], batch_size,
                                  f'more than {MAX_CHOICES} choices of axes to try')

  def accepted(axes) -> bool:
    for n, outputs in zip(sizes, predicts):
      cut = treedef.unflatten([samples_shape(x, a, n) for x, a in zip(leaves, axes)])  # (shapes: nothing runs)
      try:
        loss = brainstate.transform.eval_shape(lambda o, t: loss_of(o, t)[0], outputs, cut)  # (Variables too)
      except Exception:  # any shape error of the user's loss is evidence against this choice
        return False
      if getattr(loss, 'shape', None) != ():
        return False
    return True

  fitting = [axes for axes in choices if accepted(axes)]
  if len(fitting) == 1:
    return list(fitting[0])
  why = ('loss_fun accepts micro-batches cut along either axis' if fitting else
         'loss_fun accepts micro-batches cut along none of them')
  raise ambiguous_targets_error(names, shapes, [candidates[i] for i in ambiguous], batch_size, why)


def predict_shapes_of(forward: Callable, inputs, input_axes, states) -> Callable:
  """``predict_shapes(sizes)`` for :func:`decide_target_axes`: ``forward((inputs,), n)`` traced at each size."""
  axes = jax.tree_util.tree_leaves(input_axes)
  return lambda sizes: traced_shapes(forward, (inputs,), axes, states, sizes)


class TargetAxes:
  """The batch axes of a trainer's ambiguous targets, decided once per batch shape.

  ``forward(shared_args) -> forward(micro_args, size)`` and ``loss_of(predicts, targets)``: the model's loss;
  ``quiet()``: tracing without per-time-step progress bars.
  """

  def __init__(self, model, forward: Callable, loss_of: Callable, quiet: Callable[[], ContextManager]):
    self.model, self.forward, self.loss_of, self.quiet = model, forward, loss_of, quiet
    self._decided: Dict[tuple, List[int]] = {}

  def __call__(self, inputs, targets, input_axes, batch_size: int, candidates) -> List[int]:
    """Target leaves with two axes of the batch's size: their batch axes from evidence
    (:func:`decide_target_axes`), decided once per batch shape."""
    key = (jax.tree_util.tree_structure((inputs, targets), is_leaf=is_array),
           tuple(tuple(np.shape(x)) for x in jax.tree_util.tree_leaves((inputs, targets), is_leaf=is_array)),
           tuple(map(tuple, candidates)))
    if key not in self._decided:
      states = batched_variables(self.model, batch_size)
      with declared_batch_axes(states.values()), self.quiet():
        predict = predict_shapes_of(self.forward(tools.DotDict({'fit': True})), inputs, input_axes, list(states.values()))
        self._decided[key] = decide_target_axes(predict, self.loss_of, targets, batch_size, candidates)
    return self._decided[key]
