"""What the trainer's model and loss give for one (micro-)batch: predictions, loss and metrics, weight.

:class:`ModelLoss` is a mixin of :class:`~brainpy_accum.AccumBPTT` over :class:`brainpy.BPTT`'s own
prediction and loss functions: the time loop (rematerialised with ``remat``, or with ``remat='auto'`` the remat
of the plan whose step is being traced), what ``loss_fun`` receives,
its checked ``(loss, metrics)``, and each micro-batch's weight in the combined gradient.
"""

import contextlib
import functools
from typing import Callable, Optional, Union

import brainpy.math as bm
import jax
import jax.numpy as jnp
import numpy as np

from ..core._batch import is_array
from ..core._cut import MicroBatchPlan
from ..core._shared_env import restores_shared_env
from ..memory._remat import checkpointed_time_loop

__all__ = ['ModelLoss']


class ModelLoss:
  """The model's predictions and the loss of a (micro-)batch, as :class:`~brainpy_accum.AccumBPTT` uses them."""

  # With remat='auto' each batch size has its own remat, read while its step is traced (see _remat_in_effect).
  _plan_in_trace: Optional[MicroBatchPlan] = None

  @restores_shared_env  # the time step's bp.share.save(i=..., t=..., **shared_args) holds tracers: gone at its end
  def _step_func_predict(self, *args, **kwargs):
    return super()._step_func_predict(*args, **kwargs)

  def _fun_predict(self, indices, *inputs, shared_args=None):
    remat = self._remat_in_effect()  # per batch size with remat='auto'
    if not remat or self._memory_efficient:
      return super()._fun_predict(indices, *inputs, shared_args=shared_args)
    step = functools.partial(self._step_func_predict, shared_args=shared_args)
    segment = None if remat is True else remat
    return checkpointed_time_loop(step, indices, inputs, segment, jit=self.jit['predict'])

  @contextlib.contextmanager
  def _tracing(self, plan: Optional[MicroBatchPlan]):
    """Trace a step for ``plan``: its remat is the one :meth:`_remat_in_effect` gives inside."""
    outer, self._plan_in_trace = self._plan_in_trace, plan or self._plan_in_trace
    try:
      yield
    finally:
      self._plan_in_trace = outer

  def _remat_in_effect(self) -> Union[bool, int]:
    """The remat of the step being traced: the ``remat`` option, or with ``'auto'`` that of the plan being
    traced (:meth:`_tracing`). Outside a planned step (e.g. ``predict``): no remat."""
    if self.remat != 'auto':
      return self.remat
    plan = self._plan_in_trace
    return plan.remat if plan is not None and plan.remat else False

  def _forward(self, shared_args) -> Callable:
    """What ``loss_fun`` receives for a micro-batch, as ``forward(micro_args, size)`` (see :mod:`~brainpy_accum.core._two_pass`)."""
    return lambda micro_args, size: self._predicts(shared_args, micro_args[0])

  def _predicts(self, shared_args, inputs):
    """What ``loss_fun`` receives for ``inputs``: the outputs, and the monitors if any (as in bp.BPTT)."""
    indices = np.arange(self.i0, self.i0 + self._get_input_time_step(xs=inputs), dtype=np.int_)
    if isinstance(self.target.mode, bm.BatchingMode) and self.data_first_axis == 'B':
      inputs = jax.tree_util.tree_map(lambda x: bm.moveaxis(x, 0, 1), inputs, is_leaf=is_array)
    outs, mons = self._predict(indices, *(inputs if isinstance(inputs, (tuple, list)) else (inputs,)),
                               shared_args=shared_args)
    predicts = (outs, mons) if len(mons) > 0 else outs
    return jax.tree_util.tree_map(bm.as_jax, predicts, is_leaf=is_array)

  def _loss_of(self, predicts, targets):
    return self._checked_aux(self._loss_func(predicts, targets))

  def _loss_and_aux(self, shared_args, inputs, targets):
    return self._checked_aux(self._step_func_loss(shared_args, inputs, targets))

  def _checked_aux(self, out):
    if not self.loss_has_aux:
      return out, {}
    loss, aux = out
    if not isinstance(aux, dict):
      raise TypeError(f'With loss_has_aux=True the loss must return (loss, dict of metrics); '
                      f'its second item is a {type(aux).__name__}.')
    return loss, jax.tree_util.tree_map(bm.as_jax, aux, is_leaf=is_array)  # BrainPy arrays as JAX leaves

  def _weigh(self, micro_args, size: int):
    """A micro-batch's weight: its sample count (``'mean'``), ``loss_weight_fn``'s value, or 1 (``'sum'``)."""
    if self.grad_reduction == 'sum':
      return jnp.ones((), jnp.float32)
    if self.loss_weight_fn is None:
      return jnp.asarray(size, jnp.float32)
    return jnp.asarray(self.loss_weight_fn(*micro_args), jnp.float32)
