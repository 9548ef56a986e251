"""Feeding the device: the data of the next step on its way while the step before it runs.

A NumPy batch handed to a compiled step is copied to the device when the step is called, and the device
waits for it. :meth:`AccumBPTT.fit` sends it earlier instead, one *unit* at a time: a whole batch, or one
piece of a batch streamed in pieces (:mod:`~brainpy_accum.memory._stream`, one micro-batch each)::

  for each unit k (a piece of this batch, or the next batch's first):
    dispatch step(unit k)             # asynchronous: returns at once
    wait until step(unit k - 1) is done          # its data leaves the device
    jax.device_put(unit k + 1)        # asynchronous: copied while step k runs

so the device holds the data of the running step and of one unit more, whatever the batch size, and the copies
run beside the steps across batch boundaries (the next batch's first piece goes while this batch's last
computes). A unit that nothing sent ahead (a pass's first, one refused for room) is copied when its step is
called, and the next unit's copy starts once it has arrived (:meth:`Feed.for_step`): two copies at once share the
link and would hold back the step that needs the first. Each NumPy array goes as one copy: on a TPU v5e NumPy
epochs ran faster this way than with each large array copied as eight slices on threads and joined on the device
(the join, a program of its own, ran between the steps, 2.4 ms beside each 61 ms one; 0.903 against 0.888 of device
data at a batch of 2,048, 0.846 against 0.827 streamed at 32,768, 2026-12-07), although such slices crossed the
link faster (12.6 against 10.0 GB/s).

This is for accelerators (GPU, TPU), where the copy crosses to the chip and can run beside the step. On a CPU,
JAX's default device being the host, nothing is sent ahead by default (:func:`sends_ahead`): there a jitted step
takes a NumPy array more cheaply than a copy made ahead. Nothing is read from the data ahead of what fit reads
anyway (one batch: a generator's laziness is kept), the step is the same program on the same values (the copy
is what the step would have made: bit for bit the same results), and the loop waits on a step only to keep that
bound. A unit goes ahead only where the device has room for it beside the running step (its memory
statistics: arrays and the running programs' reserved temporaries, which the TPU runtime would otherwise evict,
reload or fail to load); the planner counts it in every plan (:func:`prefetch_bytes`).

Only what can go ahead goes ahead: a batch whose leaves are all arrays (NumPy ones are copied, those already
on the device are kept as they are, no copy) and whose tree, shapes and dtypes are those of the batch in hand,
whose check and plan it then shares (a batch unlike it, such as a shorter last one, or one that fails its
check, waits for its turn on the host as before, and fails then with the same error). With a ``mesh`` nothing
goes ahead: the step places the batch's shares itself.
"""

import collections
from typing import Any, Callable, ContextManager, Deque, Dict, Iterable, Iterator, NamedTuple, Optional

import jax
import numpy as np

from ..core._batch import is_array
from ..memory._device import device_memory
from ..memory._switch import DeviceSwitch
from ._window import with_last_flag

__all__ = ['Feed', 'Fed', 'Sender', 'as_pair', 'holds_batches', 'on_device', 'overlapping', 'prefetch_bytes',
           'sends_ahead']

_OVERLAP = DeviceSwitch(lambda: jax.default_backend() != 'cpu')  # :func:`overlapping` sets it for tests and benches
# Of the device's limit, left free beside a unit sent ahead (allocations near a full device stall on a TPU).
ROOM_MARGIN = 0.02


def sends_ahead() -> bool:
  """Whether ``fit`` sends data ahead: as :func:`overlapping` says, else where the default device is an
  accelerator (not on a CPU)."""
  return _OVERLAP()


def overlapping(enabled: Optional[bool]) -> ContextManager[None]:
  """Within the ``with``, ``fit`` sends data ahead (``True``, also on a CPU, batches streamed in pieces as on an
  accelerator) or hands each batch to its step (``False``); ``None``: by the device (the default). For the tests,
  which run on a CPU, and for the benchmark's comparisons.

  Examples
  --------
  >>> from brainpy_accum.trainer._feed import Sender, overlapping
  >>> with overlapping(True):
  ...   Sender().enabled
  True
  """
  return _OVERLAP.set(enabled)


def _leaves(batch):
  return jax.tree_util.tree_leaves(batch, is_leaf=is_array)


def _copied(x) -> bool:
  """Whether a leaf is a host array that :func:`on_device` copies (others are already on a device)."""
  return isinstance(x, np.ndarray)


