"""Per-phase bookkeeping of losses and metrics during :meth:`AccumBPTT.fit`, as :class:`brainpy.BPTT` keeps it."""

import time
from typing import Dict, List

import numpy as np

__all__ = ['PhaseLog']


class PhaseLog:
  """Collects one phase's per-batch metrics and turns them into report lines.

  ``detailed`` keeps every batch's value, ``report`` the mean over each
  report window; both become the arrays behind
  :meth:`brainpy.BPTT.get_hist_metric`.
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
      values_np = np.asarray(values)
      means[key] = np.mean(values_np)
      self.report.setdefault(key, []).append(means[key])
      self.detailed.setdefault(key, []).extend(values_np)
      values.clear()
    elapsed = time.time() - self.started
    metrics = ', '.join(f'{k} {v}' for k, v in means.items())
    line = f'{self.title} {idx} {unit}, use {elapsed:.4f} s, {metrics} ({self.plan_text}{extra})'
    self.plan_text = ''
    self.started = time.time()
    return line, means

  def state(self) -> dict:
    """Everything :meth:`restore` needs to continue this log in another process (host arrays, for checkpoints)."""
    return {'steps': np.asarray(self.steps),
            **{f'{part}/{key}': _host(values) for part in ('window', 'report', 'detailed')
               for key, values in getattr(self, part).items()}}

  def restore(self, state: dict) -> None:
    """Continue from :meth:`state`'s result; the report window is the one that was open."""
    self.steps = int(state['steps'])
    self.window, self.report, self.detailed = {'loss': []}, {}, {}
    for name, values in state.items():
      if name != 'steps':
        part, key = name.split('/', 1)
        getattr(self, part)[key] = list(np.asarray(values))

  def arrays(self):
    """``(report, detailed)`` as dicts of NumPy arrays."""
    return ({k: np.asarray(v) for k, v in self.report.items()},
            {k: np.asarray(v) for k, v in self.detailed.items()})


def _host(values: List) -> np.ndarray:
  """A list of per-batch scalars (device or host) as one host array; an empty list as an empty float array."""
  return np.asarray([np.asarray(v) for v in values]) if values else np.zeros((0,), np.float32)
