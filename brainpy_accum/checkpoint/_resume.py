"""Where a :meth:`fit` call stands, and stopping it cleanly on Ctrl-C or SIGTERM.

``fit(..., checkpoint=path, checkpoint_every=k)`` saves a :class:`Progress`
with each checkpoint, so that the same call run again (after a crash, a
killed job, a pre-empted node) skips what was already trained and goes on
from there. A signal that arrives while a batch's compiled step runs would
otherwise interrupt Python between the write-backs of its Variables;
:func:`deferred_signals` holds SIGINT and SIGTERM until the batch is done, so
:meth:`fit` stops at a batch boundary, writes a final checkpoint and only
then lets the signal act as it would have (Python's Ctrl-C handler raises
KeyboardInterrupt, SIGTERM by default ends the process, a handler installed
before :meth:`fit` runs; if that handler returns, so does :meth:`fit`). A
signal the process ignores stays ignored. A second Ctrl-C while one is
pending stops at once.
"""

import contextlib
import os
import signal
import threading
import warnings
from typing import Iterator, List, NamedTuple, Optional

from tqdm import tqdm

from ..core._cut import check_positive_int

__all__ = ['Run', 'Progress', 'Interrupted', 'StopRequest', 'deferred_signals', 'act_on', 'check_checkpoint_args']

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Progress(NamedTuple):
  """How far a :meth:`fit` call got: ``epoch`` is the epoch in progress (``num_epoch`` when done),
  ``trained`` the batches of its training pass already run, ``trained_all`` whether that pass (and the
  learning-rate epoch step after it) is complete, ``updates`` the optimizer updates of the call so far."""
  epoch: int = 0
  trained: int = 0
  trained_all: bool = False
  updates: int = 0

  def next_epoch(self) -> 'Progress':
    return Progress(self.epoch + 1, 0, False, self.updates)


class Interrupted(Exception):
  """Raised inside :meth:`fit` at the batch boundary after a deferred signal; carries the signal."""

  def __init__(self, signum: int):
    super().__init__(signal.Signals(signum).name)
    self.signum = signum


class StopRequest:
  """The signals received while deferred, in order."""

  def __init__(self):
    self.received: List[int] = []

  def check(self) -> None:
    """Raise :class:`Interrupted` if a signal arrived (called between batches)."""
    if self.received:
      raise Interrupted(self.received[0])


@contextlib.contextmanager
def deferred_signals() -> Iterator[StopRequest]:
  """Hold SIGINT and SIGTERM for the duration. A signal the process ignores stays ignored; outside the main
  thread (where Python cannot install handlers) nothing is deferred."""
  request = StopRequest()
  if threading.current_thread() is not threading.main_thread():
    yield request
    return
  previous = {signum: signal.getsignal(signum) for signum in _SIGNALS}
  held = [signum for signum in _SIGNALS if previous[signum] is not signal.SIG_IGN]

  def hold(signum, frame):
    if signum == signal.SIGINT and signal.SIGINT in request.received:
      signal.signal(signal.SIGINT, previous[signal.SIGINT])
      forced = KeyboardInterrupt('a second Ctrl-C: stopped at once, possibly inside a step')
      forced.forced = True  # fit writes no checkpoint then: the step may have been cut between write-backs
      raise forced
    request.received.append(signum)

  for signum in held:
    signal.signal(signum, hold)
  try:
    yield request
  finally:
    for signum in held:
      signal.signal(signum, previous[signum])


def act_on(signum: int) -> None:
  """Let a held signal do what it would have done, now that the handlers are restored: Python's Ctrl-C
  handler raises KeyboardInterrupt, SIGTERM's default ends the process, a handler of the user's runs."""
  signal.raise_signal(signum)


