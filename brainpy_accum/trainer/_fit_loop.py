"""The epochs of :meth:`AccumBPTT.fit`: one :class:`FitLoop` for each call.

bp.BPTT's loop is one straight path, ``for x, y: reset; f_train(shared_args, x, y); record; report``, and so is
this one: for each batch of a :class:`~brainpy_accum.trainer._pass.Pass`, start it (reset), plan it
(``num_micro_batch='auto'``), step it (whole, or streamed in pieces, each piece sent to the device while the one
before computes), record, report. It records what :class:`brainpy.BPTT` records (per-batch losses and metrics,
report-window means) and adds to each report line how the batch was cut, how many batches make one update and,
with ``skip_nonfinite``, how many were skipped. With a ``checkpoint`` path it saves where the run stands
(:class:`~brainpy_accum.checkpoint._resume.Run`) and, run again, resumes from there.

The loop sees the trainer only through a :class:`LoopView`: its parts (planner, compiled steps, window, the
first-batch check) and the few trainer methods it calls (:class:`TrainerHooks`), never the trainer itself.
"""

import contextlib
from typing import Any, Callable, ContextManager, Dict, NamedTuple, Optional, Tuple

import brainstate.environ
import brainstate.transform
import jax.numpy as jnp

from ..checkpoint._resume import Interrupted, Run, StopRequest, act_on, deferred_signals
from ..diagnostics._compiles import count_compilations
from ..diagnostics._phases import phase
from ..memory._oom import run_with_retry
from ..memory._stream import StreamedStates, chunk_sizes, combine_later, host_pieces
from ._arguments import check_carried_batch, check_listed_batches
from ._compiled_steps import LOSS_KINDS
from ._fit_check import FitCheck
from ._feed import Sender
from ._pass import Batch, Pass, PhaseLog
from ._window import steps_for_epoch

__all__ = ['FitLoop', 'LoopOptions', 'LoopSettings', 'LoopView', 'TrainerHooks']


class LoopSettings(NamedTuple):
  """The trainer's options the loop reads."""
  accumulate_steps: Any      # int or {epoch: k}
  auto: bool                 # num_micro_batch='auto'
  on_mesh: bool
  loss_has_aux: bool
  loss_weight_fn: Optional[Callable]
  grad_reduction: str
  skip_nonfinite: bool
  jit: Dict[str, bool]       # bp.BPTT's jit, by phase
  show_bars: bool            # progress_bar


class TrainerHooks(NamedTuple):
  """The trainer's methods the loop calls."""
  check_batch: Callable[[Any, Any], Any]         # (inputs, targets) -> BatchLayout; raises before anything changes
  reset_state: Callable[[], None]                # bp.BPTT's reset_state, after the model's reset at a batch's size
  place_on_mesh: Callable[[int], None]           # (batch_size): the Variables on the mesh (nothing without one)
  plan: Callable[..., Any]                       # (inputs, targets, shared_args): plan_memory ('auto')
  replan_finer: Callable[..., str]               # (batch_size, error, inputs, targets, shared_args), out of memory
  quiet: Callable[[], ContextManager]            # tracing without per-time-step progress bars
  bptt_loss: Callable[..., Any]                  # (shared_args, inputs, targets): bp.BPTT's loss of the whole batch
  keep_history: Callable[..., None]              # (report, detailed train metrics, report, detailed test metrics)
  files: Any                                     # RunFiles: the checkpoints of a run


class LoopView(NamedTuple):
  """The trainer as the fit loop sees it: its parts, options and hooks, named once."""
  target: Any           # the model
  optimizer: Any        # its learning rate steps once an epoch
  planner: Any          # Planner: plans, streamed chunks, descriptions, the budget
  steps: Any            # CompiledSteps: the step of each kind, how metrics combine
  window: Any           # GradWindow (accumulate_steps, streamed batches) or None
  check: Any            # FirstBatchCheck: the first batch's pending check
  compilations: Any     # Compilations: counts of the steps' compilations
  skipped_steps: Any    # Variable: updates skipped as non-finite
  settings: LoopSettings
  hooks: TrainerHooks


class LoopOptions(NamedTuple):
  """The :meth:`fit` arguments every pass needs (checked)."""
  num_report: int
  reset_state: bool
  shared_args: Any
  fun_after_report: Optional[Callable]
  checkpoint: Optional[str] = None
  checkpoint_every: Optional[int] = None


