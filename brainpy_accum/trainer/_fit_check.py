"""The first-batch check's life in one :meth:`fit` call: a :class:`PendingCheck` started once and finished once,
and :class:`FitCheck`, which says when, so that the fit loop holds one object and calls it at three places
(planning, a step, the end of a pass or a report), and where the check compiles and runs (:class:`CheckProgram`:
the host's CPU beside a TPU). What the check computes is
:mod:`~brainpy_accum.trainer._coupled_loss`'s.
"""

import contextlib
from typing import Callable, ContextManager, Optional

import jax

from ..core._written import host_callbacks_run
from ..diagnostics._compiles import QUICK_COMPILE, Compiling
from ..diagnostics._phases import phase as record_phase
from ..memory._budget import compiled_step_bytes
from ..memory._device import host_available_bytes
from ..memory._switch import DeviceSwitch

__all__ = ['NO_CHECK', 'CheckProgram', 'FitCheck', 'PendingCheck', 'before_first_step', 'check_device',
           'check_on_host', 'starts_before_first_step']

_BEFORE = DeviceSwitch(lambda: jax.default_backend() != 'cpu')  # before_first_step() sets it for the tests
_ON_HOST = DeviceSwitch(lambda: jax.default_backend() == 'tpu')  # check_on_host() sets it for the tests
# the most a first-batch check compiled for the host may take: this share of the memory the host (or its
# container) has available, and at most HOST_CHECK_BYTES, so that it stays quick on the host's cores and leaves
# room to other processes that check beside it; a larger check runs on the device, which refuses one too large for
# it with an error the check handles (its first samples instead)
HOST_SHARE, HOST_CHECK_BYTES = 0.25, 128 * 2 ** 20


def check_device() -> Optional[jax.Device]:
  """The device the first-batch check compiles and runs on: the host's CPU beside a TPU where JAX has a CPU
  backend (``JAX_PLATFORMS=tpu`` leaves none), else ``None`` (the default device). The check computes the loss
  alone, on random outputs of the model's shape, never the model: for a check of the size :class:`CheckProgram`
  allows there, the host compiles and runs it faster than the TPU compiles it (on the TPU v5e the check's
  compilation, 1.25 s, outlasted a client-sized run's first step, which waited for it; 2026-12-07), and its
  program takes none of the device's memory."""
  return jax.devices('cpu')[0] if _ON_HOST() and host_callbacks_run() else None


def check_on_host(enabled: Optional[bool]) -> ContextManager[None]:
  """Within the ``with``, the first-batch check runs on the host's CPU (``True``; on a CPU: for the tests) or on
  the default device (``False``); ``None``: by the device (:func:`check_device`).

  Examples
  --------
  >>> with check_on_host(True):
  ...   check_device().platform
  'cpu'
  """
  return _ON_HOST.set(enabled)


def starts_before_first_step() -> bool:
  """Whether a check made at the first step (a fixed plan's: no planner compiled that step) starts before it, so
  that the check compiles on its own thread while the step compiles on fit's: off the CPU, whose host has cores
  to spare while the device computes (on the chip, the start-up bench's fixed plan of 4 micro-batches waited
  1.67 s of a 4.13 s first epoch for a check started after its first step); not on a CPU, where XLA's
  compilation of the step already takes every core (two attempts there gained nothing)."""
  return _BEFORE()


def before_first_step(enabled: Optional[bool]) -> ContextManager[None]:
  """Within the ``with``, a check made at the first step starts before it (``True``, also on a CPU: for the tests)
  or after it (``False``); ``None``: by the device (:func:`starts_before_first_step`).

  Examples
  --------
  >>> with before_first_step(True):
  ...   starts_before_first_step()
  True
  """
  return _BEFORE.set(enabled)


class CheckProgram:
  """The first-batch check ``step`` (a ``bm.jit``) on the Variables' ``values`` and ``args``, lowered when made
  (its trace: an error in the loss raises there, on the caller's thread); :meth:`compile` compiles it.

  For ``device`` (:func:`check_device`, the host's CPU) with ``values`` copied there, where it is given, the batch's
  data (the last two of ``args``) are NumPy or on it, it compiles there and its program takes at most
  :data:`HOST_CHECK_BYTES` and :data:`HOST_SHARE` of the host's available memory
  (:func:`~brainpy_accum.memory._device.host_available_bytes`);
  else for the default device with ``values`` as they are: data on another device are not copied back, and a
  program too large for the host would have the system stop the process, where the device refuses it with an
  error that the check handles.
  """

  def __init__(self, device: Optional[jax.Device], step, values, *args):
    self._step, self._values, self._args, self._on_host = step, values, args, None
    if device is not None and all(not isinstance(x, jax.Array) or x.devices() == {device}
                                  for x in jax.tree_util.tree_leaves(args[-2:])):
      try:
        placed = jax.device_put(values, device)
        self._on_host = placed, step.jitted_fun.lower(placed, *args)
      except Exception:  # (what the host cannot take: the check stays on the device)
        pass
    self._lowered = step.jitted_fun.lower(values, *args) if self._on_host is None else None

  def compile(self) -> tuple:
    """``(compiled, values)``: the check compiled, and the values to call it with (see the class); called once."""
    on_host, self._on_host = self._on_host, None
    if on_host is not None:
      placed, lowered = on_host
      try:
        compiled = lowered.compile(compiler_options=QUICK_COMPILE)
        room, need = host_available_bytes(), compiled_step_bytes(compiled)
      except Exception:  # (say an operation the host's backend lacks: the device's compilation decides)
        room = None
      if room is not None and need <= min(HOST_CHECK_BYTES, HOST_SHARE * room):
        self._values = self._args = None  # (the device's values are not needed any more)
        return compiled, placed
    lowered = self._lowered or self._step.jitted_fun.lower(self._values, *self._args)
    return lowered.compile(compiler_options=QUICK_COMPILE), self._values


