"""The evidence-accumulation task's trials, from ``brainpy_datasets.cognitive.EvidenceAccumulation``: its periods
(:class:`Periods`), trials drawn from a seed (:func:`draw_trials`) and the batches of a training run, each drawn
from ``(seed, update)`` alone (:class:`TrainingBatches`)."""

import collections
import concurrent.futures
import copy
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from ._network import DT

__all__ = ['Periods', 'PAPER_PERIODS', 'Trials', 'FEATURES', 'CHANNELS', 'FEATURES_IN', 'TRAIN_STREAM', 'HELD_OUT_STREAM',
           'load_task', 'draw_trials', 'TrainingBatches']

TRAIN_STREAM, HELD_OUT_STREAM = 0, 1  # trials are drawn from (seed, stream, ...)


class Periods(NamedTuple):
  """A trial's periods in ms (= steps): ``interval`` before each of the 7 cues, then ``delay`` and ``recall``."""
  interval: int
  cue: int
  delay: int
  recall: int

  @property
  def steps(self) -> int:
    """Time steps of a trial: ``7 * (interval + cue) + delay + recall`` (2,200 for :data:`PAPER_PERIODS`)."""
    return 7 * (self.interval + self.cue) + self.delay + self.recall


PAPER_PERIODS = Periods(interval=50, cue=100, delay=1000, recall=150)  # EvidenceAccumulation's defaults


class Trials(NamedTuple):
  """Trials of the task: ``inputs`` (n, steps, 100) float32 spikes, ``labels`` (n,) int32."""
  inputs: np.ndarray
  labels: np.ndarray


FEATURES = ('left', 'right', 'recall', 'noise')  # the dataset's features, 25 input channels each, in this order
CHANNELS = 25
FEATURES_IN = len(FEATURES) * CHANNELS  # the network's inputs: 100


def load_task(periods: Periods):
  """``brainpy_datasets.cognitive.EvidenceAccumulation`` with these periods, in its rate mode (:func:`draw_trials`
  draws the spikes). Its features are made anew for each task: the dataset's default ``Feature`` arguments are
  objects shared by every task, each of which shifts them along the channels (brainpy-datasets 0.0.0.7: wrong
  channels from the second task of a process on)."""
  try:
    from brainpy_datasets.cognitive import EvidenceAccumulation, Feature
  except ImportError as error:
    raise ImportError('The evidence-accumulation benchmark needs brainpy-datasets: pip install '
                      '"brainpy-accum[evidence]" (or pip install brainpy-datasets six).') from error
  cue, noise = 40., 10.  # Hz: the dataset's defaults, e-prop's f0 = 40 Hz and f0 / 4
  features = [Feature(1, CHANNELS, rate) for rate in (cue, cue, cue, noise)]
  return EvidenceAccumulation(dt=DT, t_interval=periods.interval, t_cue=periods.cue, t_delay=periods.delay,
                              t_recall=periods.recall, ft_left=features[0], ft_right=features[1],
                              ft_recall=features[2], ft_noise=features[3], mode='rate')


def draw_trials(task, seed: Sequence[int], n: int) -> Trials:
  """``n`` trials of ``task`` (:func:`load_task`) drawn from ``seed``: the same seed, the same trials.

  The dataset draws each trial's side and cues and gives each feature's firing probability at each step; the
  spikes of its 25 channels are drawn here for all trials at once, the Bernoulli spikes of the dataset's spiking
  mode, four times faster (128 trials of 2,200 steps: 0.24 s instead of 1.0 s on a CPU core). Channels: 0-24
  left cues, 25-49 right, 50-74 recall, 75-99 noise; label 1: more left cues.
  """
  task = copy.copy(task)  # (batches are drawn on threads: each its own copy of the task and its rng)
  task.rng = np.random.RandomState(list(seed))  # the dataset draws every trial from its rng
  templates, labels = zip(*(task.sample_a_trial(i)[:2] for i in range(n)))
  probability = np.asarray(templates, np.float32)  # (n, steps, 4)
  order = [task.features[name].i.start for name in FEATURES]
  rng = np.random.default_rng(list(seed))
  inputs = np.empty(probability.shape[:2] + (FEATURES_IN,), np.float32)
  for k, column in enumerate(order):
    block = rng.random(probability.shape[:2] + (CHANNELS,), dtype=np.float32)
    inputs[..., k * CHANNELS:(k + 1) * CHANNELS] = block < probability[..., column:column + 1]
  return Trials(inputs, np.asarray(labels, np.int32))


class TrainingBatches:
  """The training batches of one epoch, for ``fit``: called once per epoch, it yields the batches of updates
  ``epoch * per_epoch ...`` (fewer in the last epoch), each drawn from ``(seed, update)``, the next ones on
  threads while a batch trains. ``epoch`` is set by the caller before each ``fit`` call, which trains that epoch.
  """

  def __init__(self, task, batch: int, seed: int, per_epoch: int, updates: int, ahead: int = 2):
    self.task, self.batch, self.seed, self.per_epoch, self.updates = task, batch, seed, per_epoch, updates
    self.ahead = ahead  # batches drawn ahead, on as many threads
    self.epoch = 0

  def batch_of(self, update: int) -> Trials:
    return draw_trials(self.task, (self.seed, TRAIN_STREAM, update), self.batch)

  def __call__(self) -> Iterator[Trials]:
    first = self.epoch * self.per_epoch
    return self._drawn(range(first, min(first + self.per_epoch, self.updates)))

  def _drawn(self, updates: range) -> Iterator[Trials]:
    with concurrent.futures.ThreadPoolExecutor(self.ahead) as pool:  # NumPy draws without the GIL
      pending = collections.deque(pool.submit(self.batch_of, u) for u in updates[:self.ahead])
      for u in updates[self.ahead:]:
        yield pending.popleft().result()
        pending.append(pool.submit(self.batch_of, u))
      while pending:
        yield pending.popleft().result()