class FitLoop:
  """One :meth:`fit` call: its run and checkpoints, its logs, and the first-batch check it holds."""

  def __init__(self, view: LoopView, options: LoopOptions):
    self.view, self.options = view, options
    self.logs = {'fit': PhaseLog('Train'), 'test': PhaseLog('Test')}
    self.run = Run(view.hooks.files, self.logs, options.checkpoint, options.checkpoint_every,
                   metrics=view.settings.loss_has_aux)
    self.check = FitCheck(view.check, options.shared_args)  # the first-batch check
    self._budget_checked, self._layout = False, None  # once a fit: the device's room; the batch in hand's layout

  def fit(self, train_data, test_data, num_epoch: int) -> None:
    """Run (or resume) the epochs; the metric history where bp.BPTT keeps it, also when interrupted."""
    if not check_listed_batches(self.view.target, self._batch_size, not self.options.reset_state,
                                self.view.settings.on_mesh, self.run.resume,  # (it resumes between its checks)
                                train_data=train_data, test_data=test_data) and self.view.window is not None:
      self.view.window.clear()  # (nothing resumed: a checkpoint loaded holds the run's window)
    try:
      with self.view.hooks.quiet(), brainstate.environ.context(fit=True), deferred_signals() as stop:
        for epoch in range(self.run.progress.epoch, num_epoch):
          if not self.run.progress.trained_all:
            self._pass(Pass('fit', train_data, self.logs['fit'], self.run.progress.trained,
                            steps_for_epoch(self.view.settings.accumulate_steps, epoch)), epoch, stop)
            self.view.optimizer.lr.step_epoch()
            self.run.trained_all()
          if test_data is not None:
            self.run.test_starts()
            self._pass(Pass('test', test_data, self.logs['test']), epoch, stop)
          self.run.epoch_done()
          stop.check()
    except (Interrupted, KeyboardInterrupt) as interruption:
      if not getattr(interruption, 'forced', False):  # a second Ctrl-C mid-step may have left a half-written step
        self.run.save()
      self._keep_history()
      if not isinstance(interruption, Interrupted):
        raise
      act_on(interruption.signum)  # Ctrl-C: KeyboardInterrupt; SIGTERM: its previous handler (default: exit)
    finally:
      self._keep_history()
      self.view.steps.report_writes()  # (the losses were read: the steps that wrote the flags are done)

  def _batch_size(self, inputs, targets) -> int:
    return self.view.hooks.check_batch(inputs, targets).batch_size

  def _keep_history(self) -> None:
    self.view.hooks.keep_history(*self.logs['fit'].arrays(), *self.logs['test'].arrays())

  def _pass(self, one: Pass, epoch: int, stop: StopRequest) -> None:
    """One pass: each batch started, planned, stepped, recorded and reported."""
    one.start(self.view.settings.show_bars, Sender(enabled=not self.view.settings.on_mesh), self._pieces)
    try:
      for batch in one.batches(self.view.hooks.check_batch, stop):
        self._start(one, batch)
        streamed = self.view.planner.is_streamed(batch.size, batch.on_device)
        loss, aux = self._streamed(one, batch) if streamed else self._whole(one, batch)
        one.log.record(loss, aux, self._describe(batch.size, one.every, streamed))
        self._done(one, batch)
        stop.check()
      self.check.finish()
      if self.options.num_report <= 0:
        self._report(one, epoch, 'epoch')
    except BaseException:
      self.check.finish()  # no thread of the check outlives fit; the step it accompanied ran: its warnings apply
      raise
    finally:
      one.close()

  def _start(self, one: Pass, batch: Batch) -> None:
    """The model state a batch starts from (reset at its size, or, carried, checked to hold as many samples), the
    Variables on the mesh, and with ``num_micro_batch='auto'`` its plan."""
    self._layout = batch.layout
    if self.options.reset_state:
      self.view.target.reset(batch.size)
      self.view.hooks.reset_state()
    else:
      check_carried_batch(self.view.target, batch.size, f'{"train" if one.phase == "fit" else "test"}_data',
                          batch.position)
    self.view.hooks.place_on_mesh(batch.size)  # the same placement every step: one compilation per batch shape
    if self.view.settings.auto:
      self._plan(one, batch)

  def _plan(self, one: Pass, batch: Batch) -> None:
    """``num_micro_batch='auto'``: the batch size planned, the first-batch check started beside the planner's
    quick probes (where it has some) and dropped where the batch runs in one piece."""
    planner, shared_args = self.view.planner, self.options.shared_args
    if not self._budget_checked:
      self._budget_checked = True
      if planner.recheck_budget(batch.inputs, batch.targets):  # the plans it dropped: their steps trace again
        self.view.steps.rebuild()
    later = not planner.probes_first(shared_args, batch.inputs, batch.targets)
    with phase('planning (other)'), self.check.planning(one.phase, batch.inputs, batch.targets, later), \
         self._errors_of_the_whole_batch(batch):
      self.view.hooks.plan(batch.inputs, batch.targets, shared_args)
    streamed = planner.is_streamed(batch.size, batch.on_device)
    self.check.planned(not streamed and planner.plan_for(batch.size).num_micro_batches == 1, streamed)

  def _whole(self, one: Pass, batch: Batch) -> Tuple[Any, dict]:
    """One batch's step, in one piece (cut into micro-batches inside it)."""
    kind, data = self._kind(one.phase, update := one.updates(batch)), one.feed.for_step(batch.data)
    with self.check.stepping(one.phase, data,
                             compiling=lambda: self.view.steps.compiling(kind, self.options.shared_args, *data)), \
         self._closing(kind == 'close' and not update):
      loss, aux = self._step(kind, data, batch.size, batch)
      one.feed.dispatched(loss)  # the next batch on its way to the device while this step runs
    return loss, aux

  def _streamed(self, one: Pass, batch: Batch) -> Tuple[Any, dict]:
    """A batch streamed in pieces (:mod:`~brainpy_accum.memory._stream`): each piece's sums into the window,
    the last updates; each piece starts from its samples' slice of the whole batch's model state."""
    states = StreamedStates.of(self.view.target, batch.size)
    pieces, results, weights = self._pieces(batch.inputs, batch.targets), [], []
    update, weigh = one.updates(batch), self.view.settings.loss_weight_fn
    with states.declared():
      statistics = self._statistics_of_pieces(batch, pieces, states) is not None
      for i, (start, size, piece) in enumerate(pieces):
        host = piece()  # (NumPy views: nothing copied)
        data = one.feed.for_step(batch.sent.pop(i, None) or host, i)
        states.enter(start, size)
        # the shorter last has its own plan, made on the host data, with the next piece sent beside it counted
        self.view.planner.plan_chunk(*host, self.options.shared_args)
        last = update and i == len(pieces) - 1
        kind = self._kind(one.phase, last, streamed=True, statistics=statistics)
        first = i == 0 and one.phase == 'fit'
        with self._checked_piece(batch, data, size, states) if first else contextlib.nullcontext(), \
             self._closing(kind in ('close', 'piece') and not last):
          results.append(self._step(kind, data, size, batch))
        one.feed.dispatched(results[-1][0], i, len(pieces))  # the next piece (or batch) on its way
        weights.append(size if weigh is None else weigh(*data))  # read with the results, when reported
        states.leave(put_back=one.phase != 'fit' and i < len(pieces) - 1)
    states.join()
    return combine_later(results, weights, self.view.settings.grad_reduction, self.view.steps.metric_rules,
                         chunk_sizes(batch.size, self.view.planner.stream_chunks[batch.size]))

  def _statistics_of_pieces(self, batch: Batch, pieces: list, states: StreamedStates):
    """Where ``loss_fun`` marks batch statistics, their pass over every piece of a streamed batch before the
    pieces' steps read the whole batch's (:class:`~brainpy_accum.memory._stream.StreamedStatistics`, returned;
    else ``None``): each piece forward, its model state put back, drawing the random numbers its step will
    draw (the keys put back after), its data sent to the device a first time."""
    shared_args, steps = self.options.shared_args, self.view.steps
    store = steps.statistics_of_chunks(shared_args, pieces, states.enter)
    with steps.random_keys_put_back() if store else contextlib.nullcontext():
      for i, (start, size, piece) in enumerate(pieces if store else ()):
        host = piece()
        states.enter(start, size)
        self.view.planner.plan_chunk(*host, shared_args)
        found, compiles = _call_step(steps.step('statistics'), shared_args, *batch.sent.get(i, host))
        store.add(found, first=i == 0)
        self.view.compilations.note('fit', compiles)
    return store

  def _pieces(self, inputs, targets) -> Optional[list]:
    """The pieces of a batch like the one in hand (:func:`~brainpy_accum.memory._stream.host_pieces`), or
    ``None`` where it runs whole."""
    chunk = self.view.planner.stream_chunks.get(self._layout.batch_size)
    return None if chunk is None else host_pieces(inputs, targets, self._layout, chunk)

  def _checked_piece(self, batch: Batch, data: tuple, size: int, states: StreamedStates):
    """The first-batch check of a streamed batch, around its first piece's step (``data``, ``size`` samples):
    the pieces combine like micro-batches, so samples the step trains in one piece are still checked cut in two.
    A piece of one sample: the check takes the batch's first two samples (and their model state)."""
    if size >= 2:
      return self.check.stepping('fit', data, piece=contextlib.nullcontext())
    first_two = host_pieces(batch.inputs, batch.targets, batch.layout, 2)[0][2]()
    return self.check.stepping('fit', first_two, piece=states.first_samples(2))

  def _step(self, kind: str, data: tuple, size: int, batch: Batch) -> Tuple[Any, dict]:
    """Run one compiled step on ``data`` (``size`` samples of ``batch``; again, cut finer, after running out of
    device memory); its ``(loss, aux)``."""
    shared_args, phase = self.options.shared_args, 'loss' if kind in LOSS_KINDS else 'fit'
    with self._errors_of_the_whole_batch(batch):
      result, compiles = run_with_retry(
        lambda: _call_step(self.view.steps.step(kind), shared_args, *data),
        lambda error: self.view.hooks.replan_finer(size, error, *data, shared_args))
    if self.view.settings.jit[phase]:  # without jit every operation compiles on its own: nothing to count
      self.view.compilations.note(phase, compiles)
    if kind in LOSS_KINDS:
      return result if self.view.settings.loss_has_aux else (result, {})
    return result[0], (result[1] if self.view.settings.loss_has_aux else {})

  def _kind(self, phase: str, update: bool, streamed: bool = False, statistics: bool = False) -> str:
    """Which compiled step runs: ``'loss'`` (evaluation), ``'fit'`` (bp.BPTT's, or on a mesh the
    ``accumulate_steps`` window's update), ``'collect'`` (on a mesh: into the window, no update), ``'close'``
    (through the window without a mesh, a streamed piece's or an ``accumulate_steps`` batch's: its ``closes``
    flag, set by :meth:`_closing`, says whether it updates), and a streamed piece's that reads the whole batch's
    ``statistics``: ``'piece'`` (``'close'``'s) and ``'piece-loss'``."""
    if statistics:
      return 'piece' if phase == 'fit' else 'piece-loss'
    if phase != 'fit':
      return 'loss'
    if (streamed or self.view.settings.accumulate_steps != 1) and not self.view.settings.on_mesh:
      return 'close'
    return 'fit' if update else 'collect'

  @contextlib.contextmanager
  def _closing(self, collect_only: bool):
    """Run a ``'close'`` (``'piece'``) step without the update (``collect_only``): the window's ``closes`` flag,
    an argument of the step, is False inside and True again after."""
    if not collect_only:
      yield
      return
    self.view.window.closes.value = jnp.asarray(False)
    try:
      yield
    finally:
      self.view.window.closes.value = jnp.asarray(True)

  @contextlib.contextmanager
  def _errors_of_the_whole_batch(self, batch: Batch):
    """Around what traces the model on micro-batches (planning, a step): if it raises, and the model or
    ``loss_fun`` fails on the whole batch too (bp.BPTT's own loss function, traced for shapes only: nothing
    changes), raise that error instead, the one bp.BPTT gives: a mistake in the user's code or data then reads the
    same with either trainer, and is not blamed on a micro-batch. Where the whole batch traces, the micro-batch's
    error is raised as it was."""
    try:
      yield
    except Exception as error:
      try:
        brainstate.transform.eval_shape(self.view.hooks.bptt_loss, self.options.shared_args, batch.inputs,
                                        batch.targets)
      except Exception as whole:
        if type(whole) is type(error) and str(whole) == str(error):
          raise
        whole.add_note(f'(AccumBPTT: the model or loss_fun fails on the whole batch, as with bp.BPTT; on a '
                       f'micro-batch it failed with {type(error).__name__}: {str(error).splitlines()[0][:200]})')
        raise whole from None
      raise

  def _done(self, one: Pass, batch: Batch) -> None:
    """After a batch's step: where the run stands, the progress bar, a report every ``num_report`` batches (the
    first-batch check's warnings before it) and a checkpoint every ``checkpoint_every`` updates."""
    update = one.updates(batch)
    if one.phase == 'fit':
      self.run.batch_trained(update)
    one.show()
    if self.options.num_report > 0 and one.log.steps % self.options.num_report == 0:
      self.check.finish()
      self._report(one, one.log.steps, 'steps')
    if one.phase == 'fit':
      self.run.after_report(update)

  def _report(self, one: Pass, idx: int, unit: str) -> None:
    skipped = self.view.settings.skip_nonfinite and one.phase == 'fit'
    line, means = one.log.close_window(
      idx, unit, f', skipped {int(self.view.skipped_steps.value)} non-finite' if skipped else '')
    self.view.steps.report_writes()  # read with the losses: the states whose writes the steps found apart
    one.show(line)
    if self.options.fun_after_report is not None:
      self.options.fun_after_report(idx, means, one.phase)

  def _describe(self, batch_size: int, every: int, streamed: bool) -> str:
    chunk, planner = self.view.planner.stream_chunks.get(batch_size), self.view.planner
    if not streamed:
      text = planner.describe(batch_size)
    else:
      text = (f'batch {batch_size} streamed in {len(chunk_sizes(batch_size, chunk))} chunks of '
              f'{planner.describe(chunk).replace("batch ", "", 1)}')
    return text + (f', {every} batches per update' if every > 1 else '')


def _call_step(step: Callable, shared_args, inputs, targets):
  """Run the compiled step for this batch; return its result and the XLA compilations it caused."""
  with count_compilations() as compiled:
    result = step(shared_args, inputs, targets)
  return result, compiled()
