"""One pass of :meth:`AccumBPTT.fit` over a phase's data (:class:`Pass`), and each phase's losses and metrics
as :class:`brainpy.BPTT` keeps them (:class:`PhaseLog`)."""

import itertools
import time
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sized, cast

import jax
import numpy as np
from tqdm import tqdm

from ._feed import Feed, Sender, holds_batches

__all__ = ['Batch', 'Pass', 'PhaseLog']


class Batch(NamedTuple):
  """One batch as the loop steps it: its ``position`` in the pass, its ``inputs`` and ``targets`` (as the data
  gave them), their ``layout`` (:class:`~brainpy_accum.core._batch.BatchLayout`), whether it is the pass's
  ``last`` (known where the pass updates every ``every`` > 1 batches, which reads one batch ahead; else
  ``False``), and the copies of its units sent ahead (``sent``: unit index -> device data; ``None``: whole)."""
  position: int
  inputs: Any
  targets: Any
  layout: Any
  last: bool
  sent: dict

  @property
  def size(self) -> int:
    return self.layout.batch_size

  @property
  def on_device(self) -> bool:
    """Whether every leaf of the batch is on a device already (JAX arrays: nothing to copy)."""
    return all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves((self.inputs, self.targets)))

  @property
  def data(self) -> tuple:
    """``(inputs, targets)`` for the step: the copy sent ahead, else as the data gave them."""
    sent = self.sent.get(None)
    return (self.inputs, self.targets) if sent is None else sent


class Pass:
  """One pass of a phase (``'fit'`` or ``'test'``) over its data: its log, progress bar, feed and batches per
  update.

  Parameters
  ----------
  phase : str
    ``'fit'`` (training) or ``'test'``.
  data : iterable or callable
    The batches, or a function returning them.
  log : PhaseLog
    The phase's log (a resumed pass continues the report window it had open).
  skip : int
    Batches already trained (a resumed pass skips them).
  every : int
    Batches per optimizer update (``accumulate_steps`` of this epoch; 1 for a test pass).
  """

  def __init__(self, phase: str, data, log: 'PhaseLog', skip: int = 0, every: int = 1):
    self.phase, self.log, self.skip, self.every = phase, log, skip, every
    self._batches = data() if callable(data) else data
    self.bar: Optional[tqdm] = None
    self.feed: Optional[Feed] = None
    if skip == 0:
      log.start_epoch()

  def start(self, show_bar: bool, sender: Sender, units: Callable[[Any, Any], Optional[list]]) -> None:
    """Open the progress bar (for data with a length) and the feed."""
    if show_bar and hasattr(self._batches, '__len__'):
      self.bar = tqdm(total=len(cast(Sized, self._batches)), initial=self.skip)
    self.feed = Feed(itertools.islice(self._batches, self.skip, None), sender, units, ahead=self.every > 1,
                     refills=not holds_batches(self._batches))  # (a source that may refill its arrays)

  def batches(self, check_batch: Callable[[Any, Any], Any], stop=None) -> Iterator[Batch]:
    """The pass's batches, each checked (``check_batch(inputs, targets) -> layout``, which raises before
    anything changes). ``stop``: a :class:`~brainpy_accum.checkpoint._resume.StopRequest` checked as each batch is
    read: a signal that came while the source made it stops before it trains (``bp.BPTT``'s Ctrl-C comes out of
    the source), the batch to be read again on resuming."""
    for position, fed in enumerate(self.feed, start=self.skip):
      if stop is not None:
        stop.check()
      inputs, targets = _pair(self.phase, position, fed.batch)
      yield Batch(position, inputs, targets, check_batch(inputs, targets), fed.last, fed.sent)

  def updates(self, batch: Batch) -> bool:
    """Whether the optimizer updates after ``batch``: every ``every`` batches, and at the pass's last."""
    return batch.last or (batch.position + 1) % self.every == 0

  def show(self, line: Optional[str] = None) -> None:
    """A batch done (``line``: a report, on the bar or printed)."""
    if line is None:
      if self.bar is not None:
        self.bar.update(1)
    elif self.bar is not None:
      self.bar.set_description(line, refresh=True)
    else:
      print(line)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.close()


def _pair(phase: str, position: int, batch) -> tuple:
  """``(inputs, targets)`` of one batch, or an error naming the data before anything runs (an array of two rows
  is a pair already: :func:`~brainpy_accum.trainer._feed.as_pair`); targets (or inputs) given as a Python list of
  numbers, which micro-batches cannot cut, are refused naming ``np.asarray``."""
  name = 'train_data' if phase == 'fit' else 'test_data'
  if not isinstance(batch, (tuple, list)) or len(batch) != 2:
    what = f'{type(batch).__name__} of length {len(batch)}' if isinstance(batch, (tuple, list)) else type(batch).__name__
    raise ValueError(f'{name} gave a {what} as batch {position}: each batch must be a pair (inputs, targets).')
  for part, value in zip(('inputs', 'targets'), batch):
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (int, float, np.number)) for v in value):
      raise ValueError(f'{name} gave {part} as a Python {type(value).__name__} of {len(value)} numbers in batch '
                       f'{position}: micro-batches cut arrays, not lists. Give them as an array, e.g. '
                       f'np.asarray({part}).')
  return batch[0], batch[1]


