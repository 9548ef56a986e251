"""``AccumBPTT``: :class:`brainpy.BPTT` with gradient accumulation over micro-batches inside one compiled step."""

from typing import Any, Callable, Dict, Iterable, Optional, Sized, Tuple, Union, cast

import brainpy as bp
import brainpy.math as bm
import brainstate.environ
import jax.numpy as jnp
from brainpy import tools
from brainpy.running import constants as c
from tqdm import tqdm

from ._accumulate import add_scaled, append_entry, combine_values, finish_grads, wide_zeros_like
from ._batch import BatchLayout, batch_layout, put_samples, take_samples
from ._checks import check_accumulation_args, check_data, check_fit_args
from ._plan import MicroBatchPlan, plan_micro_batches
from ._report import PhaseLog

__all__ = ['AccumBPTT']


class AccumBPTT(bp.BPTT):
  """Back-propagation through time with gradient accumulation over micro-batches.

  A drop-in replacement for :class:`brainpy.BPTT`: the same constructor
  arguments and the same :meth:`fit`, plus the accumulation options below.
  Each batch is cut into micro-batches that run one after another inside one
  compiled train step, so only one micro-batch's activations are alive at a
  time; their gradients are combined and the optimizer updates once::

    for each micro-batch i of the batch (n_i samples):
      model state <- its n_i samples of the batch's model state
      g_i, loss_i = grad(loss)(micro-batch i)
      acc += w_i * g_i                      # w_i = n_i ('mean') or 1 ('sum')
    optimizer.update(acc / sum_i w_i)       # one update per batch ('mean')

  With ``grad_reduction='mean'`` and a loss that averages over samples, the
  update, the reported loss and the auxiliary metrics equal those of
  :class:`brainpy.BPTT` on the whole batch (to float32 round-off), for any
  batch size: a batch that does not divide evenly runs one shorter
  micro-batch, weighted by its sample count.

  Parameters
  ----------
  target : DynamicalSystem
    The model to train, in a batching or training mode.
  loss_fun : str, callable
    The loss ``loss_fun(predicts, targets)``, or a name from ``brainpy.losses``.
  optimizer : Optimizer, optional
    The optimizer; defaults as in :class:`brainpy.BPTT`.
  num_micro_batch : int, optional
    Cut each batch into at most this many micro-batches of
    ``ceil(batch_size / num_micro_batch)`` samples. Give this or ``micro_batch_size``.
  micro_batch_size : int, optional
    Cut each batch into micro-batches of this many samples (the last one may
    be shorter). Give this or ``num_micro_batch``.
  grad_reduction : {'mean', 'sum'}
    ``'mean'`` (default) weights each micro-batch by its sample count and
    divides by the batch size: the right choice for losses that average over
    samples. ``'sum'`` adds the micro-batch gradients, losses and metrics: the
    right choice for losses that sum over samples.
  target_batch_axis : int, optional
    The batch axis of every target leaf. By default it follows
    ``data_first_axis`` (axis 0 for ``'B'``, axis 1 for ``'T'``) and falls back
    to axis 0 for leaves whose preferred axis does not hold the batch.
  **kwargs
    Any other :class:`brainpy.BPTT` argument (``loss_has_aux``, ``monitors``,
    ``jit``, ``data_first_axis``, ``progress_bar``, ...).

  Attributes
  ----------
  trace_counts : dict
    How many times the train step (``'fit'``) and the evaluation step
    (``'loss'``) were traced: one per distinct batch shape when jitted.
    :attr:`compilations` counts the XLA executables behind them.

  Examples
  --------
  >>> import brainpy as bp, brainpy.math as bm, numpy as np
  >>> from brainpy_accum import AccumBPTT
  >>> bm.random.seed(0)
  >>> with bm.training_environment():
  ...   model = bp.Sequential(bp.dyn.RNNCell(3, 8), bp.dnn.Dense(8, 2))
  >>> trainer = AccumBPTT(model, bp.losses.mean_squared_error, optimizer=bp.optim.Adam(lr=1e-2),
  ...                     num_micro_batch=4, progress_bar=False)
  >>> x, y = np.ones((10, 5, 3), 'float32'), np.zeros((10, 5, 2), 'float32')
  >>> trainer.fit([(x, y)], num_epoch=2)  # doctest: +ELLIPSIS
  Train 0 epoch, use ... s, loss ... (batch 10 = 3 x 3 + 1)
  Train 1 epoch, use ... s, loss ... (batch 10 = 3 x 3 + 1)
  >>> trainer.train_losses.shape
  (2,)
  """

  def __init__(
      self,
      target: bp.DynamicalSystem,
      loss_fun: Union[str, Callable],
      optimizer: Optional[bp.optim.Optimizer] = None,
      *,
      num_micro_batch: Optional[int] = None,
      micro_batch_size: Optional[int] = None,
      grad_reduction: str = 'mean',
      target_batch_axis: Optional[int] = None,
      **kwargs,
  ):
    check_accumulation_args(num_micro_batch, micro_batch_size, grad_reduction, target_batch_axis)
    super().__init__(target, loss_fun, optimizer=optimizer, **kwargs)
    self.num_micro_batch = num_micro_batch
    self.micro_batch_size = micro_batch_size
    self.grad_reduction = grad_reduction
    self.target_batch_axis = target_batch_axis
    self.trace_counts = {'fit': 0, 'loss': 0}
    self._jit_step_func_eval = bm.jit(self._step_func_eval, static_argnums=(0,))

  def __repr__(self):
    return (f'{self.__class__.__name__}(target={self.target}, num_micro_batch={self.num_micro_batch}, '
            f'micro_batch_size={self.micro_batch_size}, grad_reduction={self.grad_reduction!r}, '
            f'optimizer={self.optimizer})')

  @property
  def compilations(self) -> Dict[str, int]:
    """XLA executables compiled so far for the train (``'fit'``) and evaluation (``'loss'``) steps."""
    return {'fit': self._jit_step_func_fit.jitted_fun._cache_size(),
            'loss': self._jit_step_func_eval.jitted_fun._cache_size()}

  # ------------------------------------------------------------------ planning

  def plan_for(self, batch_size: int) -> MicroBatchPlan:
    """The micro-batches that a batch of ``batch_size`` samples is cut into.

    Examples
    --------
    >>> import brainpy as bp, brainpy.math as bm
    >>> from brainpy_accum import AccumBPTT
    >>> with bm.training_environment():
    ...   model = bp.dnn.Dense(2, 2)
    >>> AccumBPTT(model, 'mean_squared_error', num_micro_batch=4).plan_for(10).sizes
    (3, 3, 3, 1)
    """
    return plan_micro_batches(batch_size, num_micro_batch=self.num_micro_batch,
                              micro_batch_size=self.micro_batch_size)

  def check_batch(self, inputs: Any, targets: Any) -> BatchLayout:
    """Check one batch and return its layout; raises ``ValueError`` before anything changes."""
    return batch_layout(inputs, targets, self.data_first_axis, self.target_batch_axis)

  # ------------------------------------------------------------------ compiled steps

  @property
  def f_loss(self):
    """The micro-batched evaluation step (jitted unless ``jit`` says otherwise)."""
    return self._jit_step_func_eval if self.jit[c.LOSS_PHASE] else self._step_func_eval

  def _step_func_fit(self, shared_args, inputs, targets):
    self.trace_counts['fit'] += 1
    grads, loss, aux = self._accumulate(shared_args, inputs, targets, with_grads=True)
    self.optimizer.update(grads)
    return (loss, aux) if self.loss_has_aux else (loss,)

  def _step_func_eval(self, shared_args, inputs, targets):
    self.trace_counts['loss'] += 1
    _, loss, aux = self._accumulate(shared_args, inputs, targets, with_grads=False)
    return (loss, aux) if self.loss_has_aux else loss

  def _loss_and_aux(self, shared_args, inputs, targets):
    out = self._step_func_loss(shared_args, inputs, targets)
    if not self.loss_has_aux:
      return out, {}
    loss, aux = out
    if not isinstance(aux, dict):
      raise TypeError(f'With loss_has_aux=True the loss must return (loss, dict of metrics); '
                      f'its second item is a {type(aux).__name__}.')
    return loss, aux

  def _micro_step(self, shared_args, inputs, targets, with_grads: bool):
    """``(grads or None, loss, aux)`` of one micro-batch, from the current model state."""
    if not with_grads:
      return (None,) + tuple(self._loss_and_aux(shared_args, inputs, targets))
    grad_fn = bm.grad(self._loss_and_aux, grad_vars=self.target.train_vars().unique(),
                      return_value=True, has_aux=True)
    grads, loss, aux = grad_fn(shared_args, inputs, targets)
    return {k: bm.as_jax(g) for k, g in grads.items()}, loss, aux

  def _batched_states(self) -> Dict[str, bm.Variable]:
    return {k: v for k, v in self.target.vars().unique().items()
            if not isinstance(v, bm.TrainVar) and getattr(v, 'batch_axis', None) is not None}

  @staticmethod
  def _state_for_batch(name: str, var: bm.Variable, batch_size: int):
    value, axis = bm.as_jax(var.value), var.batch_axis
    if value.shape[axis] == batch_size:
      return value
    if value.shape[axis] == 1:
      return jnp.repeat(value, batch_size, axis=axis)
    raise ValueError(f'Model state {name} holds {value.shape[axis]} samples along its batch axis {axis}, but '
                     f'the batch has {batch_size}. Call model.reset({batch_size}) first, or fit with reset_state=True.')

  def _accumulate(self, shared_args, inputs, targets, with_grads: bool):
    """Run every micro-batch of one batch; return the combined ``(grads, loss, aux)``."""
    layout = self.check_batch(inputs, targets)
    plan = self.plan_for(layout.batch_size)
    if plan.num_micro_batches == 1:
      return self._micro_step(shared_args, inputs, targets, with_grads)

    states = self._batched_states()
    state_axes = {k: v.batch_axis for k, v in states.items()}
    buffer = {k: self._state_for_batch(k, v, plan.batch_size) for k, v in states.items()}
    params = {k: v.value for k, v in self.target.train_vars().unique().items()}

    def run(start, size, buffer):
      # Each micro-batch starts from its own samples of the batch's model state and
      # leaves its final state there, so the state after the step is the whole batch's.
      for k, var in states.items():
        var.value = take_samples(buffer[k], state_axes[k], start, size)
      out = self._micro_step(shared_args, take_samples(inputs, layout.input_axes, start, size),
                             take_samples(targets, layout.target_axes, start, size), with_grads)
      buffer = put_samples(buffer, state_axes, start, {k: var.value for k, var in states.items()})
      return out, buffer

    weight = (lambda n: float(n)) if self.grad_reduction == 'mean' else (lambda n: 1.)
    size = plan.micro_batch_size

    def body(carry, index):
      grad_sum, buffer = carry
      (grads, loss, aux), buffer = run(index * size, size, buffer)
      if with_grads:
        grad_sum = add_scaled(grad_sum, weight(size), grads)
      return (grad_sum, buffer), (loss, aux)

    # The scan carries the model state at the micro-batch size.
    for k, var in states.items():
      var.value = take_samples(buffer[k], state_axes[k], 0, size)
    init = (wide_zeros_like(params) if with_grads else None, buffer)
    (grad_sum, buffer), values = bm.scan(body, init, jnp.arange(plan.num_full))
    weights = [weight(size)] * plan.num_full
    if plan.remainder:
      (grads, loss, aux), buffer = run(plan.num_full * size, plan.remainder, buffer)
      if with_grads:
        grad_sum = add_scaled(grad_sum, weight(plan.remainder), grads)
      values = append_entry(values, (loss, aux))
      weights.append(weight(plan.remainder))
    for k, var in states.items():
      var.value = buffer[k]
    loss, aux = combine_values(values, weights, self.grad_reduction)
    grads = finish_grads(grad_sum, sum(weights), self.grad_reduction, params) if with_grads else None
    return grads, loss, aux

  # ------------------------------------------------------------------ training loop

  def fit(
      self,
      train_data: Union[Callable, Iterable],
      test_data: Optional[Union[Callable, Iterable]] = None,
      num_epoch: int = 100,
      num_report: int = -1,
      reset_state: bool = True,
      shared_args: Optional[Dict] = None,
      fun_after_report: Optional[Callable] = None,
  ) -> None:
    """Train on ``train_data`` for ``num_epoch`` epochs, one optimizer update per batch.

    The arguments and the recorded metrics are those of
    :meth:`brainpy.BPTT.fit`; every batch is micro-batched, and so is the
    evaluation on ``test_data``.

    Parameters
    ----------
    train_data : iterable or callable
      Batches ``(inputs, targets)``, or a function returning such an iterable
      (called once per epoch).
    test_data : iterable or callable, optional
      Evaluation batches, run after each training epoch.
    num_epoch : int
      Number of passes over ``train_data``.
    num_report : int
      ``-1`` reports once per epoch; ``k > 0`` every ``k`` batches.
    reset_state : bool
      Reset the model state at the batch size before each batch. With
      ``False`` each sample keeps its model state from the previous batch
      (truncated BPTT over consecutive chunks).
    shared_args : dict, optional
      Shared arguments for the model; ``fit`` is set to ``True`` unless given.
    fun_after_report : callable, optional
      Called as ``fun_after_report(idx, metrics, phase)`` after each report.
    """
    check_fit_args(num_epoch, num_report, reset_state, fun_after_report)
    check_data('train_data', train_data)
    if test_data is not None:
      check_data('test_data', test_data)
    shared_args = dict(shared_args or {})
    shared_args.setdefault('fit', True)
    shared_args = tools.DotDict(shared_args)
    logs = {'fit': PhaseLog('Train'), 'test': PhaseLog('Test')}
    show_bars, self.progress_bar = self.progress_bar, False  # no per-time-step bars inside the step
    try:
      with brainstate.environ.context(fit=True):
        for epoch in range(num_epoch):
          loop = (epoch, num_report, reset_state, shared_args, fun_after_report, show_bars)
          self._run_epoch('fit', train_data, logs['fit'], *loop)
          self.optimizer.lr.step_epoch()
          if test_data is not None:
            self._run_epoch('test', test_data, logs['test'], *loop)
    finally:
      self.progress_bar = show_bars
      self._report_train_metrics, self._detailed_train_metrics = logs['fit'].arrays()
      self._report_test_metrics, self._detailed_test_metrics = logs['test'].arrays()

  def _run_epoch(self, phase, data, log, epoch, num_report, reset_state, shared_args, fun_after_report,
                 show_bars):
    batches = data() if callable(data) else data
    bar = tqdm(total=len(cast(Sized, batches))) if show_bars and hasattr(batches, '__len__') else None
    step = self.f_train if phase == 'fit' else self.f_loss
    try:
      for inputs, targets in batches:
        layout = self.check_batch(inputs, targets)
        if reset_state:
          self.target.reset(layout.batch_size)
          self.reset_state()
        loss, aux = self._split_result(phase, step(shared_args, inputs, targets))
        log.record(loss, aux, self.plan_for(layout.batch_size).describe())
        if bar is not None:
          bar.update(1)
        if num_report > 0 and log.steps % num_report == 0:
          self._emit(log, log.steps, 'steps', phase, bar, fun_after_report)
      if num_report <= 0:
        self._emit(log, epoch, 'epoch', phase, bar, fun_after_report)
    finally:
      if bar is not None:
        bar.close()

  def _split_result(self, phase: str, result) -> Tuple[Any, dict]:
    if phase == 'fit':
      return result[0], (result[1] if self.loss_has_aux else {})
    return result if self.loss_has_aux else (result, {})

  @staticmethod
  def _emit(log: PhaseLog, idx: int, unit: str, phase: str, bar, fun_after_report) -> None:
    line, means = log.close_window(idx, unit)
    if bar is not None:
      bar.set_description(line, refresh=True)
    else:
      print(line)
    if fun_after_report is not None:
      fun_after_report(idx, means, phase)