def _put(x):
  """One host leaf on its way to the default device, as one copy (see the module's docstring). On a CPU the copy
  is made here, by NumPy: JAX's CPU arrays alias a suitably aligned NumPy array (about half of them), and even
  with ``may_alias=False`` its copy was seen to read the NumPy array after ``block_until_ready`` returned, once the
  source had refilled it for the next batch."""
  if jax.default_backend() == 'cpu':
    return jax.device_put(np.array(x, copy=True))
  return jax.device_put(x)


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
    sent = [_put(x) for x in leaves if _copied(x)]
  except Exception:  # noqa: BLE001 -- the step meets the same data as before, and raises what it raised
    return None
  sent = iter(sent)
  return jax.tree_util.tree_unflatten(treedef, [next(sent) if _copied(x) else x for x in leaves])


_copy_at_step = on_device  # the same copy, made at the step's call (:meth:`Feed.for_step`; a seam for tests)


def as_pair(batch):
  """A batch as the source gave it, an array of two rows (NumPy, JAX or BrainPy) as its pair (``bp.BPTT``'s ``for
  x, y in train_data`` unpacks a stacked array of batches, ``(n, 2, ...)``, so); any other batch as it is."""
  array = isinstance(batch, (np.ndarray, jax.Array)) or is_array(batch)
  if array and np.ndim(batch) >= 1 and np.shape(batch)[0] == 2:
    return batch[0], batch[1]
  return batch


def holds_batches(data) -> bool:
  """Whether the source ``data`` holds its batches already (a list, a tuple, a stacked array), rather than making
  each as it is read (a generator, a loader that loads, draws or refills them): those may be read ahead, as
  often as needed, at no cost and with nothing moved."""
  return isinstance(data, (list, tuple, np.ndarray))


def _host_copy(data):
  """``data`` with its NumPy arrays copied (on the host), the rest as they are."""
  return jax.tree_util.tree_map(lambda x: np.array(x, copy=True) if isinstance(x, np.ndarray) else x, data,
                                is_leaf=is_array)


