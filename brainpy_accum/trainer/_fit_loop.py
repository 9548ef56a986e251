"""The epochs of :meth:`AccumBPTT.fit`: checks, resets, the right compiled step per batch, reports, checkpoints.

Kept apart from the trainer so the loop reads in one sitting. It records what
:class:`brainpy.BPTT` records (per-batch losses and metrics, report-window
means) and adds to each report line how the batch was cut, how many batches
make one update and, with ``skip_nonfinite``, how many were skipped. With a
``checkpoint`` path it saves where the run stands (:mod:`brainpy_accum.checkpoint`) and, run
again, resumes from there.
"""

import contextlib
import itertools
import os
from typing import Any, Callable, ContextManager, Dict, List, NamedTuple, Optional, Sized, Tuple, cast

import brainpy.math as bm
import brainstate.environ
import jax
import jax.numpy as jnp
from brainpy import tools
from tqdm import tqdm

from ..checkpoint._resume import Interrupted, Progress, StopRequest, act_on, check_checkpoint_args, deferred_signals
from ..checkpoint._save_load import load, save_or_warn
from ..core._states import all_samples, batched_variables, declared_batch_axes, values_restored
from ..diagnostics._compiles import count_compilations
from ..memory._oom import run_with_retry
from ..memory._stream import chunk_sizes, combine, host_chunk
from ._arguments import check_carried_batch, check_carried_sizes, check_data, check_fit_args
from ._feed import Ahead, Feed
from ._report import PhaseLog
from ._window import steps_for_epoch

__all__ = ['LoopOptions', 'Run', 'TrainerParts', 'fit', 'run_epoch']


class TrainerParts(NamedTuple):
  """What the loop calls on the trainer beyond its public attributes, handed over by the trainer itself."""
  check_batch: Callable[[Any, Any], Any]         # (inputs, targets) -> BatchLayout; raises before anything changes
  place_on_mesh: Callable[[int], None]           # (batch_size): the Variables on the mesh (nothing without one)
  # (shared_args, inputs, targets[, before_planning]): the first batch's loss check, once: checks the model's
  # states now, returns start() (or None; with metrics the check has started already), which starts the loss
  # check and returns its finish() when it runs beside the first step (or, before_planning, beside the planner)
  check_loss_once: Callable[..., Optional[Callable[[], Optional[Callable[..., None]]]]]
  # (batch_size, error, inputs, targets, shared_args) -> what changed, after running out of memory (or raises)
  replan_finer: Callable[..., str]
  note_compilations: Callable[[str, int], None]  # (phase, count): XLA compilations of a step
  step: Callable[[str], Callable]                # (kind) -> the compiled step: 'loss', 'fit', 'collect' or 'close'
  without_time_step_bars: Callable[[], ContextManager]  # tracing without per-time-step progress bars
  window: Any                                    # the accumulate_steps window (GradWindow) or None, for checkpoints
  metric_plan: Callable[[], Any] = lambda: None  # () -> how the last traced step combined its metrics (MetricPlan)
  plan_cached: Callable[..., bool] = lambda *batch: False  # (shared_args, inputs, targets): a cached plan to read
  plan_chunk: Callable[..., Any] = None  # (inputs, targets, shared_args): the plan of a streamed batch's chunk
  whole_batch_loss: Callable[..., Any] = None  # (shared_args, inputs, targets): bp.BPTT's loss of the whole batch
  keep_history: Callable[..., None] = None  # (report, detailed train metrics, report, detailed test metrics)
  wait_check: Callable[[], None] = lambda: None  # wait for the first-batch check if it runs (no report)


class LoopOptions(NamedTuple):
  """The :meth:`fit` arguments every epoch needs."""
  num_report: int
  reset_state: bool
  shared_args: Any
  fun_after_report: Optional[Callable]
  show_bars: bool