class PendingCheck:
  """The first-batch check of one fit: started once (:meth:`start`), finished once (:meth:`finish`), both safe to
  call again; :meth:`around_step` wraps the step it accompanies."""

  def __init__(self, owner, batch: tuple):
    self._owner, self._batch = owner, batch  # (shared_args, inputs, targets, plan)
    self._running = None  # its RunningCheck, once started
    self.started = self.finished = owner is None

  def start(self) -> None:
    """Trace the check and start it beside what runs now (without jit: run it now)."""
    if not self.started:
      self.started = True
      self._running = self._owner.run(*self._batch)

  def drop(self) -> None:
    """The batch trains whole, nothing to warn about: wait for the check without its report, and leave the
    trainer's check to the next batch that is cut (a batch in one piece says nothing of a cut's combination)."""
    self.finish(report=False, retry=False)
    self.started = self.finished = True
    if self._owner is not None:
      self._owner.checked = False

  def finish(self, report: bool = True, retry: bool = True) -> None:
    """Wait for the check and give its warnings (``report=False``: only wait); nothing if it never started.
    ``retry=False``: where the device could not hold the check, no check of fewer samples either."""
    if self.started and not self.finished:
      self.finished = True
      if self._running is not None:
        self._running.finish(report=report, retry=retry)

  @contextlib.contextmanager
  def around_step(self, report: bool = True):
    """Around the step the check accompanies: if the check started before it, finish it after it (its warnings,
    unless ``report=False``: then only on an error); if the step raises, wait for the check without its report,
    so that no thread of it outlives ``fit``."""
    try:
      yield
    except BaseException:
      self.finish(report=False, retry=False)
      raise
    if report:
      self.finish()


NO_CHECK = PendingCheck(None, ())  # nothing to check: every method does nothing


class FitCheck:
  """The first-batch check as one :meth:`fit` call meets it: at most one :class:`PendingCheck`, started beside
  the planner's search (:meth:`planning`) or once the first step is dispatched (:meth:`stepping`), finished after
  the step it accompanies, at a report or at the pass's end (:meth:`finish`).

  Parameters
  ----------
  owner : FirstBatchCheck
    The trainer's check (once per trainer: later calls find nothing to check).
  shared_args : dict
    The shared arguments of the fit's steps.
  """

  def __init__(self, owner, shared_args):
    self.owner, self.shared_args, self.pending = owner, shared_args, NO_CHECK
    self.planner_ran = False  # (a planner compiles the step that fit then runs)
    self._for_planned = False  # whether the pending check was made for the batch being planned

  @contextlib.contextmanager
  def planning(self, phase: str, inputs, targets, later: bool):
    """Around planning a batch: in training, the check cut in two starts beside the search (``later``: it waits for
    the first step, as where the plan is cached); if planning raises, it is waited for without its report."""
    self.planner_ran = True
    self._for_planned = phase == 'fit' and self.pending is NO_CHECK
    if self._for_planned:
      self.pending = self.owner.pending(self.shared_args, inputs, targets, before_planning=True)
      if not later:
        self.pending.start()
    with self.pending.around_step(report=False):
      yield

  def planned(self, one_piece: bool, streamed: bool) -> None:
    """After planning: a batch in one micro-batch trains the whole batch's loss, nothing to warn about (its check,
    made before planning, is dropped, started or not, and the next batch that is cut is checked instead; an
    earlier batch's check still running is finished after this batch's step, with its report); a streamed batch's
    check, made before planning and not started (a cached plan), starts now, while the model holds the whole
    batch's state (its first piece's is set next)."""
    if one_piece and self._for_planned:
      self.pending.drop()
      self.pending = NO_CHECK
    elif streamed:
      self.pending.start()

  @contextlib.contextmanager
  def stepping(self, phase: str, batch: tuple, piece: Optional[ContextManager] = None,
               compiling: Optional[Callable[[], Optional[Compiling]]] = None):
    """Around a training step on ``batch`` (``(inputs, targets)``; and whatever the loop dispatches with it): a
    check not pending yet is made for this batch and, for the first piece of a streamed batch (``piece``: the
    context its check is made in, the model state of ``batch``; ``contextlib.nullcontext()`` where it is the
    piece's own) or off the CPU where no planner compiled the step (:func:`starts_before_first_step`), started
    before it; after the step, one started before gives its warnings, else it is traced now, beside the step just
    dispatched. If the step raises, the check is waited for without its report. ``compiling()``, given, traces the
    step and starts its compilation on another thread (or returns ``None``): where the check starts before the
    step, that comes first, so that the check is traced while XLA compiles the step (on the TPU v5e the check's
    trace held a fixed plan's first step for 0.67 s of a 2.95 s first fit, 2026-12-07)."""
    if phase != 'fit':
      yield
      return
    streamed = piece is not None
    if self.pending is NO_CHECK:
      with piece or contextlib.nullcontext():
        self.pending = self.owner.pending(self.shared_args, *batch, streamed=streamed)
        if streamed or (starts_before_first_step() and not self.planner_ran):  # the step compiles at its call
          ahead = compiling() if compiling is not None and not streamed and not self.pending.started else None
          try:
            self.pending.start()
          finally:  # (no thread outlives fit)
            if ahead is not None:
              with record_phase('step compile'):
                ahead.wait()
    if streamed:
      self.pending.start()
    with self.pending.around_step(report=False):
      yield
    self.pending.finish()
    self.pending.start()

  def finish(self, report: bool = True) -> None:
    """Wait for the check and give its warnings (``report=False``: only wait)."""
    self.pending.finish(report=report)