class PhaseLog:
  """Collects one phase's per-batch metrics and turns them into report lines.

  ``detailed`` keeps every batch's value, ``report`` the mean over each
  report window; both become the arrays behind
  :meth:`brainpy.BPTT.get_hist_metric`.

  A per-sample metric of batches of different sizes (a shorter last batch),
  where ``bp.BPTT`` fails at the end of the epoch (NumPy cannot stack its
  values), is kept too: its report is the mean over every sample of the window,
  as ``bp.BPTT``'s is for batches of one size, and its detailed history an
  object array of the per-batch arrays.
  """

  def __init__(self, title: str):
    self.title = title
    self.steps = 0
    self.window: Dict[str, List] = {'loss': []}
    self.report: Dict[str, List] = {}
    self.detailed: Dict[str, List] = {}
    self.plan_text = ''
    self.started = time.time()

  def start_epoch(self) -> None:
    """Open a fresh report window, as :class:`brainpy.BPTT` does at every epoch.

    With ``num_report > 0`` the batches after an epoch's last report are never
    reported (nor kept in the detailed history): BrainPy drops them, so do we.
    """
    self.window = {'loss': []}
    self.plan_text = ''

  def record(self, loss, aux: dict, plan_text: str) -> None:
    """Keep one batch's loss and auxiliary metrics."""
    self.window['loss'].append(loss)
    for key, value in aux.items():
      self.window.setdefault(key, []).append(value)
    if not self.plan_text:
      self.plan_text = plan_text
    self.steps += 1

  def close_window(self, idx: int, unit: str, extra: str = ''):
    """Average the window, store it, and return ``(line, means)``; ``extra`` is appended to the plan text."""
    means = {}
    for key, values in self.window.items():
      # One host array per window instead of one device array per batch: long runs stay flat in memory.
      values_np = [np.asarray(v) for v in values]
      means[key] = _mean_of_all(values_np)
      self.report.setdefault(key, []).append(means[key])
      self.detailed.setdefault(key, []).extend(_stacked(values_np))
      values.clear()
    elapsed = time.time() - self.started
    metrics = ', '.join(f'{k} {v}' for k, v in means.items())
    line = f'{self.title} {idx} {unit}, use {elapsed:.4f} s, {metrics} ({self.plan_text}{extra})'
    self.plan_text = ''
    self.started = time.time()
    return line, means

  def state(self) -> dict:
    """Everything :meth:`restore` needs to continue this log in another process (host arrays, for checkpoints).

    Per-batch arrays of different shapes are stored end to end, with their shapes under ``'shapes/...'``.
    """
    state = {'steps': np.asarray(self.steps)}
    for part in ('window', 'report', 'detailed'):
      for key, values in getattr(self, part).items():
        values = [np.asarray(v) for v in values]
        if _same_shapes(values):
          state[f'{part}/{key}'] = np.stack(values) if values else np.zeros((0,), np.float32)
        else:
          state[f'{part}/{key}'] = np.concatenate([v.ravel() for v in values])
          state[f'shapes/{part}/{key}'] = _shapes_table(values)
    return state

  def restore(self, state: dict) -> None:
    """Continue from :meth:`state`'s result; the report window is the one that was open."""
    self.steps = int(state['steps'])
    self.window, self.report, self.detailed = {'loss': []}, {}, {}
    for name, values in state.items():
      if name == 'steps' or name.startswith('shapes/'):
        continue
      part, key = name.split('/', 1)
      shapes = state.get(f'shapes/{name}')
      getattr(self, part)[key] = (list(np.asarray(values)) if shapes is None
                                  else _split_by_shapes(np.asarray(values), np.asarray(shapes)))

  def arrays(self):
    """``(report, detailed)`` as dicts of NumPy arrays (per-batch arrays of different shapes: an object array)."""
    return ({k: np.asarray(v) for k, v in self.report.items()},
            {k: _stacked(v) for k, v in self.detailed.items()})


def _same_shapes(values: List[np.ndarray]) -> bool:
  return len({v.shape for v in values}) <= 1


def _mean_of_all(values: List[np.ndarray]):
  """The mean over every element of every batch's value: ``np.mean`` of their stack where they stack."""
  if _same_shapes(values):
    return np.mean(np.asarray(values))
  return np.mean(np.concatenate([v.ravel() for v in values]))


def _stacked(values: List) -> np.ndarray:
  """Per-batch values as one array: stacked where they share a shape, else a 1-D object array of them."""
  values = [np.asarray(v) for v in values]
  if _same_shapes(values):
    return np.asarray(values)
  out = np.empty(len(values), dtype=object)
  out[:] = values
  return out


def _shapes_table(values: List[np.ndarray]) -> np.ndarray:
  """Each value's shape as a row, padded with -1 to the largest number of dimensions."""
  ndim = max(v.ndim for v in values)
  return np.asarray([list(v.shape) + [-1] * (ndim - v.ndim) for v in values], np.int64)


def _split_by_shapes(flat: np.ndarray, shapes: np.ndarray) -> List[np.ndarray]:
  """The inverse of storing ``values`` end to end with :func:`_shapes_table`."""
  out, start = [], 0
  for row in shapes:
    shape = tuple(int(n) for n in row if n >= 0)
    size = int(np.prod(shape, dtype=np.int64))
    out.append(flat[start:start + size].reshape(shape))
    start += size
  return out