class Run:
  """One :meth:`fit` call's progress, its metric logs and its checkpoints."""

  def __init__(self, trainer, window, checkpoint: Optional[str], checkpoint_every: Optional[int]):
    self.trainer, self.window, self.checkpoint, self.every = trainer, window, checkpoint, checkpoint_every
    self.logs = {'fit': PhaseLog('Train'), 'test': PhaseLog('Test')}
    self.progress = Progress()
    self._test_log_at_start: Optional[dict] = None  # the test log before the running test pass

  def resume(self) -> None:
    """Continue from the checkpoint if one exists (a checkpoint saved by hand: its state, from epoch 0)."""
    if self.checkpoint is None or not os.path.exists(self.checkpoint):
      return
    saved = load(self.trainer, self.checkpoint, self.window)
    if saved is not None:
      self.progress, history = saved
      for phase, log in self.logs.items():
        if phase in history:
          log.restore(history[phase])
    tqdm.write(f'resuming from checkpoint={self.checkpoint!r} at epoch {self.progress.epoch}, '
               f'{self.progress.trained} batches of it trained')

  def batch_trained(self, update: bool) -> None:
    self.progress = self.progress._replace(trained=self.progress.trained + 1,
                                           updates=self.progress.updates + int(update))

  def after_report(self, update: bool) -> None:
    """Every ``checkpoint_every`` updates, a checkpoint."""
    if update and self.every is not None and self.progress.updates % self.every == 0:
      self.save()

  def test_starts(self) -> None:
    self._test_log_at_start = self.logs['test'].state()

  def epoch_done(self) -> None:
    self.progress, self._test_log_at_start = self.progress.next_epoch(), None
    self.save()

  def save(self) -> None:
    """A checkpoint of the trainer and of where the run stands (a test pass under way is run again)."""
    if self.checkpoint is None:
      return
    history = {phase: log.state() for phase, log in self.logs.items()}
    if self._test_log_at_start is not None:
      history['test'] = self._test_log_at_start
    save_or_warn(self.trainer, self.checkpoint, self.window, (self.progress, history))


def fit(trainer, parts: TrainerParts, train_data, test_data, num_epoch: int, num_report: int, reset_state: bool,
        shared_args, fun_after_report: Optional[Callable], batch_size, checkpoint=None, checkpoint_every=None) -> None:
  """:meth:`AccumBPTT.fit`: check the arguments, run (or resume) the epochs, keep the metrics as ``bp.BPTT``.

  ``trainer`` is read through its public attributes (and bp.BPTT's history, which the loop fills);
  everything else the loop calls comes in ``parts``.
  """
  check_fit_args(num_epoch, num_report, reset_state, fun_after_report, batch_size, shared_args)
  num_epoch, num_report = int(num_epoch), int(num_report)  # NumPy integers too
  checkpoint_every = check_checkpoint_args(checkpoint, checkpoint_every)
  check_data('train_data', train_data)
  if test_data is not None:
    check_data('test_data', test_data)
  shared_args = tools.DotDict({'fit': True, **(shared_args or {})})
  options = LoopOptions(num_report, reset_state, shared_args, fun_after_report, show_bars=trainer.progress_bar)
  run = Run(trainer, parts.window, None if checkpoint is None else os.fspath(checkpoint), checkpoint_every)
  run.resume()
  if not reset_state:  # every batch of a list continues the model state: all of its size, before any update
    check_carried_sizes(trainer.target, lambda x, y: parts.check_batch(x, y).batch_size, train_data=train_data,
                        test_data=test_data)
  logs = run.logs
  try:
    with parts.without_time_step_bars(), brainstate.environ.context(fit=True), deferred_signals() as stop:
      for epoch in range(run.progress.epoch, num_epoch):
        if not run.progress.trained_all:
          run_epoch(trainer, parts, 'fit', train_data, logs['fit'], epoch, options, run, stop)
          trainer.optimizer.lr.step_epoch()
          run.progress = run.progress._replace(trained_all=True)
        if test_data is not None:
          run.test_starts()
          run_epoch(trainer, parts, 'test', test_data, logs['test'], epoch, options, run, stop)
        run.epoch_done()
        stop.check()
  except (Interrupted, KeyboardInterrupt) as interruption:
    if not getattr(interruption, 'forced', False):  # a second Ctrl-C mid-step may have left a half-written step
      run.save()
    parts.keep_history(*logs['fit'].arrays(), *logs['test'].arrays())
    if not isinstance(interruption, Interrupted):
      raise
    act_on(interruption.signum)  # Ctrl-C: KeyboardInterrupt; SIGTERM: its previous handler (default: exit)
  finally:
    parts.keep_history(*logs['fit'].arrays(), *logs['test'].arrays())


