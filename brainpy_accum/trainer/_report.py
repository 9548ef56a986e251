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