def check_checkpoint_args(checkpoint, checkpoint_every) -> Optional[int]:
  """``fit``'s checkpoint arguments; returns ``checkpoint_every`` (``None``: only at each epoch's end)."""
  if checkpoint is not None and not isinstance(checkpoint, (str, os.PathLike)):
    raise TypeError(f"checkpoint={checkpoint!r} must be a file path (str or os.PathLike), e.g. 'run.ckpt'.")
  if checkpoint_every is None:
    return None
  if checkpoint is None:
    raise ValueError(f'checkpoint_every={checkpoint_every!r} needs a checkpoint path: pass '
                     f"checkpoint='run.ckpt' as well.")
  return check_positive_int('checkpoint_every', checkpoint_every, 'It counts optimizer updates between checkpoints.')


class Run:
  """One :meth:`fit` call's progress, its phases' logs and its checkpoints.

  Parameters
  ----------
  files : RunFiles
    Where checkpoints are read and written (:class:`~brainpy_accum.checkpoint._save_load.RunFiles`).
  logs : dict
    ``{phase: log}`` of the phases' metric logs, each with ``state()`` and ``restore(state)``.
  checkpoint : str, optional
    The checkpoint's path (``None``: none).
  every : int, optional
    A checkpoint every this many optimizer updates too (else at every epoch's end).
  metrics : bool
    Whether the trainer's loss returns metrics (``loss_has_aux``): resuming a run that recorded other ones warns.
  """

  def __init__(self, files, logs: dict, checkpoint: Optional[str], every: Optional[int], metrics: bool = False):
    self.files, self.logs, self.checkpoint, self.every, self.metrics = files, logs, checkpoint, every, metrics
    self.progress = Progress()
    self._test_log_at_start: Optional[dict] = None  # the test log before the running test pass

  def resume(self) -> bool:
    """Continue from the checkpoint if one exists (a checkpoint saved by hand: its state, from epoch 0); whether
    one was loaded. A damaged one raises before anything changes."""
    if self.checkpoint is None or not os.path.exists(self.checkpoint):
      return False
    saved = self.files.load(self.checkpoint)
    if saved is not None:
      self.progress, history = saved
      for phase, log in self.logs.items():
        if phase in history:
          log.restore(history[phase])
      _warn_other_metrics(history.get('fit', {}), self.metrics, self.progress.trained or self.progress.epoch)
    tqdm.write(f'resuming from checkpoint={self.checkpoint!r} at epoch {self.progress.epoch}, '
               f'{self.progress.trained} batches of it trained')
    return True

  def batch_trained(self, update: bool) -> None:
    """A training batch is done (``update``: the optimizer updated)."""
    self.progress = self.progress._replace(trained=self.progress.trained + 1,
                                           updates=self.progress.updates + int(update))

  def after_report(self, update: bool) -> None:
    """Every ``every`` updates, a checkpoint (after the batch's report, which it then holds)."""
    if update and self.every is not None and self.progress.updates % self.every == 0:
      self.save()

  def trained_all(self) -> None:
    self.progress = self.progress._replace(trained_all=True)

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
    self.files.save(self.checkpoint, (self.progress, history))


def _warn_other_metrics(saved: dict, metrics: bool, trained: bool) -> None:
  """Resuming a run whose loss recorded metrics into a trainer whose loss returns none, or the reverse: the
  parameters continue exactly, but the metric histories would not line up with the loss's (warned, once)."""
  names = sorted({key.split('/', 1)[1] for key in saved  # (a report window not yet closed: only in 'window/')
                  if key.split('/', 1)[0] in ('detailed', 'report', 'window')} - {'loss'})
  if names and not metrics:
    warnings.warn(f"The checkpoint's run recorded the metrics {names}, which this trainer's loss does not return "
                  f'(loss_has_aux=False): their histories end at the checkpoint, shorter than the loss\'s. Resume '
                  f'with the loss_fun and loss_has_aux the run was saved with to keep them.', UserWarning, stacklevel=4)
  elif metrics and not names and trained:
    warnings.warn("The checkpoint's run recorded no metrics (its loss had none, as with loss_has_aux=False): any "
                  "metrics this trainer's loss returns start at the resume, so their histories are shorter than the "
                  "loss's.", UserWarning, stacklevel=4)