def run_epoch(trainer, parts: TrainerParts, phase: str, data, log: PhaseLog, epoch: int, options: LoopOptions,
              run: Run, stop: StopRequest) -> None:
  """Run one pass of ``phase`` (``'fit'`` or ``'test'``) over ``data``; a resumed training pass skips the
  batches already trained and continues the report window it had open."""
  batches = data() if callable(data) else data
  skip = run.progress.trained if phase == 'fit' else 0
  bar = (tqdm(total=len(cast(Sized, batches)), initial=skip)
         if options.show_bars and hasattr(batches, '__len__') else None)
  window = steps_for_epoch(trainer.accumulate_steps, epoch) if phase == 'fit' else 1
  if skip == 0:
    log.start_epoch()
  checking: List[Callable[..., None]] = []  # the first-batch check, started beside the first step
  feed = Feed(itertools.islice(batches, skip, None), put=trainer.mesh is None)  # (the step places a mesh's shares)
  try:
    for position, (batch, last) in enumerate(feed, start=skip):
      inputs, targets = _pair(phase, position, batch)
      layout = parts.check_batch(inputs, targets)  # before anything changes
      _start_batch(trainer, parts, phase, position, layout.batch_size, options)
      early, start = _planned(trainer, parts, phase, options, inputs, targets, layout.batch_size)
      update = last or (position + 1) % window == 0
      chunk = trainer.stream_chunks.get(layout.batch_size)
      if chunk is None:
        loss, aux = _unstreamed(trainer, parts, phase, update, options, inputs, targets, layout.batch_size,
                                (early, start), checking, feed)
      else:
        loss, aux = _run_streamed(trainer, parts, phase, update, options, inputs, targets, layout, chunk,
                                  early or _started(start))
      log.record(loss, aux, _describe(trainer, layout.batch_size, window))
      _batch_done(trainer, log, run, bar, phase, update, options, checking)
      stop.check()
    _finish(checking)
    parts.wait_check()  # one started ahead and then not needed (a batch in one piece): no thread outlives fit
    if options.num_report <= 0:
      _emit(trainer, log, epoch, 'epoch', phase, bar, options.fun_after_report)
  except BaseException:
    _finish(checking)  # no thread of the check outlives fit; the step it accompanied ran: its warnings apply
    parts.wait_check()
    raise
  finally:
    if bar is not None:
      bar.close()


def _start_batch(trainer, parts: TrainerParts, phase: str, position: int, batch_size: int,
                 options: LoopOptions) -> None:
  """The model state a batch starts from: reset at its size (or, carried, checked to hold as many samples), and
  the Variables on the mesh."""
  if options.reset_state:
    trainer.target.reset(batch_size)
    trainer.reset_state()
  else:  # the model state this batch continues holds as many samples
    check_carried_batch(trainer.target, batch_size, f'{"train" if phase == "fit" else "test"}_data', position)
  parts.place_on_mesh(batch_size)  # the same placement every step: one compilation per batch shape


