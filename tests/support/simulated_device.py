"""A CPU standing in for an accelerator of a given memory, for the tests of what only a GPU or TPU does.

Inside :func:`simulated_device` the device reports ``limit`` bytes (``brainpy_accum``'s view of
``memory_stats()``), and XLA refuses to compile every program whose memory (arguments + outputs + temporaries -
aliases, as ``memory_analysis()`` gives it) exceeds ``limit``, with the error a TPU raises:
``RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm ... required for HLO temporaries (...) exceeds
available HBM (...)``. The program is compiled for real and refused afterwards: the planner sees exactly what
it would see on the device, with the CPU's sizes.
"""

import contextlib
from typing import List

import jax
from jax._src import compiler

from brainpy_accum.memory import _device


def _size(num_bytes: int) -> str:
  """XLA's way of writing a size: ``17.38G``, ``120.56K``."""
  for unit, scale in (('G', 2 ** 30), ('M', 2 ** 20), ('K', 2 ** 10)):
    if num_bytes >= scale:
      return f'{num_bytes / scale:.2f}{unit}'
  return f'{num_bytes}B'


@contextlib.contextmanager
def simulated_device(monkeypatch, limit: int, in_use: int = 0):
  """While inside: a device of ``limit`` bytes (``in_use`` held by other arrays) that refuses larger programs.
  Yields the list of the sizes it refused."""
  refused: List[int] = []
  real = compiler.compile_or_get_cached

  def refusing(*args, **kwargs):
    executable = real(*args, **kwargs)
    stats = executable.get_compiled_memory_stats()
    total = (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
             - stats.alias_size_in_bytes)
    if total > limit:
      refused.append(total)
      raise jax.errors.JaxRuntimeError(
        f'RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. the total memory required for HLO '
        f'temporaries ({_size(total)}) exceeds available HBM ({_size(limit)}).')
    return executable

  with monkeypatch.context() as patch:
    patch.setattr(compiler, 'compile_or_get_cached', refusing)
    patch.setattr(_device, 'device_memory',
                  lambda device=None: _device.DeviceMemory(limit, in_use, 'TPU (simulated on the CPU)'))
    yield refused
