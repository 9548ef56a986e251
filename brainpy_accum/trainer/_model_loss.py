"""What the trainer's model and loss give for one (micro-)batch: predictions, loss and metrics, weight.

:class:`ModelLoss` is built by :class:`~brainpy_accum.AccumBPTT` from :class:`brainpy.BPTT`'s own prediction and
loss functions, which it receives as :class:`BPTTFunctions`: the time loop (rematerialised with ``remat``, or
with ``remat='auto'`` the remat of the plan whose step is being traced), what ``loss_fun`` receives, its checked
``(loss, metrics)``, and each micro-batch's weight in the combined gradient.
"""

import contextlib
import functools
from typing import Any, Callable, NamedTuple, Optional, Union

import brainpy.math as bm
import jax
import numpy as np

from ..core._batch import is_array
from ..core._combine import micro_batch_weight
from ..core._cut import MicroBatchPlan
from ..memory._remat import checkpointed_time_loop

__all__ = ['BPTTFunctions', 'ModelLoss']


class BPTTFunctions(NamedTuple):
  """bp.BPTT's own functions that :class:`ModelLoss` calls, handed over by the trainer.

  ``predict(indices, *inputs, shared_args=...) -> (outputs, monitors)``: the model over time;
  ``predict_step(i, *inputs, shared_args=...)``: one time step of it; ``time_steps(inputs) -> int``;
  ``first_step() -> int``: the index of the first time step; ``step_loss(shared_args, inputs, targets)``: the
  loss of a batch, as bp.BPTT computes it; ``loss_func(predicts, targets)``: ``loss_fun``.
  """
  predict: Callable
  predict_step: Callable
  time_steps: Callable[[Any], int]
  first_step: Callable[[], int]
  step_loss: Callable
  loss_func: Callable


class ModelLoss:
  """The model's predictions and the loss of a (micro-)batch, as :class:`~brainpy_accum.AccumBPTT` uses them.

  Parameters
  ----------
  functions : BPTTFunctions
    bp.BPTT's own functions.
  batch_first : bool
    The data's batch axis comes first (a batching model with ``data_first_axis='B'``): moved behind time.
  loss_has_aux, grad_reduction, loss_weight_fn, remat
    The trainer's options.
  jit_predict : bool
    Whether the time steps are jitted (``jit['predict']``), for a rematerialised time loop.
  """

  def __init__(self, functions: BPTTFunctions, *, batch_first: bool, loss_has_aux: bool, grad_reduction: str,
               loss_weight_fn: Optional[Callable], remat: Union[bool, int, str], jit_predict: bool):
    self.functions, self.batch_first, self.loss_has_aux = functions, batch_first, loss_has_aux
    self.grad_reduction, self.loss_weight_fn, self.remat, self.jit_predict = (grad_reduction, loss_weight_fn, remat,
                                                                              jit_predict)
    # With remat='auto' each batch size has its own remat, read while its step is traced (see remat_in_effect).
    self._plan_in_trace: Optional[MicroBatchPlan] = None

  def over_time(self, plain: Callable, indices, inputs, shared_args):
    """The model over the time steps ``indices``: ``plain(indices, *inputs, shared_args=...)`` (bp.BPTT's own
    loop), or rematerialised in segments where remat is in effect."""
    remat = self.remat_in_effect()  # per batch size with remat='auto'
    if not remat:
      return plain(indices, *inputs, shared_args=shared_args)
    step = functools.partial(self.functions.predict_step, shared_args=shared_args)
    return checkpointed_time_loop(step, indices, inputs, None if remat is True else remat, jit=self.jit_predict)

  @contextlib.contextmanager
  def tracing(self, plan: Optional[MicroBatchPlan]):
    """Trace a step for ``plan``: its remat is the one :meth:`remat_in_effect` gives inside."""
    outer, self._plan_in_trace = self._plan_in_trace, plan or self._plan_in_trace
    try:
      yield
    finally:
      self._plan_in_trace = outer

  def remat_in_effect(self) -> Union[bool, int]:
    """The remat of the step being traced: the ``remat`` option, or with ``'auto'`` that of the plan being
    traced (:meth:`tracing`). Outside a planned step (e.g. ``predict``): no remat."""
    if self.remat != 'auto':
      return self.remat
    plan = self._plan_in_trace
    return plan.remat if plan is not None and plan.remat else False

  def forward(self, shared_args) -> Callable:
    """What ``loss_fun`` receives for a micro-batch, as ``forward(micro_args, size)`` (see
    :mod:`~brainpy_accum.core._two_pass`)."""
    return lambda micro_args, size: self.predicts(shared_args, micro_args[0])

  def predicts(self, shared_args, inputs):
    """What ``loss_fun`` receives for ``inputs``: the outputs, and the monitors if any (as in bp.BPTT)."""
    first = self.functions.first_step()
    indices = np.arange(first, first + self.functions.time_steps(inputs), dtype=np.int_)
    if self.batch_first:
      inputs = jax.tree_util.tree_map(lambda x: bm.moveaxis(x, 0, 1), inputs, is_leaf=is_array)
    outs, mons = self.functions.predict(indices, *(inputs if isinstance(inputs, (tuple, list)) else (inputs,)),
                                        shared_args=shared_args)
    predicts = (outs, mons) if len(mons) > 0 else outs
    return jax.tree_util.tree_map(bm.as_jax, predicts, is_leaf=is_array)

  def loss_of(self, predicts, targets):
    """``(loss, metrics)`` of ``loss_fun`` at ``predicts``."""
    return self._checked_aux(self.functions.loss_func(predicts, targets))

  def loss_and_aux(self, shared_args, inputs, targets):
    """``(loss, metrics)`` of a (micro-)batch, the model run as bp.BPTT runs it."""
    return self._checked_aux(self.functions.step_loss(shared_args, inputs, targets))

  def _checked_aux(self, out):
    if not self.loss_has_aux:
      return out, {}
    loss, aux = out
    if not isinstance(aux, dict):
      raise TypeError(f'With loss_has_aux=True the loss must return (loss, dict of metrics); '
                      f'its second item is a {type(aux).__name__}.')
    return loss, jax.tree_util.tree_map(bm.as_jax, aux, is_leaf=is_array)  # BrainPy arrays as JAX leaves

  def weigh(self, micro_args, size: int):
    """A micro-batch's weight: its sample count (``'mean'``), ``loss_weight_fn``'s value, or 1 (``'sum'``)."""
    return micro_batch_weight(self.grad_reduction, self.loss_weight_fn, micro_args, size)