def _planned(trainer, parts: TrainerParts, phase: str, options: LoopOptions, inputs, targets, batch_size: int):
  """``num_micro_batch='auto'``: the batch size planned. Returns the first-batch check (once per trainer, changes
  nothing) as ``(early, start)``: ``early``, started before planning (it compiles beside the search), or
  ``start``, to start once the first step is dispatched; ``None`` where there is none."""
  if trainer.num_micro_batch != 'auto':
    return None, None
  early, start = None, parts.check_loss_once(options.shared_args, inputs, targets, True) if phase == 'fit' else None
  if start is not None and not parts.plan_cached(options.shared_args, inputs, targets):
    start, early = None, start()  # before planning: it compiles beside the search (a cached plan has none)
  with _finishing(early, report=False), _errors_of_the_whole_batch(parts, options.shared_args, inputs, targets):
    trainer.plan_memory(inputs, targets, options.shared_args)
  if batch_size not in trainer.stream_chunks and trainer.num_micro_batch_for(batch_size) == 1:
    if early is not None:  # one micro-batch: accumulation trains the whole batch's loss, nothing to warn
      early(report=False)  # about (a streamed batch's chunks are combined like micro-batches: its check stays)
    early = start = None
  return early, start


def _unstreamed(trainer, parts: TrainerParts, phase: str, update: bool, options: LoopOptions, inputs, targets,
                batch_size: int, check: tuple, checking: List[Callable[..., None]], feed: Feed):
  """One batch's step (not streamed); the first-batch check started beside it (``check``: ``(early, start)``
  of :func:`_planned`) goes to ``checking``. Its ``(loss, aux)``."""
  early, start = check
  if early is None and start is None and phase == 'fit':
    start = parts.check_loss_once(options.shared_args, inputs, targets)
  kind = _step_kind(trainer, phase, update)
  with _finishing(early), _closing(parts.window, kind == 'close' and not update):
    loss, aux = _run_step(trainer, parts, phase, kind, options, inputs, targets, batch_size)
  feed.dispatched(loss)  # the next batch on its way to the device while this step runs
  # the check not started yet is traced now, while the step runs (dispatched), compiled and run beside it and the
  # next; its warnings once the next is dispatched (or at a report, or the pass's end)
  _finish(checking)
  started = _started(start)
  if started is not None:
    checking.append(started)
  return loss, aux


def _batch_done(trainer, log: PhaseLog, run: Run, bar, phase: str, update: bool, options: LoopOptions,
                checking: List[Callable[..., None]]) -> None:
  """After a batch's step: where the run stands, the progress bar, a report every ``num_report`` batches (the
  first-batch check's warnings before it) and a checkpoint every ``checkpoint_every`` updates."""
  if phase == 'fit':
    run.batch_trained(update)
  if bar is not None:
    bar.update(1)
  if options.num_report > 0 and log.steps % options.num_report == 0:
    _finish(checking)  # its warnings before the report
    _emit(trainer, log, log.steps, 'steps', phase, bar, options.fun_after_report)
  if phase == 'fit':
    run.after_report(update)


def _started(start: Optional[Callable[[], Optional[Callable[..., None]]]]) -> Optional[Callable[..., None]]:
  """The first-batch check started now: its ``finish()``, or ``None``."""
  return None if start is None else start()


@contextlib.contextmanager
def _finishing(finish: Optional[Callable[..., None]], report: bool = True):
  """Around the first step: then ``finish()`` the first-batch check running beside it (its warnings); if the
  step raises, wait for the check without reporting it, so that no thread of it outlives ``fit``.
  ``report=False`` (around planning): only the wait on an error; the check goes on beside what follows."""
  try:
    yield
  except BaseException:
    if finish is not None:
      finish(report=False)
    raise
  if finish is not None and report:
    finish()


def _finish(checking: List[Callable[..., None]], report: bool = True) -> None:
  """Wait for the first-batch checks in ``checking`` and give their warnings (``report=False``: only wait);
  empties it."""
  while checking:
    checking.pop(0)(report=report)


