"""How one batch is cut into micro-batches.

The plan is pure integer arithmetic: it is computed from static shapes while a
train step is traced, so each distinct batch size gets exactly one plan and
one compilation.
"""

from typing import NamedTuple, Optional, Tuple, Union

import numpy as np

__all__ = ['MicroBatchPlan', 'plan_micro_batches', 'as_int', 'check_cut', 'check_positive_int', 'describe_remat', 'is_int']


class MicroBatchPlan(NamedTuple):
  """The micro-batches of one batch: ``num_full`` of ``micro_batch_size`` samples, then ``remainder``.

  Attributes
  ----------
  batch_size : int
    Samples in the whole batch.
  micro_batch_size : int
    Samples in each full micro-batch (the ones that are scanned).
  num_full : int
    Number of full micro-batches.
  remainder : int
    Samples in the one short micro-batch that follows the full ones (0 for none).
  remat : bool, int or None
    Rematerialisation of the time loop chosen for this batch by ``remat='auto'``
    (``False``, ``True`` for segments of ``round(sqrt(T))`` steps, or a segment
    length); ``None`` (default) follows the trainer's ``remat`` option.

  Examples
  --------
  >>> from brainpy_accum import MicroBatchPlan
  >>> plan = MicroBatchPlan(batch_size=10, micro_batch_size=4, num_full=2, remainder=2)
  >>> plan.num_micro_batches, plan.sizes
  (3, (4, 4, 2))
  """
  batch_size: int
  micro_batch_size: int
  num_full: int
  remainder: int
  remat: Union[bool, int, None] = None

  @property
  def num_micro_batches(self) -> int:
    """Micro-batches actually run, the short one included."""
    return self.num_full + (1 if self.remainder else 0)

  @property
  def sizes(self) -> Tuple[int, ...]:
    """Sample count of every micro-batch, in the order they run."""
    return (self.micro_batch_size,) * self.num_full + ((self.remainder,) if self.remainder else ())

  def describe(self) -> str:
    """A short human-readable summary, e.g. ``'batch 10 = 3 x 3 + 1'`` (and the plan's remat, if any)."""
    remat = f', remat {describe_remat(self.remat)}' if self.remat else ''
    return f'batch {self.batch_size} = {self.describe_cuts()}{remat}'

  def describe_cuts(self) -> str:
    """The micro-batches alone, e.g. ``'3 x 3 + 1'``."""
    return f'{self.num_full} x {self.micro_batch_size}' + (f' + {self.remainder}' if self.remainder else '')


def describe_remat(remat: Union[bool, int, None]) -> str:
  """``'none'``, ``'every sqrt(T) steps'`` (``remat=True``) or ``'every 7 steps'`` (``remat=7``)."""
  if not remat:
    return 'none'
  return 'every sqrt(T) steps' if remat is True else f'every {remat} steps'


def is_int(value) -> bool:
  """A Python or NumPy integer (what array arithmetic gives), not a bool."""
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def as_int(value):
  """``value`` as a Python ``int`` if it is a NumPy integer (hashable and static under ``jit``), else unchanged."""
  return int(value) if is_int(value) else value


def check_positive_int(name: str, value, fix: str) -> int:
  """Return ``value`` as an ``int`` if it is a positive (Python or NumPy) integer; otherwise raise naming ``name``."""
  if not is_int(value):
    raise TypeError(f'{name}={value!r} must be a positive int ({type(value).__name__} given). {fix}')
  if value < 1:
    raise ValueError(f'{name}={value!r} must be a positive int. {fix}')
  return int(value)


def check_cut(num_micro_batch, micro_batch_size) -> None:
  """Exactly one of ``num_micro_batch`` and ``micro_batch_size``, a positive int."""
  if (num_micro_batch is None) == (micro_batch_size is None):
    raise ValueError(f'Give exactly one of num_micro_batch and micro_batch_size; got {num_micro_batch=} and '
                     f'{micro_batch_size=}. E.g. num_micro_batch=4, or micro_batch_size=32.')
  if num_micro_batch is not None:
    check_positive_int('num_micro_batch', num_micro_batch, 'Pass e.g. num_micro_batch=4.')
  else:
    check_positive_int('micro_batch_size', micro_batch_size, 'Pass e.g. micro_batch_size=32.')


def plan_micro_batches(
    batch_size: int,
    *,
    num_micro_batch: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
) -> MicroBatchPlan:
  """Split ``batch_size`` samples into at most ``num_micro_batch`` near-equal micro-batches.

  Exactly one of ``num_micro_batch`` and ``micro_batch_size`` is given. With
  ``num_micro_batch=N`` each full micro-batch holds ``ceil(batch_size / N)``
  samples, so no micro-batch is larger than that and at most ``N`` run; the
  samples left over form one shorter micro-batch. With ``micro_batch_size=m``
  the full micro-batches hold ``min(m, batch_size)`` samples.

  Parameters
  ----------
  batch_size : int
    Samples in the batch; must be positive.
  num_micro_batch : int, optional
    Upper bound on the number of micro-batches.
  micro_batch_size : int, optional
    Samples per full micro-batch.

  Returns
  -------
  MicroBatchPlan
    The sizes to run.

  Examples
  --------
  >>> from brainpy_accum import plan_micro_batches
  >>> plan_micro_batches(10, num_micro_batch=4)
  MicroBatchPlan(batch_size=10, micro_batch_size=3, num_full=3, remainder=1, remat=None)
  >>> plan_micro_batches(3, num_micro_batch=4).sizes
  (1, 1, 1)
  >>> plan_micro_batches(10, micro_batch_size=4).describe()
  'batch 10 = 2 x 4 + 2'
  """
  check_positive_int('batch_size', batch_size, 'An empty batch has nothing to train on: drop it from the data.')
  check_cut(num_micro_batch, micro_batch_size)
  size = -(-batch_size // num_micro_batch) if num_micro_batch is not None else min(micro_batch_size, batch_size)
  return MicroBatchPlan(batch_size, size, batch_size // size, batch_size % size)
