"""Feeding the device: each batch on its way to the device while the step before it runs.

A NumPy batch handed to a compiled step is copied to the device when the step is called, and the device
waits for it. :meth:`AccumBPTT.fit` sends it earlier instead (double buffering)::

  for batch k of the pass:            # batch k + 1 is already read: fit looks one batch ahead for the last
    dispatch step(batch k)            # asynchronous: returns at once
    wait until step(batch k - 1) is done        # its batch leaves the device
    jax.device_put(batch k + 1)       # asynchronous: copied while step k runs

so the device holds the batch of the running step and at most one more. This is for accelerators (GPU, TPU),
where the copy crosses to the chip and can run beside the step. On a CPU, JAX's default device being the host,
nothing is sent ahead by default: there a jitted step takes a NumPy array more cheaply than a copy made ahead
(on the benchmark's CPU, sending a 0.8 MB batch ahead cost about 0.6 ms, a tenth of a 7 ms step), and the loop
stays as it was. Nothing is read from the data ahead
of what fit reads anyway (one batch, a generator's laziness is kept), the step is the same program on the same
values (the copy is what the step would have made: bit for bit the same results), and the loop waits on a
step only to keep that bound, one step behind the device (never while the device is idle for it). The batch
sent ahead takes :func:`prefetch_bytes` on the device beside the step: what a memory plan must leave free.

Only what can go ahead goes ahead: a batch whose leaves are all arrays (NumPy ones are copied, those already
on the device are kept as they are, no copy) and whose tree, shapes and dtypes are those of the batch in hand,
whose check and plan it then shares (a batch unlike it, such as a shorter last one, or one that fails its
check, waits for its turn on the host as before, and fails then with the same error). A streamed batch's
chunks (:mod:`~brainpy_accum.memory._stream`) go ahead one by one the same way; the batch after a streamed
one does not (it would not fit beside it). With a ``mesh`` nothing goes ahead: the step places the batch's
shares itself, as before.
"""

import collections
import contextlib
from typing import Any, Deque, Iterable, Iterator, Optional, Tuple

import jax
import numpy as np

from ..core._batch import is_array
from ._window import with_last_flag

__all__ = ['Feed', 'Ahead', 'on_device', 'overlapping', 'prefetch_bytes', 'sends_ahead']

_OVERLAP = [None]  # None: by the device (on an accelerator); :func:`overlapping` sets it for the tests and benchmark
_NOTHING = object()


def sends_ahead() -> bool:
  """Whether ``fit`` sends batches ahead: as :func:`overlapping` says, else where the default device is an
  accelerator (not on a CPU)."""
  return jax.default_backend() != 'cpu' if _OVERLAP[0] is None else _OVERLAP[0]


@contextlib.contextmanager
def overlapping(enabled: Optional[bool]):
  """Within the ``with``, ``fit`` sends batches ahead (``True``, also on a CPU) or hands each to its step
  (``False``, the loop without the overlap), whatever the device; ``None``: by the device (the default). For
  the tests, which run on a CPU, and for the benchmark's comparisons.

  Examples
  --------
  >>> from brainpy_accum.trainer._feed import Ahead, overlapping
  >>> with overlapping(True):
  ...   Ahead().enabled
  True
  """
  before, _OVERLAP[0] = _OVERLAP[0], None if enabled is None else bool(enabled)
  try:
    yield
  finally:
    _OVERLAP[0] = before


def _leaves(batch):
  return jax.tree_util.tree_leaves(batch, is_leaf=is_array)


def _copied(x) -> bool:
  """Whether a leaf is a host array that :func:`on_device` copies (others are already on a device)."""
  return isinstance(x, np.ndarray)


def on_device(batch) -> Optional[Any]:
  """``batch`` with its NumPy arrays sent to the default device (asynchronously: this returns before the copy is
  done), its device arrays as they are (the same objects); ``None`` where it cannot go ahead: a leaf that is
  not an array (a Python number or list: the step converts it itself, with its own types), no NumPy array to
  copy, or a copy that fails (an unsupported dtype, out of device memory): the batch is then left to the step,
  with the host arrays, as before.

  The copy is the one the step would make of the NumPy array (same default device, the same canonical dtype:
  float64 becomes float32 without ``jax_enable_x64``), so the step is the same program on the same values.

  Examples
  --------
  >>> import numpy as np, jax
  >>> x, y = np.ones((4, 3), np.float32), jax.numpy.zeros(4)
  >>> sent = on_device((x, y))
  >>> type(sent[0]).__name__, sent[1] is y
  ('ArrayImpl', True)
  >>> on_device((x, [0, 1, 2, 3])) is None  # a Python list: left to the step
  True
  """
  leaves, treedef = jax.tree_util.tree_flatten(batch, is_leaf=is_array)
  if not any(_copied(x) for x in leaves) or not all(_copied(x) or isinstance(x, jax.Array) or is_array(x)
                                                     for x in leaves):
    return None
  try:
    sent = jax.device_put([x for x in leaves if _copied(x)])
  except Exception:  # noqa: BLE001 -- the step meets the same data as before, and raises what it raised
    return None
  sent = iter(sent)
  return jax.tree_util.tree_unflatten(treedef, [next(sent) if _copied(x) else x for x in leaves])