def prefetch_bytes(inputs, targets) -> int:
  """Device bytes that sending one unit of this shape ahead takes beside the running step: what a memory plan
  must leave free (0 for data already on the device, which is not copied).

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
  """What a batch's check and plan depend on: its tree and each leaf's shape, dtype and whether it is on the host
  (a host batch may stream in pieces where one on the device runs whole); ``None``: not arrays."""
  leaves, treedef = jax.tree_util.tree_flatten(batch, is_leaf=is_array)
  if not all(hasattr(x, 'shape') and hasattr(x, 'dtype') for x in leaves):
    return None
  return treedef, tuple((tuple(x.shape), np.dtype(x.dtype), _copied(x)) for x in leaves)


def _room_for(nbytes: int) -> bool:
  """Whether the default device has room for ``nbytes`` more beside its arrays and the temporaries its loaded
  programs reserve (always, where it reports no memory: a CPU)."""
  memory = device_memory()
  return memory is None or nbytes <= memory.limit - memory.in_use - memory.reserved - ROOM_MARGIN * memory.limit


class Sender:
  """The steps dispatched and not yet waited for, so that at most one unit of data is sent ahead of them.

  :meth:`dispatched` waits for the step before the one dispatched (which the device then has finished: its data
  is freed), so that ``send(data)`` after it sends ``data``, if the device has room for it, beside the running
  step's alone. Where nothing is sent ahead (:func:`sends_ahead`) it sends nothing, and off the CPU it still keeps
  at most two steps dispatched (each holds its data on the device).
  """

  def __init__(self, enabled: bool = True):
    self.enabled = enabled and sends_ahead()
    self.bounded = self.enabled or jax.default_backend() != 'cpu'
    self._running: Deque[Any] = collections.deque()  # outputs of the steps dispatched and not waited for

  def dispatched(self, outputs) -> None:
    """A step was dispatched; ``outputs`` (any of its results) are ready when it is done. Where steps are bounded,
    wait for the step before it (never for it): at most two steps are in flight, whether or not data is sent."""
    self._running.append(outputs)
    if self.bounded:
      self._wait(keep=1)

  def _wait(self, keep: int) -> None:
    while len(self._running) > keep:
      jax.block_until_ready(self._running.popleft())

  def send(self, data) -> Optional[Any]:
    """``data`` on its way to the device (:func:`on_device`), or ``None`` where it stays on the host."""
    if not self.enabled or not _room_for(prefetch_bytes(data, ())):
      return None
    return on_device(data)


class Fed(NamedTuple):
  """A batch as the feed hands it: the source's ``batch``, whether it is the pass's ``last`` (a feed that reads
  ahead knows; else ``False``), and the copies of its units sent ahead (``sent``: unit index -> device data; unit
  ``None``: the whole batch)."""
  batch: Any
  last: bool
  sent: Dict[Optional[int], Any]


class Feed:
  """The batches of one pass, as :class:`Fed` values, their units sent to the device while earlier ones run.

  It reads the source as ``bp.BPTT`` does: the next batch when the loop asks for it, once the batch in hand is
  stepped, recorded and reported, so a source may refill the same arrays for every batch, or make a batch from
  the model (or from what ``fun_after_report`` set) as the steps before it left it. The first unit of the batch
  read is then sent at once, if that batch is like the one before (same tree, shapes and dtypes: the same check
  and plan), while the step before still runs. With ``ahead`` (a pass whose updates need to know its last batch:
  ``accumulate_steps``) it reads one batch ahead of the one it yields, with
  :func:`~brainpy_accum.trainer._window.with_last_flag` (whose behaviour it keeps: if reading the next batch
  fails, the batch in hand is still yielded, as not last, before the error is raised), its first unit sent at
  the last dispatch of the batch before. Either way the copies of a batch's units are complete before the source
  is read on, and a source that ``refills`` its arrays has each batch copied before it is read on.

  After the loop dispatched a unit's step it calls :meth:`dispatched`, saying which unit comes next: a piece of
  the same batch (sent into its ``sent``), or, after its last unit, the following batch's first.

  Parameters
  ----------
  batches : iterable
    The pass's batches.
  sender : Sender
    What sends units and bounds the steps in flight.
  units : callable
    ``units(inputs, targets) -> list`` of ``(start, size, slice)`` pieces of a batch, where ``slice()`` gives the
    piece's data, or ``None`` for a batch that runs whole; called on the batch in hand, whose plan is known.
  ahead : bool
    Read one batch ahead, so that each :class:`Fed` says whether it is the pass's ``last`` (without: never).
  refills : bool
    The source may refill a batch's arrays for the next (it is not a list, tuple or array): each batch's NumPy
    arrays are copied, with ``ahead`` as it is read (the next is read while it waits), else on a CPU at its step
    (a step on a CPU reads NumPy arguments after its call returns).

  Examples
  --------
  >>> import numpy as np, jax.numpy as jnp
  >>> from brainpy_accum.trainer._feed import Feed, Sender, overlapping
  >>> batches = [(np.full((2, 1), i, np.float32), np.zeros(2, np.float32)) for i in range(3)]
  >>> with overlapping(True):  # also on a CPU
  ...   feed = Feed(batches, Sender(), units=lambda x, y: None, ahead=True)  # (ahead: each says if it is last)
  >>> for fed in feed:
  ...   x, y = fed.sent.get(None, fed.batch)
  ...   loss = jnp.sum(x)                    # the step, dispatched
  ...   feed.dispatched(loss)                # the next batch is sent ahead
  ...   print(type(x).__name__, float(loss), fed.last)
  ndarray 0.0 False
  ArrayImpl 2.0 False
  ArrayImpl 4.0 True
  """

  def __init__(self, batches: Iterable, sender: Sender, units: Callable[[Any, Any], Optional[list]],
               ahead: bool = False, refills: bool = False):
    self._batches, self.sender, self._units, self._ahead = batches, sender, units, ahead
    self._refills = refills
    self._next_unit: Any = _NO_UNIT  # without ``ahead``: the next batch's unit to send as it is read, if any
    self._in_hand: Optional[Fed] = None
    self._following: Any = _NOTHING   # the batch read ahead, as the source gave it
    self._first: Dict[Optional[int], Any] = {}  # its first unit, sent ahead
    # the copies of the batch in hand's units whose steps may still run (unit -> copy), and of the batch read ahead's
    self._hand_copies: Dict[Optional[int], Any] = {}
    self._following_copies: Dict[Optional[int], Any] = {}
    self._late: Optional[Any] = None  # the running unit's copy, made at its step (nothing went ahead)

  @property
  def enabled(self) -> bool:
    return self.sender.enabled

  def __iter__(self) -> Iterator[Fed]:
    if self._ahead:
      for batch, last in with_last_flag(self._read()):
        yield self._hand(batch, last)
      return
    for batch in self._read():  # read when the loop asks for it, its first unit sent then
      if self._next_unit is not _NO_UNIT and _signature(batch) == _signature(self._in_hand.batch):
        self._send(batch, self._next_unit, self._first, self._following_copies)
      self._next_unit = _NO_UNIT
      yield self._hand(batch, False)

  def _hand(self, batch, last: bool) -> Fed:
    """``batch`` as the batch in hand (its first unit's copy, if it went ahead, in its ``sent``)."""
    self._in_hand = Fed(batch, last, self._first)
    self._first, self._hand_copies, self._following_copies = {}, self._following_copies, {}
    return self._in_hand

  def _read(self) -> Iterator[Any]:
    """The source's batches, each kept as the one read ahead until the next is read."""
    iterator = iter(self._batches)
    while True:
      # the batch read now comes after the one in hand (two after, with ``ahead``), whose host arrays the source
      # may reuse for it
      jax.block_until_ready(list(self._hand_copies.values()))
      self._following = _NOTHING
      try:
        batch = next(iterator)
      except StopIteration:
        return
      batch = as_pair(batch)
      self._following = batch = _host_copy(batch) if self._ahead and self._refills else batch
      yield batch

  def for_step(self, data, unit: Optional[int] = None):
    """``data`` (the batch in hand's ``unit``: ``None``, all of it) as its step takes it: the copy sent ahead, or data
    already on the device, as they are; host data, where the feed sends data ahead, copied now, as the step would
    copy it at its call, so that :meth:`dispatched` sends the next unit once it has arrived: two copies at once share
    the link, and the step, which needs this one, would start later (on a TPU v5e each fit's first batch of 512 MB
    took about 110 ms to arrive beside the second's copy, 55 ms alone, 2026-12-07). Where nothing is sent ahead on
    a CPU (the default there, and with a mesh), the NumPy arrays of a source that ``refills`` them (not read ahead)
    are copied on the host, as NumPy arrays: a step called on them on a CPU reads them after the call returns (JAX
    passes them without a copy), when the source may already be refilling them for the next batch; the step is the
    same program on the same values."""
    if not self.enabled:
      copied = self._refills and not self._ahead and jax.default_backend() == 'cpu'
      return _host_copy(data) if copied else data
    copy = _copy_at_step(data)
    if copy is None:
      return data
    self._late = self._hand_copies[unit] = copy
    return copy

  def dispatched(self, outputs, piece: Optional[int] = None, pieces: int = 1) -> None:
    """The step of the batch in hand's unit ``piece`` (``None``: the whole batch; else of ``pieces``) was
    dispatched (``outputs``: any of its results): send the next unit."""
    self.sender.dispatched(outputs)
    if not self.enabled or self._in_hand is None:
      return
    if self._late is not None:  # the running step's own data, copied at its call: the next copy starts after it
      jax.block_until_ready(self._late)
      self._late = None
    # the steps before this one are done, so their units' copies are complete: holding them would keep every piece
    # of a streamed batch on the device until its end (on a TPU v5e the 13th piece of 512 MB found no room, 2026-12-07)
    self._hand_copies = {piece: self._hand_copies[piece]} if piece in self._hand_copies else {}
    if piece is not None and piece + 1 < pieces:
      self._send(self._in_hand.batch, piece + 1, self._in_hand.sent, self._hand_copies)
      return
    unit = None if piece is None else 0  # the following batch's first unit
    if not self._ahead:  # sent when the loop asks for that batch (:meth:`__iter__`), after this one is recorded
      self._next_unit = unit
      return
    following = self._following
    if following is not _NOTHING and _signature(following) == _signature(self._in_hand.batch):
      self._send(following, unit, self._first, self._following_copies)

  def _send(self, batch, unit: Optional[int], into: dict, copies: dict) -> None:
    """Send ``unit`` of ``batch`` (``None``: all of it) into ``into``."""
    if unit is None:
      data = batch
    else:
      units = self._units(*batch)
      if units is None:
        return
      data = units[unit][2]()
    sent = self.sender.send(data)
    if sent is not None:
      into[unit] = copies[unit] = sent


_NOTHING = object()  # the source's end
_NO_UNIT = object()  # no unit of the next batch to send as it is read