@contextlib.contextmanager
def _errors_of_the_whole_batch(parts: TrainerParts, shared_args, inputs, targets):
  """Around what traces the model on micro-batches (planning, a step): if it raises, and the model or ``loss_fun``
  fails on the whole batch too (bp.BPTT's own loss function, traced for shapes only: nothing changes), raise
  that error instead, the one bp.BPTT gives: a mistake in the user's code or data then reads the same with
  either trainer, and is not blamed on a micro-batch (whose shapes can make it fail elsewhere, or misleadingly).
  Where the whole batch traces, the micro-batch's error is raised as it was."""
  try:
    yield
  except Exception as error:
    try:
      brainstate.transform.eval_shape(parts.whole_batch_loss, shared_args, inputs, targets)
    except Exception as whole:
      if type(whole) is type(error) and str(whole) == str(error):
        raise
      whole.add_note(f'(AccumBPTT: the model or loss_fun fails on the whole batch, as with bp.BPTT; on a '
                     f'micro-batch it failed with {type(error).__name__}: {str(error).splitlines()[0][:200]})')
      raise whole from None
    raise


def _pair(phase: str, position: int, batch) -> Tuple[Any, Any]:
  """``(inputs, targets)`` of one batch, or an error naming the data before anything runs."""
  if not isinstance(batch, (tuple, list)) or len(batch) != 2:
    name = 'train_data' if phase == 'fit' else 'test_data'
    what = f'{type(batch).__name__} of length {len(batch)}' if isinstance(batch, (tuple, list)) else type(batch).__name__
    raise ValueError(f'{name} gave a {what} as batch {position}: each batch must be a pair (inputs, targets).')
  return batch[0], batch[1]


def _step_kind(trainer, phase: str, update: bool, streamed: bool = False) -> str:
  """Which compiled step runs: ``'loss'`` (evaluation), ``'fit'`` (bp.BPTT's, or on a mesh the
  ``accumulate_steps`` window's update), ``'collect'`` (on a mesh: into the window, no update) or ``'close'``
  (every step through the window without a mesh, a streamed chunk's or an ``accumulate_steps`` batch's: the
  window's ``closes`` flag, set around it by :func:`_closing`, says whether it updates; one program for both)."""
  if phase != 'fit':
    return 'loss'
  if (streamed or trainer.accumulate_steps != 1) and trainer.mesh is None:
    return 'close'
  return 'fit' if update else 'collect'


def _run_step(trainer, parts: TrainerParts, phase: str, kind: str, options: LoopOptions, inputs, targets,
              batch_size: int):
  """Run one compiled step (again, cut finer, after running out of device memory); its ``(loss, aux)``."""
  with _errors_of_the_whole_batch(parts, options.shared_args, inputs, targets):
    result, compiles = run_with_retry(
      lambda: _call_step(parts.step(kind), options.shared_args, inputs, targets),
      lambda error: parts.replan_finer(batch_size, error, inputs, targets, options.shared_args))
  step_phase = 'fit' if phase == 'fit' else 'loss'
  if trainer.jit[step_phase]:  # without jit every operation compiles on its own: nothing to count
    parts.note_compilations(step_phase, compiles)
  return _split_result(trainer, phase, result)


