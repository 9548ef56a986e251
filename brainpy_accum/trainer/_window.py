"""Accumulation across batches: ``accumulate_steps`` batches from the data iterator, one optimizer update.

The running sums live in BrainPy Variables, so they stay on the device and
inside the compiled step. A window closes after ``k`` batches or at the last
batch of an epoch, whichever comes first, and is weighted by what it held:
a short last window is neither under- nor over-weighted, and nothing carries
into the next epoch.
"""

from typing import Dict, Iterable, Iterator, Optional, Sequence, Tuple, Union

import brainpy.math as bm
import jax
import jax.numpy as jnp
import numpy as np

from ..core._combine import same_type, wide_zeros_like
from ..core._cut import check_positive_int, is_int
from ..core._written import Written, fingerprint

__all__ = ['GradWindow', 'check_accumulate_steps', 'steps_for_epoch', 'with_last_flag']


def check_accumulate_steps(value) -> Union[int, Dict[int, int]]:
  """An int ``k >= 1``, or an epoch schedule ``{first_epoch: k}`` like Lightning's ``GradientAccumulationScheduler``."""
  if isinstance(value, dict):
    if not value:
      raise ValueError('accumulate_steps={} is empty: give e.g. {0: 1, 5: 4} (from epoch 5 on, 4 batches per update).')
    for epoch, k in value.items():
      if not is_int(epoch) or epoch < 0:
        raise ValueError(f'accumulate_steps={value!r}: the key {epoch!r} must be an epoch index (int >= 0).')
      check_positive_int(f'accumulate_steps[{epoch}]', k, 'Each value is the number of batches per update.')
    return dict(sorted((int(epoch), check_positive_int(f'accumulate_steps[{epoch}]', k, '')) for epoch, k in value.items()))
  return check_positive_int('accumulate_steps', value, 'Pass e.g. accumulate_steps=4 or {0: 1, 5: 4}.')


def steps_for_epoch(schedule: Union[int, Dict[int, int]], epoch: int) -> int:
  """Batches per update in ``epoch``: the value of the last schedule key ``<= epoch`` (1 before the first key)."""
  if isinstance(schedule, int):
    return schedule
  return next((k for start, k in reversed(schedule.items()) if start <= epoch), 1)


def with_last_flag(items: Iterable) -> Iterator[Tuple[object, bool]]:
  """Yield ``(item, is_last)``, looking one item ahead.

  If fetching the next item fails, the item in hand is still yielded (as not last) before the error is
  raised: the batches a failing data source gave are all trained, as :class:`brainpy.BPTT` trains them.
  """
  iterator = iter(items)
  try:
    previous = next(iterator)
  except StopIteration:
    return
  while True:
    try:
      item = next(iterator)
    except StopIteration:
      break
    except Exception:
      yield previous, False
      raise
    yield previous, False
    previous = item
  yield previous, True


def _kept(grads: Dict, weight, keep: Optional[object]):
  """``(grads, weight)`` as float32 weight, both zeroed where ``keep`` is False (``None`` keeps all)."""
  weight = jnp.asarray(weight, jnp.float32)
  if keep is None:
    return grads, weight
  return {k: jnp.where(keep, g, jnp.zeros_like(g)) for k, g in grads.items()}, jnp.where(keep, weight, 0.)


