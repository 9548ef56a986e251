"""The device's own memory: the budget it gives, the budget as planning checks against it, and the out-of-memory
errors the device raises.

On a GPU or TPU ``jax.Device.memory_stats()`` reports the memory a program may use (``bytes_limit``) and what
arrays hold now (``bytes_in_use``); a CPU reports nothing. :class:`Budget` turns ``memory_budget`` into bytes:
a size as given, a share of the device (``'90%'``), or with no ``memory_budget`` the device's limit less what
other arrays hold and a margin (:data:`DEVICE_MARGIN`). It is worked out when planning first needs it, so
that the arrays the user put on the device by then are counted, and kept for the trainer's life.
:class:`PlanBudget` is that budget as a planner sees it: with the step's own arguments (the trainer's Variables,
the batch in hand) counted in, checked again at the start of each fit, and the errors of a batch it cannot hold.

A program too large for the device is refused when XLA compiles it, with ``RESOURCE_EXHAUSTED``: on a TPU
"Ran out of memory in memory space hbm ... the total memory required for HLO temporaries (17.38G) exceeds
available HBM (15.75G)", on a GPU "Out of memory while trying to allocate ...". For the planner such a refusal
is a measurement, the candidate does not fit, with the size the message names (:func:`refused_bytes`,
:func:`refusal_measured`).
"""

import os
import re
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Union

import jax

from ._budget import PlannedStep, StepMemory, format_memory, parse_memory

__all__ = ['DEVICE_MARGIN', 'Budget', 'DeviceMemory', 'PlanBudget', 'as_fraction', 'device_memory',
           'host_available_bytes', 'is_out_of_memory', 'is_refused_program', 'refusal_measured', 'refused_bytes']

# Of the device's limit, kept free when the budget is the device's own: XLA's memory analysis counts the
# program's buffers, not the runtime's own allocations, the executable itself or the allocator's fragmentation.
# On a TPU v5e plans of up to 14.7 GiB of its 15.75 GiB ran without a run-time out-of-memory error; where a
# smaller margin fails was not measured. The run-time retry (:mod:`~brainpy_accum.memory._oom`) catches a plan
# that still does not fit.
DEVICE_MARGIN = 0.05


class DeviceMemory(NamedTuple):
  """What a device reports of its memory: ``limit`` usable bytes, ``in_use`` held by arrays now, its ``kind``,
  and ``reserved``: the temporaries its loaded programs reserve (a TPU keeps them beside every array)."""
  limit: int
  in_use: int
  kind: str
  reserved: int = 0


def device_memory(device: Optional[jax.Device] = None) -> Optional[DeviceMemory]:
  """The memory of ``device`` (the first device by default), or ``None`` where it reports none (a CPU).

  Examples
  --------
  >>> import jax
  >>> from brainpy_accum.memory._device import device_memory
  >>> device_memory() is None or device_memory().limit > 0
  True
  """
  device = device or jax.devices()[0]
  try:
    stats = device.memory_stats()
  except Exception:  # noqa: BLE001 -- a backend without memory statistics
    stats = None
  if not stats or 'bytes_limit' not in stats:
    return None
  kind = getattr(device, 'device_kind', '') or ''
  if not kind.upper().startswith(device.platform.upper()):  # 'TPU v5 lite' names its platform already
    kind = f'{device.platform.upper()} {kind}'.strip()
  return DeviceMemory(int(stats['bytes_limit']), int(stats.get('bytes_in_use', 0)), kind,
                      int(stats.get('bytes_reserved', 0)))


def host_available_bytes() -> Optional[int]:
  """The host memory this process may still allocate without swapping: the least of Linux's ``MemAvailable``
  and the room left under its control group's limit (a container's), where they can be read; ``None`` where
  neither can (another system). A CPU device reports no memory of its own (:func:`device_memory`), and a program
  too large for the host is not refused there: the system stops the process.

  Examples
  --------
  >>> from brainpy_accum.memory._device import host_available_bytes
  >>> host_available_bytes() is None or host_available_bytes() > 0
  True
  """
  rooms = [_read_number('/proc/meminfo', 'MemAvailable:', 1024)]
  for limit, used in (('memory.max', 'memory.current'),  # (cgroup v2, then v1; 'max' or a huge limit: none)
                      ('memory/memory.limit_in_bytes', 'memory/memory.usage_in_bytes')):
    limit, used = (_read_number(os.path.join('/sys/fs/cgroup', name)) for name in (limit, used))
    if limit is not None and used is not None and limit < 2 ** 60:
      rooms.append(max(0, limit - used))
  rooms = [room for room in rooms if room is not None]
  return min(rooms) if rooms else None


