"""One epoch of :meth:`AccumBPTT.fit`: checks, resets, the right compiled step per batch, reports.

Kept apart from the trainer so the loop reads in one sitting. It records what
:class:`brainpy.BPTT` records (per-batch losses and metrics, report-window
means) and adds to each report line how the batch was cut, how many batches
make one update and, with ``skip_nonfinite``, how many were skipped.
"""

from typing import Any, Callable, NamedTuple, Optional, Sized, Tuple, cast

import brainstate.environ
from brainpy import tools
from tqdm import tqdm

from ._checks import check_data, check_fit_args
from ._compiles import count_compilations
from ._report import PhaseLog
from ._oom import run_with_retry
from ._window import steps_for_epoch, with_last_flag

__all__ = ['LoopOptions', 'fit', 'run_epoch']


class LoopOptions(NamedTuple):
  """The :meth:`fit` arguments every epoch needs."""
  num_report: int
  reset_state: bool
  shared_args: Any
  fun_after_report: Optional[Callable]
  show_bars: bool


def fit(trainer, train_data, test_data, num_epoch: int, num_report: int, reset_state: bool, shared_args,
        fun_after_report: Optional[Callable], batch_size) -> None:
  """:meth:`AccumBPTT.fit`: check the arguments, run the epochs, keep the metrics as ``bp.BPTT`` keeps them."""
  check_fit_args(num_epoch, num_report, reset_state, fun_after_report, batch_size)
  check_data('train_data', train_data)
  if test_data is not None:
    check_data('test_data', test_data)
  shared_args = tools.DotDict({'fit': True, **(shared_args or {})})
  options = LoopOptions(num_report, reset_state, shared_args, fun_after_report, show_bars=trainer.progress_bar)
  logs = {'fit': PhaseLog('Train'), 'test': PhaseLog('Test')}
  try:
    with trainer._without_time_step_bars(), brainstate.environ.context(fit=True):
      for epoch in range(num_epoch):
        run_epoch(trainer, 'fit', train_data, logs['fit'], epoch, options)
        trainer.optimizer.lr.step_epoch()
        if test_data is not None:
          run_epoch(trainer, 'test', test_data, logs['test'], epoch, options)
  finally:
    trainer._report_train_metrics, trainer._detailed_train_metrics = logs['fit'].arrays()
    trainer._report_test_metrics, trainer._detailed_test_metrics = logs['test'].arrays()


def run_epoch(trainer, phase: str, data, log: PhaseLog, epoch: int, options: LoopOptions) -> None:
  """Run one pass of ``phase`` (``'fit'`` or ``'test'``) over ``data``."""
  batches = data() if callable(data) else data
  bar = tqdm(total=len(cast(Sized, batches))) if options.show_bars and hasattr(batches, '__len__') else None
  window = steps_for_epoch(trainer.accumulate_steps, epoch) if phase == 'fit' else 1
  log.start_epoch()
  try:
    for position, ((inputs, targets), last) in enumerate(with_last_flag(batches)):
      layout = trainer._check_batch(inputs, targets)  # before anything changes
      if options.reset_state:
        trainer.target.reset(layout.batch_size)
        trainer.reset_state()
      trainer._place_on_mesh(layout.batch_size)  # the same placement every step: one compilation per batch shape
      if trainer.num_micro_batch == 'auto':
        trainer.plan_memory(inputs, targets, options.shared_args)
      if phase == 'fit':
        trainer._check_loss_once(options.shared_args, inputs, targets)  # once per trainer, changes nothing
      update = last or (position + 1) % window == 0
      result, compiles = run_with_retry(  # out of device memory: the same batch again, cut finer
        lambda: _call_step(trainer, phase, update, options.shared_args, inputs, targets),
        lambda error: trainer._replan_finer(layout.batch_size))
      step_phase = 'fit' if phase == 'fit' else 'loss'
      if trainer.jit[step_phase]:  # without jit every operation compiles on its own: nothing to count
        trainer._note_compilations(step_phase, compiles)
      loss, aux = _split_result(trainer, phase, result)
      log.record(loss, aux, _describe(trainer, layout.batch_size, window))
      if bar is not None:
        bar.update(1)
      if options.num_report > 0 and log.steps % options.num_report == 0:
        _emit(trainer, log, log.steps, 'steps', phase, bar, options.fun_after_report)
    if options.num_report <= 0:
      _emit(trainer, log, epoch, 'epoch', phase, bar, options.fun_after_report)
  finally:
    if bar is not None:
      bar.close()


def _call_step(trainer, phase: str, update: bool, shared_args, inputs, targets):
  """Run the compiled step for this batch; return its result and the XLA compilations it caused."""
  step = _step_for(trainer, phase, update)
  with count_compilations() as compiled:
    result = step(shared_args, inputs, targets)
  return result, compiled()


def _step_for(trainer, phase: str, update: bool):
  if phase != 'fit':
    return trainer.f_loss
  return trainer.f_train if update else trainer._f_collect


def _describe(trainer, batch_size: int, window: int) -> str:
  text = trainer.describe_batch(batch_size)
  return text + (f', {window} batches per update' if window > 1 else '')


def _split_result(trainer, phase: str, result) -> Tuple[Any, dict]:
  if phase == 'fit':
    return result[0], (result[1] if trainer.loss_has_aux else {})
  return result if trainer.loss_has_aux else (result, {})


def _emit(trainer, log: PhaseLog, idx: int, unit: str, phase: str, bar, fun_after_report) -> None:
  skipped = trainer.skip_nonfinite and phase == 'fit'
  line, means = log.close_window(idx, unit, f', skipped {int(trainer.skipped_steps.value)} non-finite' if skipped else '')
  if bar is not None:
    bar.set_description(line, refresh=True)
  else:
    print(line)
  if fun_after_report is not None:
    fun_after_report(idx, means, phase)