class GradWindow:
  """Sum of weighted batch gradients and of their weights since the last update, in Variables.

  With ``copies=D`` every sum gets a leading axis of ``D`` rows, one per
  device of a mesh (sharded along it), so each device keeps its own partial
  sums between updates and the devices add them only when the window closes.
  ``watchable``: the model's Variables that a forward pass may write without a batch axis, whose writes the
  window compares between its batches (:meth:`writes_apart`).
  """

  def __init__(self, params: Dict[str, bm.Variable], copies: Optional[int] = None, watchable: Sequence = ()):
    zeros = wide_zeros_like({k: v.value for k, v in params.items()})
    self.copies = copies
    if copies is not None:
      zeros = {k: jnp.zeros((copies,) + z.shape, z.dtype) for k, z in zeros.items()}
    self.grads = bm.VarDict({k: bm.Variable(z) for k, z in zeros.items()})
    self.weight = bm.Variable(jnp.zeros(() if copies is None else (copies,), jnp.float32))
    # whether the step now run closes the window: an argument of the step, not part of its program, so that
    # every chunk of a streamed batch runs one compiled step (set by the fit loop; not a checkpointed sum)
    self.closes = bm.Variable(jnp.ones((), bool))
    # a print of what the window's first batch wrote to each watchable Variable, and whether it wrote it: read
    # and written only by the steps of a model that writes such Variables (not checkpointed: a resumed window
    # compares from its next batch on)
    self._slots = {id(var): i for i, var in enumerate(watchable)}
    # (made from NumPy zeros: copied to the device, no program compiled for them when a trainer is built)
    self.prints = bm.Variable(jax.device_put(np.zeros((len(watchable),), np.uint32)))
    self.printed = bm.Variable(jax.device_put(np.zeros((len(watchable),), bool)))

  def add_sums(self, grad_sums: Dict, weight, keep: Optional[object] = None) -> None:
    """Add already weighted gradient sums (one device's, inside a shard) and their weight."""
    grad_sums, weight = _kept(grad_sums, weight, keep)
    for k, var in self.grads.items():
      # broadcasts over a device row; the sum keeps the window's weak type (that of its parameter), so that
      # the next step takes the same abstract inputs (no second compilation)
      var.value = same_type(var.value + grad_sums[k].astype(var.dtype), var.value)
    self.weight.value = self.weight.value + weight

  def take_sums(self, where: Optional[object] = None):
    """Return this device's ``(grad_sums, weight)`` (its row of each sum, on a mesh) and empty the window
    (only where ``where``, a traced bool, is True; ``None``: always)."""
    row = (lambda x: x) if self.copies is None else (lambda x: x.sum(0))
    sums = {k: row(v.value) for k, v in self.grads.items()}
    weight = row(self.weight.value)
    self._empty(where)
    return sums, weight

  def _empty(self, where: Optional[object] = None) -> None:
    for var in [*self.grads.values(), self.weight]:
      var.value = jnp.zeros_like(var.value) if where is None else jnp.where(where, jnp.zeros_like(var.value), var.value)

  def clear(self) -> None:
    """Empty the window: nothing carries into a new :meth:`fit` call (a call stopped by an error between the
    batches or pieces of one update leaves their sums; a resumed run loads its window from the checkpoint after).
    An empty window is left as it is (nothing computed)."""
    if not (np.asarray(self.weight.value).any() or np.asarray(self.printed.value).any()):
      return
    self._empty()
    self.printed.value = jnp.zeros_like(self.printed.value)

  def writes_apart(self, written: Written, closes) -> Tuple:
    """For each state of ``written``, True where this batch wrote another value than an earlier batch of the
    window; the first batch's prints are kept until the window closes (``closes``: a bool, or traced)."""
    apart = []
    for state in written.states:
      slot = self._slots.get(id(state))
      if slot is None:  # not the model's (nothing to keep it by)
        apart.append(jnp.asarray(False))
        continue
      new, old, seen = fingerprint(state.value), self.prints.value[slot], self.printed.value[slot]
      apart.append(seen & (new != old))
      self.prints.value = self.prints.value.at[slot].set(jnp.where(seen, old, new))
      self.printed.value = self.printed.value.at[slot].set(True)
    self.printed.value = jnp.where(closes, jnp.zeros_like(self.printed.value), self.printed.value)
    return tuple(apart)

  def variables(self) -> Dict[str, bm.Variable]:
    """The window's Variables by name, for checkpoints."""
    return {**{f'grads/{k}': v for k, v in self.grads.items()}, 'weight': self.weight}