def _read_number(path: str, key: Optional[str] = None, unit: int = 1) -> Optional[int]:
  """The number in the file at ``path`` (on the line that starts with ``key``, its first figure), times
  ``unit``; ``None`` where the file or the number is missing."""
  try:
    with open(path) as text:
      for line in text:
        if key is None or line.startswith(key):
          return int(line.split()[1 if key else 0]) * unit
  except (OSError, ValueError, IndexError):
    pass
  return None


def as_fraction(value) -> Optional[float]:
  """``0.9`` of ``'90%'``; ``None`` if ``value`` is not a percentage."""
  match = re.fullmatch(r'\s*([0-9]*\.?[0-9]+)\s*%\s*', value) if isinstance(value, str) else None
  return None if match is None else float(match.group(1)) / 100


class Budget:
  """``memory_budget`` in bytes: as given, a share of the device, or the device's own limit.

  Parameters
  ----------
  value : int, str or None
    Bytes, a size such as ``'2GiB'``, a share of the device such as ``'90%'``, or ``None`` for the device's
    limit less what other arrays hold and :data:`DEVICE_MARGIN`.
  device : jax.Device, optional
    The device whose memory counts (the first device by default).

  Raises
  ------
  ValueError
    If ``value`` is a share or ``None`` and the device reports no memory limit (a CPU): then the size must be
    given.

  Examples
  --------
  >>> from brainpy_accum.memory._device import Budget
  >>> budget = Budget('64MiB')
  >>> budget.bytes(), budget.describe()
  (67108864, 'memory_budget 64.0 MiB')
  """

  def __init__(self, value: Union[int, str, None], device: Optional[jax.Device] = None):
    self.value, self.device = value, device
    self._share = as_fraction(value)
    self._given = None if value is None or self._share is not None else parse_memory(value)
    if self._share is not None and not 0 < self._share <= 1:
      raise ValueError(f'memory_budget={value!r} must be a share of the device between 0% and 100%, e.g. '
                       f"memory_budget='90%'.")
    self._bytes: Optional[int] = self._given
    self._source = 'memory_budget'
    if self._given is None and device_memory(device) is None:
      if self._share is not None:
        raise ValueError(f'memory_budget={value!r} is a share of the device\'s memory, but {_device_name(device)} '
                         f"reports no memory limit (a CPU has none): pass the bytes, e.g. memory_budget='2GiB'.")
      raise ValueError(f"num_micro_batch='auto' needs memory_budget, e.g. memory_budget='2GiB': without one it "
                       f"plans against the device's own memory, but {_device_name(device)} reports no memory limit "
                       f'(a CPU has none).')

  @property
  def from_device(self) -> bool:
    """Whether the bytes come from the device's memory (``None`` or a share), not from a size given."""
    return self._given is None

  def bytes(self, held: Callable[[], int] = lambda: 0) -> int:
    """The budget in bytes, worked out at the first call and kept. ``held()``: bytes of arrays now on the device
    that the step takes as its own arguments (the trainer's Variables): they count in the step's memory, so
    they are not taken off the device's limit as arrays of others."""
    if self._bytes is None:
      memory = device_memory(self.device)
      others = max(0, memory.in_use - held())
      share = self._share if self._share is not None else 1 - DEVICE_MARGIN
      # rounded down to 1/1024 of the limit, so that a rerun with a few bytes more or less in use plans (and
      # finds its cached plans) under the same budget
      grain = max(1, memory.limit // 1024)
      self._bytes = max(grain, (int(share * memory.limit) - others) // grain * grain)
      self._source = (f'{format_memory(self._bytes)} of {memory.kind}: '
                      f'{"" if self._share is None else self.value + " of "}its limit {format_memory(memory.limit)}'
                      f'{f" less {format_memory(others)} held by other arrays" if others else ""}'
                      f'{f" and a margin of {DEVICE_MARGIN:.0%}" if self._share is None else ""}')
    return self._bytes

  def recheck(self, held: Callable[[], int] = lambda: 0) -> Optional[int]:
    """Where the budget comes from the device: worked out again from what other arrays hold now. If the device
    has less room than when the budget was worked out (arrays put there since, such as the user's own), the new,
    smaller budget is kept and returned, for plans made under the old one to be checked; else ``None`` (the
    budget stands: plans that fit it still fit).

    Examples
    --------
    >>> from brainpy_accum.memory._device import Budget
    >>> Budget('64MiB').recheck() is None  # a size given never changes
    True
    """
    if self._given is not None or self._bytes is None:
      return None
    before, source = self._bytes, self._source
    self._bytes = None
    now = self.bytes(held)
    if now >= before:
      self._bytes, self._source = before, source
      return None
    return now

  def named(self) -> str:
    """The budget as an error names it: ``memory_budget=...`` as given, or the device's (see :meth:`describe`)."""
    return self.describe() if self._given is None else f'memory_budget={format_memory(self._given)}'

  def describe(self) -> str:
    """Which budget plans are made against, and where it comes from, for the plan lines."""
    if self._given is not None:
      return f'memory_budget {format_memory(self._given)}'
    if self._bytes is None:
      return f"the device's memory{'' if self._share is None else f' ({self.value})'}"
    return f"the device's memory ({self._source})"


class PlanBudget:
  """The budget a planner plans against: a :class:`Budget` with the arrays the step holds as its own counted in,
  checked again at the start of each fit, and the errors of a batch it cannot hold.

  The trainer's Variables and the batch in hand are on the device already, and they are the step's arguments,
  counted in its memory: they are not taken off the device's limit as arrays of others (:meth:`Budget.bytes`).
  A batch streamed in pieces runs each piece's step beside the batch's model state, which streaming keeps twice:
  those bytes are noted for the piece (:meth:`note_beside`) and counted when the plans are checked again
  (:meth:`stale`).

  Parameters
  ----------
  budget : Budget, optional
    The memory budget (``None``: none, a fixed cut).
  variables : callable
    ``variables()``: every Variable a step reads or writes (the planned model's).

  Examples
  --------
  >>> from brainpy_accum.memory._device import Budget, PlanBudget
  >>> budget = PlanBudget(Budget('2KiB'), variables=lambda: [])
  >>> budget.bytes(), budget.stale(None, None, {64: 1800})  # a size given never changes
  (2048, [])
  """

  def __init__(self, budget: Optional[Budget], variables: Callable[[], list]):
    self.budget, self.variables = budget, variables
    self._in_hand = 0  # bytes of the batch being planned that are on the device already (arguments of its step)
    self._beside: Dict[int, int] = {}  # piece size -> bytes held beside its step (the batch's model state, twice)

  def bytes(self) -> Optional[int]:
    """The budget in bytes (``None`` without one); the device's is worked out at its first use."""
    return None if self.budget is None else self.budget.bytes(held=self.held)

  def bytes_or_device(self) -> int:
    """The budget in bytes, or without one the device's own (raises ``ValueError`` where it reports none)."""
    return (self.budget or Budget(None)).bytes(held=self.held)

  def held(self) -> int:
    """Bytes the trainer's own Variables and the batch in hand hold on the device: the step's arguments,
    counted in its memory."""
    return self._in_hand + sum(int(v.value.nbytes) for v in self.variables() if isinstance(v.value, jax.Array))

  def hold(self, inputs: Any, targets: Any) -> None:
    """The batch in hand is ``inputs, targets``: its bytes on the device are the step's own."""
    self._in_hand = sum(int(x.nbytes) for x in jax.tree_util.tree_leaves((inputs, targets))
                        if isinstance(x, jax.Array))

  def note_beside(self, piece: int, held: int) -> None:
    """The step of a piece of ``piece`` samples runs beside ``held`` bytes (the batch's model state, twice)."""
    self._beside[piece] = max(self._beside.get(piece, 0), held)

  def stale(self, inputs: Any, targets: Any, used: Dict[int, int]) -> List[int]:
    """The sizes whose step (``used``: bytes by size) no longer fits, with the batch in hand ``inputs, targets``.

    With the device's own budget, other arrays put on the device since the plans were made (the user's own)
    leave less room, and a plan made under the old budget would overfill the device (its temporaries are
    reserved beside every array: the TPU runtime then evicts and reloads programs, slowly, or fails to load
    one); the smaller budget is kept (:meth:`Budget.recheck`). A size given never changes: nothing is stale.
    """
    self.hold(inputs, targets)
    now = None if self.budget is None or not used else self.budget.recheck(held=self.held)
    return sorted(size for size, bytes_ in used.items() if now is not None and bytes_ + self._beside.get(size, 0) > now)

  @property
  def from_device(self) -> bool:
    """Whether the bytes come from the device's memory (:attr:`Budget.from_device`)."""
    return self.budget.from_device

  def named(self) -> str:
    """The budget as an error names it (:meth:`Budget.named`)."""
    return self.budget.named()

  def describe(self) -> str:
    """The budget as the plan lines name it (:meth:`Budget.describe`)."""
    return self.budget.describe()

  def too_small(self, what: str, need: int) -> ValueError:
    """The error of a batch (``what``) that the device's own memory does not hold: there is no
    ``memory_budget`` to raise, so it names the other fixes."""
    share = '' if self.budget.value is None or self.budget.value.strip() == '100%' else (
      ", a larger share of the device (memory_budget='100%')")
    return ValueError(f'The train step of {what} needs {format_memory(need)} ({need} bytes), more than '
                      f'{self.describe()}. Use remat=True, fewer time steps, smaller batches{share} or a '
                      f'device with more memory.')

  def check_whole_batch(self, batch_size: int, fixed: int, kept_whole: bool) -> None:
    """Where the step keeps the whole batch on the device (``kept_whole``: ``whole_batch_loss=True``, never
    streamed), refuse by arithmetic data that cannot fit: ``fixed`` bytes, its data, Variables and updated
    parameters, over the budget."""
    budget = self.bytes()
    if kept_whole and fixed > budget and self.from_device:
      raise self.too_small(f'batch {batch_size}, whose data, Variables and updated parameters '
                           f'whole_batch_loss=True keeps on the device,', fixed)
    if kept_whole and fixed > budget:
      raise ValueError(f'{self.named()} ({budget} bytes) is too small for batch {batch_size}: its '
                       f'data, the Variables and the updated parameters alone take at least {format_memory(fixed)} '
                       f'({fixed} bytes), and whole_batch_loss=True keeps the whole batch on the device (it is not '
                       f'streamed from the host in chunks). Raise memory_budget above {fixed}, or pass smaller '
                       f'batches.')


def _device_name(device: Optional[jax.Device]) -> str:
  device = device or jax.devices()[0]
  return f'the {device.platform.upper()} device'


# What JAX raises when the device runs out of memory, in every Python type it uses: ``JaxRuntimeError``
# (compile-time refusal, "Ran out of memory in memory space hbm"; a run-time buffer, TPU E0100
# "RuntimeBufferAllocationFailure"; a GPU's "Out of memory while trying to allocate"), and ``ValueError`` (a TPU
# program that cannot be loaded, E0101 "RuntimeProgramAllocationFailure: ... Attempting to reserve 8.54G at the
# bottom of memory", measured on a TPU v5e with JAX 0.10.2).
_OUT_OF_MEMORY = ('RESOURCE_EXHAUSTED', 'Out of memory while trying to allocate', 'RuntimeBufferAllocationFailure',
                  'RuntimeProgramAllocationFailure', 'Ran out of memory in memory space')


def is_out_of_memory(error: BaseException) -> bool:
  """Whether ``error`` says that the device is out of memory: at compile time (a program too large for it), when
  a program is loaded (its temporaries cannot be reserved) or at run time (a buffer cannot be allocated),
  whatever Python type JAX raises it as. The host's own ``MemoryError`` is not the device's.

  Examples
  --------
  >>> from brainpy_accum.memory._device import is_out_of_memory
  >>> is_out_of_memory(ValueError('RESOURCE_EXHAUSTED: E0101: RuntimeProgramAllocationFailure: Error loading '
  ...                             "program 'jit_step': Attempting to reserve 12.02G at the bottom of memory."))
  True
  >>> is_out_of_memory(ValueError('shapes (3,) and (4,) do not match'))
  False
  """
  if not isinstance(error, Exception) or isinstance(error, MemoryError):
    return False
  text = str(error)
  return any(words in text for words in _OUT_OF_MEMORY)


# what XLA writes when it refuses to compile a program too large for the device (a TPU's words; a run that
# cannot allocate says "Out of memory while trying to allocate" or "Error allocating device buffer")
_REFUSED = ('exceeds available', 'memory space hbm', 'HLO temporaries', 'hbm capacity')


def is_refused_program(error: BaseException) -> bool:
  """Whether ``error`` is XLA refusing, at compile time, a program too large for the device (nothing ran)."""
  return is_out_of_memory(error) and any(words in str(error) for words in _REFUSED)


# Sizes as XLA writes them in its refusals: a bare K, M, G, T is binary (its "17.38G" is GiB), as are KiB..TiB;
# KB..TB are decimal (10 ** 3 ...), as :func:`~brainpy_accum.memory._budget.parse_memory` reads them everywhere.
_SIZES = {'': 1, 'B': 1, 'K': 2 ** 10, 'KIB': 2 ** 10, 'M': 2 ** 20, 'MIB': 2 ** 20, 'G': 2 ** 30, 'GIB': 2 ** 30,
          'T': 2 ** 40, 'TIB': 2 ** 40, 'KB': 10 ** 3, 'MB': 10 ** 6, 'GB': 10 ** 9, 'TB': 10 ** 12}
# the program's own size in the messages XLA writes when it refuses one (TPU: "required for HLO temporaries
# (17.38G) exceeds available HBM"; "Used 17.38G of 15.75G hbm"; GPU: "allocate 18663604224 bytes")
_NAMED = (r'required for [^(]*\(\s*([0-9.]+)\s*([KMGT]?i?B?)\s*\)', r'Used\s+([0-9.]+)\s*([KMGT]?i?B?)\s+of',
          r'allocat\w*\s+([0-9.]+)\s*([KMGT]?i?B?)(?:ytes)?')


def refused_bytes(error: BaseException, at_least: int) -> int:
  """The bytes a refused program needs: the size XLA's message names, and never less than ``at_least`` (the
  budget plus one: it did not fit). Messages that name no size give ``at_least``.

  Examples
  --------
  >>> from brainpy_accum.memory._device import refused_bytes
  >>> error = RuntimeError('RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. the total memory '
  ...                      'required for HLO temporaries (17.38G) exceeds available HBM (15.75G).')
  >>> refused_bytes(error, 1) == int(17.38 * 2 ** 30)
  True
  """
  text = str(error)
  for pattern in _NAMED:
    match = re.search(pattern, text, flags=re.IGNORECASE)
    if match is not None:
      unit = match.group(2).upper().replace('YTES', '')
      if unit in _SIZES:
        return max(at_least, int(float(match.group(1)) * _SIZES[unit]))
  return at_least


def refusal_measured(compile_: Callable, budget: Callable[[], int], trial: bool) -> Callable:
  """``compile_(plan, *batch)`` (a quick probe, or with ``trial`` a compilation for training), with XLA's refusal
  of a program too large for the device taken as a measurement: the candidate does not fit, with the size the
  refusal names (at least ``budget()`` plus one); a refused trial is never run, never kept."""

  def measured(plan, *batch):
    try:
      return compile_(plan, *batch)
    except Exception as error:  # noqa: BLE001 -- only the device's out-of-memory refusal is a measurement
      if not is_out_of_memory(error):
        raise
      memory = StepMemory(refused_bytes(error, budget() + 1), 0)
      return PlannedStep(memory, _never_run, _never_kept) if trial else memory

  return measured


def _never_run():
  raise RuntimeError('A step that does not fit the device is never run.')


def _never_kept():
  """A refused step: nothing to keep."""