def _run_streamed(trainer, parts: TrainerParts, phase: str, update: bool, options: LoopOptions, inputs, targets,
                  layout, chunk: int, early: Optional[Callable[..., None]] = None):
  """A batch streamed from the host (:mod:`~brainpy_accum.memory._stream`): each chunk's sums into the window, the last updates.

  ``early``: the first-batch check started before planning, reported after the first chunk's step.

  Each chunk starts from its samples' slice of the whole batch's model state (reset at the batch size, as
  ``bp.BPTT`` resets it, so random initial states are the same draws) and writes its final state back.
  """
  states = batched_variables(trainer.target, layout.batch_size)
  whole = {name: all_samples(name, var, axis, layout.batch_size) for name, (var, axis) in states.items()}
  # each chunk's final state, joined after the last: every chunk starts from a slice of the state as fit left
  # it (weakly typed after a reset, as bp.BPTT's step takes it), so every chunk's step is the same program
  finals: Dict[str, list] = {name: [] for name in states}
  sizes, results, weights = chunk_sizes(layout.batch_size, chunk), [], []
  starts = list(itertools.accumulate([0] + sizes[:-1]))
  # sliced when needed (NumPy slices are views; slices of device data are copies: one at a time)
  chunk_at = lambda i: (host_chunk(inputs, layout.input_axes, starts[i], sizes[i]),
                        host_chunk(targets, layout.target_axes, starts[i], sizes[i]))
  ahead, sent = Ahead(), None  # the next chunk on its way to the device while this one's step runs
  with declared_batch_axes(states.values()):
    for i, (start, size) in enumerate(zip(starts, sizes)):
      x, y = chunk_at(i)
      fed = sent or (x, y)
      for name, (var, axis) in states.items():
        var.value = jax.lax.dynamic_slice_in_dim(whole[name], start, size, axis=axis)  # one program for all starts
      parts.plan_chunk(x, y, options.shared_args)  # the shorter last chunk has its own plan
      finish = (early or _check_streamed(parts, options, inputs, targets, layout, x, y, size, states, whole)
                ) if phase == 'fit' and i == 0 else None
      last = update and i == len(sizes) - 1
      kind = _step_kind(trainer, phase, last, streamed=True)
      with _finishing(finish), _closing(parts.window, kind == 'close' and not last):
        results.append(_run_step(trainer, parts, phase, kind, options, *fed, size))
      ahead.dispatched(results[-1][0])
      sent = ahead.send(chunk_at(i + 1)) if i + 1 < len(sizes) else None
      # read as numbers with the results, at the end: reading one now would wait for the device
      weights.append(size if trainer.loss_weight_fn is None else trainer.loss_weight_fn(*fed))
      for name, (var, _) in states.items():
        finals[name].append(bm.as_jax(var.value))
    for name, (var, axis) in states.items():
      var.value = jnp.concatenate(finals[name], axis=axis)
  return combine(results, [float(w) for w in weights], trainer.grad_reduction, parts.metric_plan(), sizes)


@contextlib.contextmanager
def _closing(window, collect_only: bool):
  """Run a ``'close'`` step (a streamed chunk's, or an ``accumulate_steps`` batch's) without the update
  (``collect_only``): the window's ``closes`` flag, an argument of the step, is False inside and True again
  after."""
  if not collect_only:
    yield
    return
  window.closes.value = jnp.asarray(False)
  try:
    yield
  finally:
    window.closes.value = jnp.asarray(True)


def _check_streamed(parts: TrainerParts, options: LoopOptions, inputs, targets, layout, x, y, size: int,
                    states: dict, whole: dict):
  """The first-batch check of a streamed batch, on its first chunk ``x, y`` of ``size`` samples: the chunks
  combine like micro-batches, so samples the step trains in one piece are still checked cut in two. A chunk of
  one sample: the check takes the batch's first two samples (and their slice of the model ``states``, from
  ``whole``), which need no more memory than the check of a chunk of two; the chunk's states are put back."""
  if size >= 2:
    return _started(parts.check_loss_once(options.shared_args, x, y, streamed=True))
  with values_restored([var for var, _ in states.values()], any_shape=True):
    for name, (var, axis) in states.items():
      var.value = jax.lax.dynamic_slice_in_dim(whole[name], 0, 2, axis=axis)
    return _started(parts.check_loss_once(options.shared_args, host_chunk(inputs, layout.input_axes, 0, 2),
                                          host_chunk(targets, layout.target_axes, 0, 2), streamed=True))


def _call_step(step: Callable, shared_args, inputs, targets):
  """Run the compiled step for this batch; return its result and the XLA compilations it caused."""
  with count_compilations() as compiled:
    result = step(shared_args, inputs, targets)
  return result, compiled()


def _describe(trainer, batch_size: int, window: int) -> str:
  chunk = trainer.stream_chunks.get(batch_size)
  if chunk is None:
    text = trainer.describe_batch(batch_size)
  else:
    text = (f'batch {batch_size} streamed in {len(chunk_sizes(batch_size, chunk))} chunks of '
            f'{trainer.describe_batch(chunk).replace("batch ", "", 1)}')
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
