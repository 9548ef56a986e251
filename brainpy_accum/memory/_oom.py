"""Out of device memory at run time: re-plan the batch size with twice the micro-batches and retry.

The compile-time plan can still fail at run time (allocator fragmentation, other processes on the device).
A jitted step that fails raises before it writes any Variable back, so the failed attempt changes nothing
(parameters, optimizer, model and random state, counters, history): the same batch can run again, cut finer,
to the same update.
"""

from typing import Callable

from tqdm import tqdm

from ..core._cut import MicroBatchPlan, plan_micro_batches
from ._device import is_out_of_memory

__all__ = ['finer_plan', 'run_with_retry']


def finer_plan(plan: MicroBatchPlan) -> MicroBatchPlan:
  """``plan`` with twice the micro-batches (same batch); raises if each already holds one sample."""
  if plan.micro_batch_size == 1:
    raise MemoryError(f'The train step ran out of device memory with one sample per micro-batch '
                      f'({plan.describe()}): it cannot be cut finer. Use a smaller model or fewer time steps, '
                      f'remat=True, or a device with more memory.')
  return plan_micro_batches(plan.batch_size, num_micro_batch=min(plan.batch_size, 2 * plan.num_micro_batches))


def run_with_retry(run: Callable, replan: Callable[[BaseException], str]):
  """``run()``; after each out-of-memory error ``replan(error)`` (which says what it changed) and run again."""
  told = False
  while True:
    try:
      return run()
    except Exception as error:  # noqa: BLE001 -- only XLA's resource-exhausted error is retried
      if not is_out_of_memory(error):
        raise
      change = replan(error)
      if not told:
        tqdm.write(f'out of device memory: {change}; retrying the same batch (nothing was changed by the failed '
                   f'attempt).')
        told = True
