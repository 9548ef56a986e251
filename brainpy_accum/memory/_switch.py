"""A choice the device makes, which a ``with`` block can make instead: for the tests, which run on a CPU, and for
the benchmarks' comparisons (whether the planner compiles the whole batch first, whether ``fit`` sends data ahead,
whether the first-batch check starts before the first step).
"""

import contextlib
from typing import Callable, Iterator, Optional

__all__ = ['DeviceSwitch']


class DeviceSwitch:
  """``switch()``: what ``by_device()`` says, unless inside ``with switch.set(enabled)`` with ``enabled`` not
  ``None`` (``True`` or ``False``: that, whatever the device; ``None``: the device's choice again). The setting in
  force before the ``with`` comes back after it, also on an error.

  Examples
  --------
  >>> switch = DeviceSwitch(lambda: False)
  >>> with switch.set(True):
  ...   inside = switch()
  >>> inside, switch()
  (True, False)
  """

  def __init__(self, by_device: Callable[[], bool]):
    self._by_device, self._set = by_device, None

  def __call__(self) -> bool:
    return self._by_device() if self._set is None else self._set

  @contextlib.contextmanager
  def set(self, enabled: Optional[bool]) -> Iterator[None]:
    before, self._set = self._set, None if enabled is None else bool(enabled)
    try:
      yield
    finally:
      self._set = before
