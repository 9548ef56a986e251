"""Choosing the number of micro-batches from XLA's compile-time memory analysis.

Instead of running steps until one runs out of memory, the planner compiles
the train step ahead of time for candidate micro-batch sizes (no step is
executed) and keeps the largest micro-batch, i.e. the fewest micro-batches,
whose compiled step fits the budget. The memory of a compiled step is
``argument + output + temp - alias`` bytes of
``jax.stages.Compiled.memory_analysis()``: deterministic and available on CPU.
"""

import re
from typing import Callable, List, Optional, Sequence, Tuple, Union

from ..core._cut import is_int

__all__ = ['parse_memory', 'format_memory', 'compiled_step_bytes', 'candidate_micro_batch_sizes',
           'largest_fitting', 'choose_micro_batch_size']

_UNITS = {'': 1, 'B': 1, 'KB': 10 ** 3, 'MB': 10 ** 6, 'GB': 10 ** 9, 'TB': 10 ** 12,
          'KIB': 2 ** 10, 'MIB': 2 ** 20, 'GIB': 2 ** 30, 'TIB': 2 ** 40}


def parse_memory(value: Union[int, str]) -> int:
  """Bytes from an int or a string such as ``'512MiB'``, ``'2GiB'`` or ``'1.5GB'``.

  Examples
  --------
  >>> from brainpy_accum import parse_memory
  >>> parse_memory('2GiB'), parse_memory('512 MiB'), parse_memory(1000)
  (2147483648, 536870912, 1000)
  """
  if not is_int(value) and not isinstance(value, str):
    raise TypeError(f"memory_budget={value!r} must be bytes (int) or a string like '512MiB' or '2GiB'.")
  if is_int(value):
    number, unit = int(value), ''
  else:
    match = re.fullmatch(r'\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*', value)
    if match is None or match.group(2).upper() not in _UNITS:
      raise ValueError(f"memory_budget={value!r} is not a size: write bytes or e.g. '512MiB', '2GiB', '1.5GB'.")
    number, unit = float(match.group(1)), match.group(2).upper()
  size = int(number * _UNITS[unit])
  if size <= 0:
    raise ValueError(f'memory_budget={value!r} must be positive.')
  return size


def format_memory(num_bytes: int) -> str:
  """``'12.3 MiB'``-style text."""
  for unit, size in (('GiB', 2 ** 30), ('MiB', 2 ** 20), ('KiB', 2 ** 10)):
    if num_bytes >= size:
      return f'{num_bytes / size:.1f} {unit}'
  return f'{num_bytes} B'


def compiled_step_bytes(compiled) -> int:
  """Memory of a compiled step: arguments, outputs and temporaries, less buffers aliased in place.

  Parameters
  ----------
  compiled : jax.stages.Compiled
    What ``jax.jit(f).lower(...).compile()`` (or a BrainPy trainer's ``f_train.compile(...)``) returns.

  Examples
  --------
  >>> import jax, jax.numpy as jnp
  >>> from brainpy_accum import compiled_step_bytes
  >>> compiled = jax.jit(lambda x: x * 2).lower(jnp.ones(1024, jnp.float32)).compile()
  >>> compiled_step_bytes(compiled) >= 2 * 4096  # the argument and the output
  True
  """
  stats = compiled.memory_analysis()
  return (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
          - stats.alias_size_in_bytes)


def candidate_micro_batch_sizes(batch_size: int) -> List[int]:
  """The distinct ``ceil(batch_size / N)`` for ``N = 1 .. batch_size``, largest first (fewest micro-batches)."""
  return sorted({-(-batch_size // n) for n in range(1, batch_size + 1)}, reverse=True)


def largest_fitting(sizes: Sequence[int], budget: int, measure: Callable[[int], int]) -> Optional[Tuple[int, int]]:
  """``(size, bytes)`` of the largest of ``sizes`` (largest first) whose ``measure`` fits ``budget``, or ``None``.

  Binary search, assuming memory grows with the size: the smallest size is
  measured first, then about ``log2(len(sizes))`` more.
  """
  measured = {}

  def fits(i):
    measured[sizes[i]] = measure(sizes[i])
    return measured[sizes[i]] <= budget

  low, high = 0, len(sizes) - 1
  if not fits(high):
    return None
  while low < high:
    middle = (low + high) // 2
    if fits(middle):
      high = middle
    else:
      low = middle + 1
  return sizes[low], measured[sizes[low]]


def choose_micro_batch_size(batch_size: int, budget: int, measure: Callable[[int], int]) -> Tuple[int, int]:
  """Return ``(micro_batch_size, bytes)``: the largest candidate whose ``measure`` fits ``budget``.

  Binary search over :func:`candidate_micro_batch_sizes`, assuming memory
  grows with the micro-batch size; each probe is one ahead-of-time compilation.

  Raises
  ------
  ValueError
    If even one sample per micro-batch does not fit, naming the smallest figure that would.
  """
  measured = {}

  def measure_recorded(size):
    measured[size] = measure(size)
    return measured[size]

  found = largest_fitting(candidate_micro_batch_sizes(batch_size), budget, measure_recorded)
  if found is None:
    need = measured[1]
    raise ValueError(f'memory_budget={format_memory(budget)} ({budget} bytes) is too small: even micro-batches of '
                     f'one sample need {format_memory(need)} ({need} bytes) for a batch of '
                     f'{batch_size}. Raise memory_budget to at least {need}, or use remat=True.')
  return found