def prefetch_bytes(inputs, targets) -> int:
  """Device bytes of the copy of one batch that ``fit`` sends ahead: what a memory plan must leave free beside
  the step of a batch of this shape (0 for data already on the device, which is not copied).

  The copy has the canonical dtype (float64 arrays take 4 bytes an element without ``jax_enable_x64``).

  Examples
  --------
  >>> import numpy as np
  >>> prefetch_bytes(np.ones((8, 5, 3)), np.zeros(8, np.int32))  # float64 sent as float32
  512
  """
  return sum(int(x.size) * jax.dtypes.canonicalize_dtype(x.dtype).itemsize
             for x in _leaves((inputs, targets)) if _copied(x))


def _signature(batch):
  """What a batch's check and plan depend on: its tree and each leaf's shape and dtype (``None``: not arrays)."""
  leaves, treedef = jax.tree_util.tree_flatten(batch, is_leaf=is_array)
  if not all(hasattr(x, 'shape') and hasattr(x, 'dtype') for x in leaves):
    return None
  return treedef, tuple((tuple(x.shape), np.dtype(x.dtype)) for x in leaves)


class Ahead:
  """The steps dispatched and not yet waited for, so that at most one piece of data is sent ahead of them.

  ``send(data)``, after a step's :meth:`dispatched`, first waits for the step before that one (which the
  device then has finished: its data is freed), then sends ``data``: the device holds the running step's data
  and the data sent, no more. Where nothing is sent ahead (:func:`sends_ahead`) it sends nothing and never
  waits.
  """

  def __init__(self):
    self.enabled = sends_ahead()
    self._running: Deque[Any] = collections.deque(maxlen=2)  # outputs of the last two steps dispatched

  def dispatched(self, outputs) -> None:
    """A step was dispatched; ``outputs`` (any of its results) are ready when it is done."""
    self._running.append(outputs)

  def send(self, data) -> Optional[Any]:
    """``data`` on its way to the device (:func:`on_device`), or ``None`` where it stays on the host."""
    if not self.enabled:
      return None
    if len(self._running) == 2:
      jax.block_until_ready(self._running.popleft())
    return on_device(data)


class Feed:
  """The batches of one pass, as ``(batch, is_last)``, each sent to the device while the step before it runs.

  It reads one batch ahead of the one it yields, with
  :func:`~brainpy_accum.trainer._window.with_last_flag` (whose behaviour it keeps: if reading the next batch
  fails, the batch in hand is still yielded, as not last, before the error is raised), and sends that batch
  ahead when the loop says that the step of the batch in hand was dispatched (:meth:`dispatched`). The loop
  then gets the batch's copy, and checks, plans and steps it as it would the host batch (same shapes).

  The data source may reuse a batch's host arrays when it makes the batch two after it (it may today: the loop
  has called that batch's step by then): the copy of that batch is waited for before the source is read on.

  Examples
  --------
  >>> import numpy as np, jax.numpy as jnp
  >>> from brainpy_accum.trainer._feed import Feed
  >>> from brainpy_accum.trainer._feed import overlapping
  >>> batches = [(np.full((2, 1), i, np.float32), np.zeros(2, np.float32)) for i in range(3)]
  >>> with overlapping(True):  # also on a CPU
  ...   feed = Feed(batches)
  >>> for (x, y), last in feed:
  ...   loss = jnp.sum(x)                    # the step, dispatched
  ...   feed.dispatched(loss)                # the next batch is sent ahead
  ...   print(type(x).__name__, float(loss), last)
  ndarray 0.0 False
  ArrayImpl 2.0 False
  ArrayImpl 4.0 True
  """

  def __init__(self, batches: Iterable, put: bool = True):
    self._batches = batches
    self._ahead = Ahead()
    self._ahead.enabled = self._ahead.enabled and put
    self._in_hand: Any = _NOTHING     # the batch the loop has, as the source gave it
    self._following: Any = _NOTHING   # the batch read ahead, as the source gave it
    self._sent: Optional[Any] = None  # the copy of the batch read ahead, once sent
    self._before: Optional[Any] = None  # the copy of the batch handed before the one in hand

  def __iter__(self) -> Iterator[Tuple[Any, bool]]:
    for batch, last in with_last_flag(self._read()):
      sent, self._sent, self._in_hand = self._sent, None, batch
      yield (batch if sent is None else sent), last
      self._before = sent

  def _read(self) -> Iterator[Any]:
    """The source's batches, each kept as the one read ahead until the next is read."""
    iterator = iter(self._batches)
    while True:
      if self._before is not None:  # the source may overwrite that batch's host arrays when it makes the next
        jax.block_until_ready(self._before)
        self._before = None
      self._following = _NOTHING
      try:
        batch = next(iterator)
      except StopIteration:
        return
      self._following = batch
      yield batch

  def dispatched(self, outputs) -> None:
    """The step of the batch in hand was dispatched (``outputs``: any of its results): send the batch read
    ahead if it is like the one in hand (same tree, shapes and dtypes: the same check and plan)."""
    following, self._following = self._following, _NOTHING
    if not self._ahead.enabled:
      return
    self._ahead.dispatched(outputs)
    if following is not _NOTHING and _signature(following) is not None \
        and _signature(following) == _signature(self._in_hand):
      self._sent = self._ahead.send(following)
